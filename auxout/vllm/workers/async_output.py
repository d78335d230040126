"""The worker's routes for a step whose model-runner output arrives asynchronously.

Under async scheduling vLLM's model runner returns an ``AsyncModelRunnerOutput`` from
``sample_tokens``: the sampled ids are still being copied to the host while the next step is
scheduled and executed. How many tokens each request sampled (and so which rows are kept) is
only known once ``get_output()`` resolves, which the multiprocess executor does on a separate
output thread. :class:`RoutedAsyncOutput` defers the worker connector's ``process_output`` to
that moment; the connector's lock (held by the worker around every connector call) orders it
against the next step's ``begin_step``/``prepare_output`` on the main thread. The connector
accepts either order (it keeps up to ``max_concurrent_batches`` steps in flight).
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput


class RoutedAsyncOutput(AsyncModelRunnerOutput):
    """An ``AsyncModelRunnerOutput`` whose resolved output carries the step's routes."""

    def __init__(
        self, inner: AsyncModelRunnerOutput, commit: Callable[[ModelRunnerOutput], ModelRunnerOutput]
    ) -> None:
        self._inner = inner
        self._commit = commit

    def get_output(self) -> ModelRunnerOutput:
        return self._commit(self._inner.get_output())
