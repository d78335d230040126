"""auxout's per-request output fields on each completion, in vLLM's frontend.

The engine core reports a request's route manifest (keys-only output), its recomputed prefix
tokens, the reason its rows came inline and where a prefix-cache reset hit it in that request's
``kv_transfer_params``. With
``n > 1`` vLLM runs one engine request per completion but keeps one ``kv_transfer_params`` per
``RequestOutput``, the last finishing child's: every other completion would be handed a
sibling's manifest. :func:`install_completion_fields` (frontend process) copies those fields
onto the ``CompletionOutput`` they belong to, as attributes named by the same keys
(``completion.auxout_routes_manifest``), and with ``n > 1`` removes them from the request's
``kv_transfer_params``, where they would name one completion only.
"""

from __future__ import annotations

from typing import Any

from auxout.vllm.options import (
    INLINE_REASON_FIELD,
    MANIFEST_FIELD,
    RECOMPUTED_FIELD,
    RESET_AT_FIELD,
)

COMPLETION_FIELDS = (MANIFEST_FIELD, RECOMPUTED_FIELD, INLINE_REASON_FIELD, RESET_AT_FIELD)
_KV_PARAMS_ARG = 4  # make_request_output(new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params, ...)
_INSTALLED = False


def completion_field(completion: Any, request_output: Any, key: str) -> Any:
    """``key`` for one completion: its own attribute, else the request's ``kv_transfer_params``
    (a frontend without :func:`install_completion_fields`; there only ``n=1`` is unambiguous)."""
    own = getattr(completion, key, None)
    if own is not None:
        return own
    return (getattr(request_output, "kv_transfer_params", None) or {}).get(key)


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
        fields = {k: params[k] for k in COMPLETION_FIELDS if k in params}
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
        fields = getattr(self, "_auxout_fields", None)
        if fields:
            for key, value in fields.items():
                setattr(output, key, value)
        return output

    RequestState.make_request_output = make_request_output  # type: ignore[method-assign]
    RequestState._new_completion_output = _new_completion_output  # type: ignore[method-assign]
    _INSTALLED = True
