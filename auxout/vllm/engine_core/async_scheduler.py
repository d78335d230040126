"""auxout's scheduler on top of vLLM's ``AsyncScheduler``, and the class vLLM is given.

vLLM turns async scheduling on by default on GPUs (one step scheduled while the previous one
runs) and picks ``AsyncScheduler`` for it, but a custom ``scheduler_cls`` replaces that choice.
A plain ``Scheduler`` subclass would silently cost users async scheduling, so
:class:`AuxoutSchedulerSelector` (what ``engine_kwargs`` names) builds auxout's bridge on
whichever base the final config asks for, the way vLLM picks its diffusion schedulers: the
platform hook has the last word on ``async_scheduling`` (vLLM-CPU forces it off), and the
scheduler is only built after it ran.

``AuxoutAsyncScheduler(AuxoutScheduler, AsyncScheduler)`` linearizes to
``AuxoutScheduler -> AsyncScheduler -> Scheduler``: the bridge's hooks wrap vLLM's async
bookkeeping (output placeholders, stale outputs after preemption) without repeating it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from auxout.vllm.engine_core.scheduler import AuxoutScheduler


class AuxoutAsyncScheduler(AuxoutScheduler, AsyncScheduler):
    """vLLM ``AsyncScheduler`` with routed experts (used when ``async_scheduling`` is on)."""


def scheduler_class(vllm_config: Any) -> type[AuxoutScheduler]:
    """The auxout scheduler matching the final ``scheduler_config.async_scheduling``."""
    return AuxoutAsyncScheduler if vllm_config.scheduler_config.async_scheduling else AuxoutScheduler


class AuxoutSchedulerSelector(AuxoutScheduler):
    """``scheduler_cls`` for vLLM: constructing it returns the sync or async auxout scheduler.

    An instance of this class itself is never made: ``__new__`` returns an instance of the
    chosen class (already initialized; Python skips ``__init__`` because it is not an instance
    of this class).
    """

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> AuxoutScheduler:  # type: ignore[misc]
        return scheduler_class(vllm_config)(vllm_config, *args, **kwargs)


__all__ = ["AuxoutAsyncScheduler", "AuxoutSchedulerSelector", "scheduler_class"]
