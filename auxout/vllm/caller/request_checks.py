"""Frontend-side checks, so a bad request fails alone with a clear error (HTTP 400) and never reaches the engine.

Each of auxout's per-request fields has one place:

- ``routed_experts_prompt_start``: ``SamplingParams.routed_experts_prompt_start`` offline, the
  top-level body field over HTTP. A non-negative int (no bool, no string, no float); vLLM checks
  it against the prompt length.
- ``return_routed_experts`` and ``routed_experts_output``: ``SamplingParams.extra_args`` offline,
  ``vllm_xargs`` over HTTP. A bool, and ``"inline"`` or ``"keys"``.
- ``return_routing_weights``: ``SamplingParams.extra_args`` offline, a top-level body field over
  HTTP. A bool; true needs an engine started with ``routing_weights=True``.

The same field in the other place is rejected, never silently ignored; so is a key named like
one of them that is none (``return_routed_expert``), naming the field meant. vLLM turns a JSON
``false`` in ``vllm_xargs`` into ``0``, so behind the HTTP server (where
:mod:`auxout.vllm.server.body_checks` has already checked the raw JSON) the flag may be
0/1; offline it must be a real bool.

vLLM also skips its vocabulary check on prompt token ids when it runs without a tokenizer
(``skip_tokenizer_init``), and an id >= the vocabulary size then kills the engine (IndexError in
the embedding); :func:`check_prompt_token_ids` makes that check against the model's vocabulary,
with a tokenizer too, before vLLM's own (which names neither the field nor the position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from auxout.vllm.fields import (
    EXTRA_ARGS,
    HTTP_ONLY,
    OUTPUT_FLAG,
    PROMPT_START,
    REQUEST_FLAG,
    WEIGHTS_FLAG,
    WEIGHTS_SPLIT,
    misspelt_route_field,
    normalize_flag,
)
from auxout.vllm.options import SHARED_STORES, VllmOptions, options_from_vllm_config

_ELSEWHERE = {  # where a field meant by a misspelt extra_args key goes, if not in extra_args
    PROMPT_START: f"not an extra_args key: SamplingParams({PROMPT_START}=N) offline, a top-level field over HTTP",
    **{f: "a top-level field of auxout serve's HTTP API; offline, routes come back as arrays" for f in HTTP_ONLY},
}
_INSTALLED = False
_FLAG_AS_INT = False  # True behind the HTTP server: vLLM turned the JSON bool into 0/1 after our raw check


def _error(message: str, parameter: str, value: object) -> Exception:
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message, parameter=parameter, value=value)


def check_request_flag(
    params: Any, *, flag_as_int: bool | None = None, store: str | None = None, weights: bool | None = None
) -> None:
    """Raise vLLM's validation error (HTTP 400) for a bad auxout field on ``SamplingParams``.

    ``flag_as_int``: accept 0/1 for the flags (default: only behind the HTTP server).
    ``store``: the engine's route store, when known (keys-only output needs a shared one).
    ``weights``: whether the engine captures routing weights, when known.
    """
    as_int = _FLAG_AS_INT if flag_as_int is None else flag_as_int
    extra = getattr(params, "extra_args", None) or {}
    if REQUEST_FLAG in extra:
        value = extra[REQUEST_FLAG]
        if not isinstance(normalize_flag(value) if as_int else value, bool):
            raise _error(
                f"{REQUEST_FLAG} must be true or false (in extra_args / vllm_xargs), got {value!r}",
                REQUEST_FLAG,
                value,
            )
    if OUTPUT_FLAG in extra and extra[OUTPUT_FLAG] not in ("inline", "keys"):
        raise _error(
            f"{OUTPUT_FLAG} must be 'inline' or 'keys' (in extra_args / vllm_xargs), got {extra[OUTPUT_FLAG]!r}",
            OUTPUT_FLAG,
            extra[OUTPUT_FLAG],
        )
    asking = _fields_asking(extra, as_int)
    if asking and normalize_flag(extra.get(REQUEST_FLAG)) is False:
        name = asking[0]
        raise _error(
            f"{name}={extra[name]!r} asks for routes that {REQUEST_FLAG}=false turns off: drop one of the two",
            name,
            extra[name],
        )
    if extra.get(OUTPUT_FLAG) == "keys" and store is not None and store not in SHARED_STORES:
        raise _error(
            f"{OUTPUT_FLAG}='keys' needs a route store the trainer can reach ({' or '.join(SHARED_STORES)}); "
            f"this engine keeps routes in {store!r}: ask for 'inline' routes, or start it with a shared store",
            OUTPUT_FLAG,
            "keys",
        )
    if PROMPT_START in extra:
        raise _error(
            f"{PROMPT_START} is not read from extra_args / vllm_xargs: set it as "
            f"SamplingParams({PROMPT_START}=N) offline, or as a top-level field of the HTTP request body",
            PROMPT_START,
            extra[PROMPT_START],
        )
    if WEIGHTS_FLAG in extra:
        value = extra[WEIGHTS_FLAG]
        flag = normalize_flag(value) if as_int else value
        if not isinstance(flag, bool):
            raise _error(f"{WEIGHTS_FLAG} must be true or false (in extra_args), got {value!r}", WEIGHTS_FLAG, value)
        if flag and weights is False:
            raise _error(
                f"{WEIGHTS_FLAG}=true needs an engine that captures routing weights: start it with "
                "engine_kwargs(routing_weights=True) (auxout serve --auxout-routing-weights true)",
                WEIGHTS_FLAG,
                value,
            )
    for name in extra:
        if not isinstance(name, str) or name in EXTRA_ARGS:
            continue
        if name in HTTP_ONLY:
            hint: str | None = f"{name} is a field of auxout serve's HTTP API; offline, routes come back as arrays"
        else:  # (the field meant may be one that lives elsewhere: say where)
            hint = misspelt_route_field(name, (*EXTRA_ARGS, PROMPT_START, *HTTP_ONLY), _ELSEWHERE)
        if hint is not None:
            raise _error(f"unknown routes field {name} in extra_args / vllm_xargs: {hint}", name, extra[name])
    start = getattr(params, PROMPT_START, 0)
    if isinstance(start, np.integer) or (start is None and hasattr(params, PROMPT_START)):
        # (an index from numpy is an integer: passed on as Python's; None means unset, as null over HTTP)
        start = 0 if start is None else int(start)
        setattr(params, PROMPT_START, start)
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
        raise _error(f"{PROMPT_START} must be a non-negative integer, got {start!r}", PROMPT_START, start)
    if start and normalize_flag(extra.get(REQUEST_FLAG)) is False:
        raise _error(
            f"{PROMPT_START}={start} asks for routes that {REQUEST_FLAG}=false turns off: drop one of the two",
            PROMPT_START,
            start,
        )


def _fields_asking(extra: dict[str, Any], as_int: bool) -> list[str]:
    """auxout's ``extra_args`` entries in ``extra`` that ask for routes: an output kind, weights true."""
    weights = extra.get(WEIGHTS_FLAG)
    return [
        name for name, asks in (
            (OUTPUT_FLAG, OUTPUT_FLAG in extra),
            (WEIGHTS_FLAG, (normalize_flag(weights) if as_int else weights) is True),
        ) if asks
    ]  # fmt: skip


