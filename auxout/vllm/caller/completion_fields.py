"""auxout's fields on each ``CompletionOutput``, set in the process that made the request.

One wrapper of vLLM's ``RequestState._new_completion_output`` (plus one of
``make_request_output``, which hands it the request's facts) sets every auxout field of a
completion, in the ``LLM`` caller's process or the API server's:

- **Routing weights.** With ``routing_weights=True`` the engine core hands a request that asked
  for the weights its rows as ``uint8 [n, L, K, item bytes]`` (:func:`auxout.profile.rows_as_bytes`:
  vLLM's messages carry no structured arrays). :func:`split_output` turns them back into
  ``routed_experts`` (the ids, exactly as without weights) and ``routing_weights`` (float32, same
  shape). Requests that did not ask get plain ids from the engine and are untouched.
- **Per-completion facts.** The engine core reports a request's route manifest (keys-only
  output), its recomputed prefix tokens, the reason its rows came inline and where a prefix-cache
  reset hit it in that request's ``kv_transfer_params``. With ``n > 1`` vLLM runs one engine
  request per completion but keeps one ``kv_transfer_params`` per ``RequestOutput``, the last
  finishing child's: every other completion would be handed a sibling's manifest. The wrapper
  copies those fields onto the ``CompletionOutput`` they belong to, as attributes named by the
  same keys (``completion.auxout_routes_manifest``), and with ``n > 1`` removes them from the
  request's ``kv_transfer_params``, where they would name one completion only.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from auxout.profile import is_route_bytes, rows_from_bytes, split_rows
from auxout.vllm.fields import COMPLETION_FACTS, ROUTES, WEIGHTS_OUTPUT

logger = logging.getLogger("vllm.auxout")  # under vLLM's logger: its handlers and format

_KV_PARAMS_ARG = 4  # make_request_output(new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params, ...)
_INSTALLED = False


def completion_field(completion: Any, request_output: Any, key: str) -> Any:
    """``key`` for one completion: its own attribute, else the request's ``kv_transfer_params``
    (a frontend without :func:`install_completion_fields`; there only ``n=1`` is unambiguous)."""
    own = getattr(completion, key, None)
    if own is not None:
        return own
    return (getattr(request_output, "kv_transfer_params", None) or {}).get(key)


def split_output(output: Any) -> None:
    """Replace a ``CompletionOutput``'s byte rows by ids + ``routing_weights`` (no-op for ids).

    Runs inside vLLM's output loop, where an exception would stop the output of every request
    (a dead server): rows that cannot be read fail their own request instead (``finish_reason``
    ``"error"``, the reason in ``stop_reason``, as a request whose routes are unavailable)."""
    rows = getattr(output, ROUTES, None)
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


def install_completion_fields() -> None:
    """Wrap vLLM's ``RequestState.make_request_output`` and ``_new_completion_output`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.engine.output_processor import RequestState

    make_output = RequestState.make_request_output
    new_completion = RequestState._new_completion_output

    def make_request_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        # (every live request, every step: the usual None passes straight through)
        params = args[_KV_PARAMS_ARG] if len(args) > _KV_PARAMS_ARG else kwargs.get("kv_transfer_params")
        if not params:
            return make_output(self, *args, **kwargs)
        fields = {k: params[k] for k in COMPLETION_FACTS if k in params}
        if not fields:
            return make_output(self, *args, **kwargs)
        in_kwargs = "kv_transfer_params" in kwargs
        if self.parent_req is not None:  # n > 1: the request-level copy would name one completion
            rest = {k: v for k, v in params.items() if k not in fields} or None
            if in_kwargs:
                kwargs["kv_transfer_params"] = rest
            else:
                args = (*args[:_KV_PARAMS_ARG], rest, *args[_KV_PARAMS_ARG + 1 :])
        self._auxout_fields = fields  # for the completion output built inside
        try:
            return make_output(self, *args, **kwargs)
        finally:
            self._auxout_fields = None

    def _new_completion_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = new_completion(self, *args, **kwargs)
        split_output(output)
        fields = getattr(self, "_auxout_fields", None)
        if fields:
            for key, value in fields.items():
                setattr(output, key, value)
        return output

    RequestState.make_request_output = make_request_output  # type: ignore[method-assign]
    RequestState._new_completion_output = _new_completion_output  # type: ignore[method-assign]
    _INSTALLED = True
