"""auxout for vLLM V1: scheduler and worker subclasses installed through engine arguments.

Nothing here patches vLLM: ``engine_kwargs()`` names auxout's ``scheduler_cls`` and
``worker_cls`` and carries the options in ``additional_config``.
"""

from auxout.integrations.vllm.config import engine_kwargs
from auxout.integrations.vllm.options import REQUEST_FLAG, VllmOptions
from auxout.integrations.vllm.weight_sync import (
    WeightSync,
    WeightSyncError,
    repair_moe_prepack,
    update_weights,
)

__all__ = [
    "REQUEST_FLAG",
    "VllmOptions",
    "WeightSync",
    "WeightSyncError",
    "engine_kwargs",
    "repair_moe_prepack",
    "update_weights",
]
