"""Stopping an ``LLM``'s engine when its caller is done with it."""

from __future__ import annotations

from typing import Any


def stop_engine(llm: Any) -> None:
    """Stop ``llm``'s engine core (its process and workers, or the in-process one) now.

    Not left to the ``LLM``'s collection: at interpreter exit that can come after multiprocessing
    joins its children, which then waits for an engine-core process that never exits.
    """
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