def asks_for_routes(params: Any) -> bool:
    """Whether a request that does not say ``return_routed_experts`` sends a route field (a
    prompt start, routing weights, an output kind): on an engine whose default is off, that field
    is its request for routes (``auxout serve`` reads its body the same way). Call after
    :func:`check_request_flag`."""
    extra = getattr(params, "extra_args", None) or {}
    if REQUEST_FLAG in extra:
        return False
    return bool(getattr(params, PROMPT_START, 0)) or bool(_fields_asking(extra, True))


def plain_token_ids(token_ids: Sequence[int] | np.ndarray) -> list[int]:
    """The prompt's token ids as a list of Python ints (the list itself when it is one already).

    vLLM sends them to the engine with msgpack, which takes neither numpy integers (an RL job's
    usual ids) nor floats: the request then fails after vLLM registered it, and the next
    ``generate`` on that ``LLM`` never returns. Numpy integers are converted; anything else that
    is not an integer (a float, a bool, a string) is a validation error naming its position.
    """
    types = set() if isinstance(token_ids, np.ndarray) else set(map(type, token_ids))  # (C-level map)
    if type(token_ids) is list and types <= {int}:
        return token_ids  # (the usual case)
    ids = np.asarray(token_ids)
    if bool in types or np.bool_ in types or ids.ndim != 1 or ids.dtype.kind not in "iu":
        flat = list(token_ids) if ids.ndim == 1 or ids.dtype == object else [token_ids]
        pos = next((i for i, x in enumerate(flat) if isinstance(x, bool | np.bool_) or not isinstance(x, int | np.integer)), 0)
        bad = flat[pos] if flat else token_ids
        raise _error(
            f"prompt token ids must be integers: position {pos} is {type(bad).__name__} {bad!r:.40}",
            "prompt",
            repr(bad)[:40],
        )
    return ids.tolist()


