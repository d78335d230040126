"""The CPU worker with routes (its own module: vLLM's CPU worker imports CPU-only code)."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from auxout.integrations.vllm.worker import AuxoutWorkerMixin


class AuxoutCPUWorker(AuxoutWorkerMixin, CPUWorker):
    """vLLM's CPU worker plus route capture and auxout's worker connector."""

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().compile_or_warm_up_model(*args, **kwargs)
        ensure_pp_receive_buffers(self.model_runner)
        return result


def ensure_pp_receive_buffers(runner: Any) -> None:
    """Allocate the buffers a non-first PP stage receives hidden states into, if still missing.

    vLLM's GPU runner allocates them in its warm-up dummy run; vLLM-CPU skips that run when the
    model runs eagerly with an explicit KV cache size (``VLLM_CPU_KVCACHE_SPACE``), so the first
    real step of stage 2 fails (``assert self.intermediate_tensors is not None`` in
    ``sync_and_gather_intermediate_tensors``) and the engine core then dies with a ``KeyError``
    on a request id in ``Scheduler.update_from_output``. Same allocation as the dummy run.
    """
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )
