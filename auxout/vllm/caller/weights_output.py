"""Routing weights in vLLM's frontend: split the engine's (id, weight) rows for the user.

With ``routing_weights=True`` the engine core hands a request that asked for the weights its
rows as ``uint8 [n, L, K, item bytes]`` (:func:`auxout.profile.rows_as_bytes`: vLLM's messages
carry no structured arrays). When vLLM builds the finished ``CompletionOutput`` in the process
that made the request (the ``LLM`` caller's, or the API server's), :func:`install_weights_split`
turns them back into ``routed_experts`` (the ids, exactly as without weights) and
``routing_weights`` (float32, same shape). Requests that did not ask get plain ids from the
engine and are untouched.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from auxout.profile import is_route_bytes, rows_from_bytes, split_rows
from auxout.vllm.options import WEIGHTS_OUTPUT

_INSTALLED = False
logger = logging.getLogger("auxout.vllm")


def split_output(output: Any) -> None:
    """Replace a ``CompletionOutput``'s byte rows by ids + ``routing_weights`` (no-op for ids).

    Runs inside vLLM's output loop, where an exception would stop the output of every request
    (a dead server): rows that cannot be read fail their own request instead (``finish_reason``
    ``"error"``, the reason in ``stop_reason``, as a request whose routes are unavailable)."""
    rows = getattr(output, "routed_experts", None)
    if isinstance(rows, np.ndarray) and is_route_bytes(rows):
        try:
            ids, weights = split_rows(rows_from_bytes(rows))
        except Exception as exc:
            logger.exception("auxout: the routing weights of a completion could not be read")
            output.routed_experts = None
            if output.finish_reason is not None:
                output.finish_reason = "error"
                output.stop_reason = f"auxout could not read its routes ({type(exc).__name__}: {exc})"
            return
        output.routed_experts = ids
        setattr(output, WEIGHTS_OUTPUT, weights)


def structured(chunk: np.ndarray) -> np.ndarray:
    """One per-step chunk as the engine sent it: ids, or byte rows back as (id, weight) rows."""
    return rows_from_bytes(chunk) if is_route_bytes(chunk) else chunk


def install_weights_split() -> None:
    """Wrap vLLM's ``RequestState._new_completion_output`` (idempotent; frontend process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.engine.output_processor import RequestState

    original = RequestState._new_completion_output

    def _new_completion_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        split_output(output)
        return output

    RequestState._new_completion_output = _new_completion_output  # type: ignore[method-assign]
    _INSTALLED = True