def check_prompt_token_ids(token_ids: Sequence[int] | np.ndarray, vocab_size: int) -> None:
    """Raise vLLM's validation error (HTTP 400) for a prompt token id outside ``[0, vocab_size)``."""
    if len(token_ids) == 0:
        return
    ids = np.asarray(token_ids)
    if ids.dtype.kind not in "iu":
        return  # not ints: plain_token_ids reports it
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        pos = int(bad[0])
        raise _error(
            f"prompt token id {int(ids[pos])} at position {pos} is out of vocabulary: this model has "
            f"{vocab_size} token ids (0..{vocab_size - 1}); {bad.size} id(s) out of range. Send token ids "
            "from this model's tokenizer.",
            "prompt",
            int(ids[pos]),
        )


def _num_token_ids(processor: Any) -> int:
    """How many token ids a prompt may use: the model's vocabulary, or with a tokenizer whichever
    of the two is larger (vLLM's own bound: a tokenizer may have ids the embedding lacks, e.g.
    multimodal placeholders, and the other way round)."""
    vocab = int(processor.model_config.get_vocab_size())
    tokenizer = processor.tokenizer
    max_id = getattr(tokenizer, "max_token_id", None) if tokenizer is not None else None
    return max(vocab, int(max_id) + 1) if isinstance(max_id, int) else vocab


def _engine_options(processor: Any) -> VllmOptions | None:
    """The auxout options in the processor's config (cached on it), None if unreadable."""
    if not hasattr(processor, "_auxout_options"):
        try:
            processor._auxout_options = options_from_vllm_config(processor.vllm_config)
        except (AttributeError, ValueError):
            processor._auxout_options = None
    opts = processor._auxout_options
    return opts if isinstance(opts, VllmOptions) else None


def install_request_validation(*, flag_as_int: bool = False) -> None:
    """Wrap vLLM's ``InputProcessor`` checks with auxout's (idempotent; ``flag_as_int`` for the HTTP server).

    Runs in the process that builds requests (the ``LLM`` caller's process, or the API server's),
    before anything reaches the engine core.
    """
    global _INSTALLED, _FLAG_AS_INT
    _FLAG_AS_INT = flag_as_int
    if _INSTALLED:
        return
    from vllm.v1.engine.input_processor import InputProcessor

    validate_params = InputProcessor._validate_params
    validate_model_input = InputProcessor._validate_model_input

    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if hasattr(params, "extra_args"):  # SamplingParams (pooling requests carry no routes)
            opts = _engine_options(self)
            check_request_flag(
                params,
                store=None if opts is None else opts.store,
                weights=None if opts is None else opts.routing_weights,
            )
            extra = params.extra_args
            if opts is not None and not opts.default_return and asks_for_routes(params):
                # an engine off by default: a route field is the request's ask, as over HTTP
                extra = params.extra_args = {**(extra or {}), REQUEST_FLAG: True}
            if extra and normalize_flag(extra.get(WEIGHTS_FLAG)) is True:
                extra[WEIGHTS_SPLIT] = True  # this process splits the (id, weight) rows: completion_fields
        return validate_params(self, params, *args, **kwargs)

    def _validate_model_input(self: Any, prompt_input: Any, *args: Any, **kwargs: Any) -> Any:
        # before vLLM's own check, which says neither the field nor the position
        ids = prompt_input.get("prompt_token_ids") if prompt_input.get("type") != "embeds" else None
        if ids is not None:
            plain = plain_token_ids(ids)
            if plain is not ids:  # (numpy integers: the engine receives Python ints)
                prompt_input["prompt_token_ids"] = ids = plain
            check_prompt_token_ids(ids, _num_token_ids(self))
        return validate_model_input(self, prompt_input, *args, **kwargs)

    InputProcessor._validate_params = _validate_params  # type: ignore[method-assign]
    InputProcessor._validate_model_input = _validate_model_input  # type: ignore[method-assign]
    _INSTALLED = True
