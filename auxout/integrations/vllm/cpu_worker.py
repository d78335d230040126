"""The CPU worker with routes (its own module: vLLM's CPU worker imports CPU-only code)."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from auxout.integrations.vllm.worker import AuxoutWorkerMixin


class AuxoutCPUWorker(AuxoutWorkerMixin, CPUWorker):
    """vLLM's CPU worker plus route capture and auxout's worker connector."""
