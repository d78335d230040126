"""Engine arguments that turn routed experts on in a vLLM engine."""

from __future__ import annotations

from typing import Any

from auxout.integrations.vllm.options import CONFIG_KEY, VllmOptions

SCHEDULER_CLS = "auxout.integrations.vllm.async_scheduler.AuxoutSchedulerSelector"
CPU_WORKER_CLS = "auxout.integrations.vllm.cpu_worker.AuxoutCPUWorker"
GPU_WORKER_CLS = "auxout.integrations.vllm.worker.AuxoutGPUWorker"


def default_worker_cls() -> str:
    """The auxout worker matching vLLM's current platform."""
    from vllm.platforms import current_platform

    return CPU_WORKER_CLS if current_platform.is_cpu() else GPU_WORKER_CLS


def engine_kwargs(**options: Any) -> dict[str, Any]:
    """Keyword arguments to merge into ``vllm.LLM(...)`` / ``EngineArgs(...)``.

    ``options`` are :class:`VllmOptions` fields (``store``, ``max_bytes``, ``default_return``,
    ``namespace``, ``store_options``); they travel in ``additional_config["auxout"]``, which
    vLLM pickles into its engine-core and worker processes.
    """
    opts = VllmOptions.from_dict(options)
    return {
        "scheduler_cls": SCHEDULER_CLS,
        "worker_cls": default_worker_cls(),
        "additional_config": {CONFIG_KEY: opts.to_dict()},
        "enable_prefix_caching": True,
        # async_scheduling is left to vLLM: the scheduler class follows the final setting.
    }
