"""auxout for vLLM V1: scheduler and worker subclasses installed through engine arguments.

Nothing here patches vLLM: ``engine_kwargs()`` names auxout's ``scheduler_cls`` and
``worker_cls`` and carries the options in ``additional_config``.
"""

from auxout.integrations.vllm.config import engine_kwargs
from auxout.integrations.vllm.options import REQUEST_FLAG, VllmOptions

__all__ = ["REQUEST_FLAG", "VllmOptions", "engine_kwargs"]
