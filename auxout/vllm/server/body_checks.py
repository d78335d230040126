"""HTTP-side guards of ``auxout serve``: strict JSON types for auxout's fields, and failure reasons for clients.

:class:`RouteFieldsCheck` is an ASGI middleware (vLLM's ``--middleware``) that reads the raw JSON
of ``/v1/completions``, ``/v1/chat/completions`` (also through ``/invocations``) and
``/inference/v1/generate`` bodies before vLLM's pydantic models coerce
it (they turn ``true``, ``"5"`` and ``2.0`` into ints and a ``false`` in ``vllm_xargs`` into
``0``), and answers 400 with the field's name for a value of the wrong type or a field in the
wrong place (vLLM ignores unknown top-level fields, and ``vllm_xargs`` passes anything on, so a
misplaced field would otherwise be silently ignored). A JSON ``null`` for one of auxout's fields
means "not set", as for vLLM's own optional fields: it is dropped before vLLM parses the body.
On a server without a
tokenizer it also answers the chat-style APIs with a 400 that says to use ``/v1/completions``
(vLLM itself fails them with a 500 from an ``assert tokenizer is not None``).

:func:`install_failure_reasons` makes a request that ends with ``finish_reason="error"`` reach
the client as a 500 whose message is the engine's reason (auxout puts it in ``stop_reason``),
instead of vLLM's bare "Internal server error". :func:`install_context_length_message` names
the prompt when it fills the whole context (vLLM says "max_tokens must be at least 1, got 0").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from auxout.vllm.fields import (
    FORMAT_FIELD,
    IN_XARGS,
    INTERNAL_KEY,
    OUTPUT_FLAG,
    PROMPT_START,
    REQUEST_FLAG,
    SESSION_FIELD,
    TOP_LEVEL,
    WEIGHTS_FLAG,
    misspelt_route_field,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_KNOWN = (*TOP_LEVEL, *IN_XARGS)
_CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/invocations")
"""APIs whose bodies carry auxout's fields as documented (``/invocations``: SageMaker's entry,
which hands the body to the completions or chat API)."""
_TOKENS_PATHS = ("/inference/v1/generate",)
"""vLLM's token-in/token-out API (``--enable-scale-out``, ``--tokens-only``): its body is
``{"token_ids", "sampling_params"}`` and its choices carry vLLM's own ``routed_experts``."""
_NO_ROUTE_PATHS = ("/v1/responses", "/v1/messages")
"""Generation APIs whose responses have no place for routes: a route field sent there is a 400."""
_CHAT_PATHS = (  # the APIs that render messages through the chat template
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
)
NO_TOKENIZER = (
    "this server runs without a tokenizer (--skip-tokenizer-init), and chat needs one to render "
    "messages: send token ids to /v1/completions, or start the server with a tokenizer"
)
_INSTALLED = False


def body_problem(body: object) -> tuple[str, str] | None:
    """``(field, message)`` for the first auxout field of a request body with a wrong JSON type or
    in the wrong place, else None (after :func:`drop_null_fields`: a null is not a wrong type)."""
    if not isinstance(body, dict):
        return None  # vLLM answers malformed bodies itself
    start = body.get(PROMPT_START)
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 0):
        return PROMPT_START, f"{PROMPT_START} must be a non-negative JSON integer, got {json.dumps(start)}"
    for name in IN_XARGS:
        if name in body:
            return name, (
                f"{name} is a vllm_xargs entry, not a top-level field of the request body: "
                f'send {{"vllm_xargs": {{"{name}": {json.dumps(body[name])}}}, ...}}'
            )
    offline = body.get("extra_args")  # (the offline name: vLLM keeps unknown body fields and ignores them)
    if isinstance(offline, dict) and any(isinstance(n, str) and misspelt_route_field(n, ()) for n in offline):
        return "extra_args", (
            'extra_args is SamplingParams\' name offline; over HTTP, per-request flags go in "vllm_xargs" '
            f"({', '.join(IN_XARGS)}) and the other route fields at the top level ({', '.join(TOP_LEVEL)})"
        )
    xargs = body.get("vllm_xargs")
    misspelt = _misspelt(body, "") or _misspelt(xargs if isinstance(xargs, dict) else {}, "vllm_xargs.")
    if misspelt is not None:
        return misspelt
    if not isinstance(xargs, dict):
        return _contradiction(body, {}, "", "vllm_xargs.")
    if INTERNAL_KEY in xargs:
        return f"vllm_xargs.{INTERNAL_KEY}", f"vllm_xargs.{INTERNAL_KEY} is auxout's internal field, not a request field"
    for name in TOP_LEVEL:
        if name in xargs:
            return f"vllm_xargs.{name}", (
                f"{name} is a top-level field of the request body, not a vllm_xargs entry: "
                f'send {{"{name}": {json.dumps(xargs[name])}, ...}}'
            )
    return _flag_problem(xargs, "vllm_xargs.") or _contradiction(body, xargs, "", "vllm_xargs.")


def _contradiction(fields: dict[Any, Any], extra: dict[Any, Any], where: str, flag_where: str) -> tuple[str, str] | None:
    """A route field sent (a session, a format, a prompt start, weights true) with the opt-out
    ``return_routed_experts: false``: the request contradicts itself (nothing would say which
    one the client meant), so it is refused naming the field. And a session with a prompt start
    (even 0): both decide where rows start."""
    if fields.get(SESSION_FIELD) is not None and fields.get(PROMPT_START) is not None:
        return where + SESSION_FIELD, (
            f"{where}{SESSION_FIELD} and {where}{PROMPT_START} are exclusive (the session decides where routes "
            "start): send one of the two"
        )
    if extra.get(REQUEST_FLAG) is not False:
        return None
    for name in TOP_LEVEL:
        value = fields.get(name)
        if value is not None and (name != WEIGHTS_FLAG or value is True):
            return where + name, (
                f"{where}{name}={json.dumps(value)} asks for routes that {flag_where}{REQUEST_FLAG}=false turns "
                "off: drop one of the two"
            )
    return None


def _flag_problem(extra: dict[Any, Any], where: str) -> tuple[str, str] | None:
    """A wrong JSON value for auxout's per-request flags in ``extra`` (``vllm_xargs`` or, on the
    token-in/token-out API, ``sampling_params.extra_args``), named with its place ``where``."""
    if REQUEST_FLAG in extra and not isinstance(extra[REQUEST_FLAG], bool):
        field = where + REQUEST_FLAG
        return field, f"{field} must be JSON true or false, got {json.dumps(extra[REQUEST_FLAG])}"
    if OUTPUT_FLAG in extra and extra[OUTPUT_FLAG] not in ("inline", "keys"):
        field = where + OUTPUT_FLAG
        return field, f'{field} must be "inline" or "keys", got {json.dumps(extra[OUTPUT_FLAG])}'
    return None


def _misspelt(fields: dict[Any, Any], where: str) -> tuple[str, str] | None:
    for name in fields:
        hint = misspelt_route_field(name, _KNOWN) if isinstance(name, str) else None
        if hint is not None:
            return where + name, (
                f"unknown routes field {where}{name}: {hint} (top-level: {', '.join(TOP_LEVEL)}; "
                f"in vllm_xargs: {', '.join(IN_XARGS)})"
            )
    return None


def tokens_api_problem(body: object) -> tuple[str, str] | None:
    """``(field, message)`` for auxout's fields in a ``/inference/v1/generate`` body that would be
    ignored or coerced there, else None. That API takes the prompt start and the flags inside
    ``sampling_params`` (``extra_args`` for the flags) and answers with vLLM's own npy rows: the
    wire format, sessions and routing weights are served by the completions and chat APIs."""
    if not isinstance(body, dict):
        return None
    elsewhere = (
        "/inference/v1/generate returns vLLM's own routed_experts rows; routes in another format, "
        "sessions and routing weights are served on /v1/completions and /v1/chat/completions"
    )
    for name in body:
        if not isinstance(name, str):
            continue
        if name in _KNOWN or misspelt_route_field(name, _KNOWN) is not None:
            place = (
                f"set sampling_params.{name}" if name == PROMPT_START
                else f"set sampling_params.extra_args.{name}" if name in IN_XARGS
                else elsewhere
            )  # fmt: skip
            return name, f"{name} is not read at the top level of a /inference/v1/generate body: {place}"
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and any(
        isinstance(n, str) and (n in _KNOWN or n == INTERNAL_KEY or misspelt_route_field(n, _KNOWN)) for n in xargs
    ):
        return "vllm_xargs", (
            "vllm_xargs is not read by /inference/v1/generate: set the flags in sampling_params.extra_args"
        )
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        return None  # vLLM answers it
    start = params.get(PROMPT_START)
    if start is not None and (isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < 2**63):
        field = f"sampling_params.{PROMPT_START}"
        return field, f"{field} must be a non-negative JSON integer, got {json.dumps(start)}"
    for name in params:  # (sampling_params takes only the prompt start; flags go in its extra_args)
        if not isinstance(name, str) or name == PROMPT_START:
            continue
        if name in _KNOWN or misspelt_route_field(name, _KNOWN) is not None:
            field = f"sampling_params.{name}"
            place = f"set sampling_params.extra_args.{name}" if name in IN_XARGS else elsewhere
            return field, f"{field} is not read there: {place}"
    extra = params.get("extra_args")
    if not isinstance(extra, dict):
        return None
    where = "sampling_params.extra_args."
    if INTERNAL_KEY in extra:
        return where + INTERNAL_KEY, f"{where}{INTERNAL_KEY} is auxout's internal field, not a request field"
    for name in extra:
        if name in (FORMAT_FIELD, SESSION_FIELD, WEIGHTS_FLAG):
            return where + name, f"{where}{name}: {elsewhere}"
    misspelt = _misspelt(extra, where)
    if misspelt is not None:
        return misspelt
    return _flag_problem(extra, where) or _contradiction(params, extra, "sampling_params.", where)


def no_routes_problem(path: str, body: object) -> tuple[str, str] | None:
    """``(field, message)`` when a body sent to an API without routes asks for them, else None.

    An opt-out (``"vllm_xargs": {"return_routed_experts": false}``) is not asking."""
    if not isinstance(body, dict):
        return None
    xargs = body.get("vllm_xargs")
    xargs = xargs if isinstance(xargs, dict) else {}
    asked = [name for name in TOP_LEVEL if body.get(name) is not None]
    asked += [f"vllm_xargs.{name}" for name in (OUTPUT_FLAG, WEIGHTS_FLAG) if xargs.get(name) is not None]
    if xargs.get(REQUEST_FLAG) is True:
        asked.append(f"vllm_xargs.{REQUEST_FLAG}")
    if not asked:
        return None
    return asked[0], (
        f"{path} returns no routes, so {asked[0]} would be ignored: ask for routes on /v1/chat/completions "
        f"(or /v1/completions, /v1/chat/completions/batch), which carry them in each choice"
    )


def drop_null_fields(body: object) -> bool:
    """Remove auxout's fields whose value is JSON ``null`` (unset), top-level and in ``vllm_xargs``;
    True if any was removed."""
    if not isinstance(body, dict):
        return False
    dropped = False
    for name in _KNOWN:
        if name in body and body[name] is None:
            del body[name]
            dropped = True
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        for name in _KNOWN:
            if name in xargs and xargs[name] is None:
                del xargs[name]
                dropped = True
    return dropped


_ERROR_TYPES = {400: "BadRequestError", 409: "ConflictError", 503: "ServiceUnavailableError"}


def error_body(message: str, param: str | None, code: int = 400) -> bytes:
    """vLLM's (OpenAI's) error JSON."""
    kind = _ERROR_TYPES.get(code, "InternalServerError")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


class RouteFieldsCheck:
    """ASGI middleware: 400 for auxout request fields of the wrong JSON type (see :func:`body_problem`)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        path = scope.get("path")
        if path in _CHAT_PATHS and _skips_tokenizer(scope):  # vLLM answers 500 (AssertionError)
            await _respond(send, 400, error_body(NO_TOKENIZER, "messages"))
            return
        if path not in _CHECKED_PATHS and path not in _NO_ROUTE_PATHS and path not in _TOKENS_PATHS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # client went away: let the app see it
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        try:
            parsed = json.loads(b"".join(chunks))
        except (ValueError, RecursionError):
            parsed = None  # not JSON: vLLM answers it
        if drop_null_fields(parsed):  # (vLLM parses the body without them)
            data = json.dumps(parsed).encode()
            messages = [{"type": "http.request", "body": data, "more_body": False}]
            scope["headers"] = [
                (k, str(len(data)).encode() if k.lower() == b"content-length" else v) for k, v in scope["headers"]
            ]
        problem = (
            no_routes_problem(path, parsed) if path in _NO_ROUTE_PATHS
            else tokens_api_problem(parsed) if path in _TOKENS_PATHS
            else body_problem(parsed)
        )  # fmt: skip
        if problem is None:
            problem = session_header_problem(parsed, scope)
        if problem is not None:
            field, text = problem
            await _respond(send, 400, error_body(text, field))
            return
        replay = iter(messages)
        echo = session_echo(parsed, scope)
        if echo is not None:
            send = _with_header(send, SESSION_HEADER, echo)

        async def replayed() -> Message:
            try:
                return next(replay)
            except StopIteration:
                return await receive()

        await self.app(scope, replayed, send)


SESSION_HEADER = b"x-session-id"
"""The header routers pin a conversation's requests by (vLLM's router ``--policy consistent_hash``)."""


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def session_header_problem(body: object, scope: Scope) -> tuple[str, str] | None:
    """A request naming its route session in the body and a different one in ``X-Session-Id``: a
    router would pin it by one id while the rows follow the other (400). The header alone names
    no route session: it may be there only for the router, and a session changes which rows come
    back, so only the body field asks for one."""
    header = _header(scope, SESSION_HEADER)
    session = body.get(SESSION_FIELD) if isinstance(body, dict) else None
    if header is None or not isinstance(session, str) or header == session:
        return None
    return SESSION_FIELD, (
        f"{SESSION_FIELD} is {session!r:.80} but the X-Session-Id header is {header!r:.80}: a router pins requests "
        "by the header and the routes follow the field, so send the same id in both (or leave the header out)"
    )


def session_echo(body: object, scope: Scope) -> str | None:
    """The session id a response echoes in ``X-Session-Id``: the request's header, else its route session."""
    header = _header(scope, SESSION_HEADER)
    if header is not None:
        return header
    session = body.get(SESSION_FIELD) if isinstance(body, dict) else None
    return session if isinstance(session, str) and session.isprintable() else None


def _with_header(send: Send, name: bytes, value: str) -> Send:
    """``send`` adding one response header (streamed responses too: their start message carries it)."""
    try:
        encoded = value.encode("latin-1")
    except UnicodeEncodeError:  # (an id HTTP headers cannot carry: not echoed)
        return send

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, encoded)]}
        await send(message)

    return sending


def _skips_tokenizer(scope: Scope) -> bool:
    """Whether the vLLM app serving this request was started with ``--skip-tokenizer-init``."""
    app = scope.get("app")
    args = getattr(getattr(app, "state", None), "args", None)
    return bool(getattr(args, "skip_tokenizer_init", False))


async def _respond(send: Send, status: int, payload: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def failure_reason(output: Any) -> str:
    """The message a client gets for an output with ``finish_reason="error"``."""
    reason = getattr(output, "stop_reason", None)
    if isinstance(reason, str) and reason:
        return f"request failed in the engine: {reason}. The server is still up; retry the request."
    return "request failed in the engine (no reason given; see the server log). The server is still up."


def install_failure_reasons() -> None:
    """Make vLLM's OpenAI servers put the engine's failure reason into the error response (idempotent).

    vLLM raises ``GenerationError("Internal server error")`` from ``_raise_if_error(finish_reason,
    request_id)``, which is not given the output; its caller's ``output`` local is (all four call
    sites in vLLM 0.32 name it so), and carries ``stop_reason``.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.exceptions import GenerationError

    original = GenerateBaseServing._raise_if_error

    def _raise_if_error(self: Any, finish_reason: str | None, request_id: str) -> None:
        if finish_reason != "error":
            return
        output = sys._getframe(1).f_locals.get("output")
        try:
            original(self, finish_reason, request_id)
        except GenerationError as exc:
            raise type(exc)(failure_reason(output)) from None

    GenerateBaseServing._raise_if_error = _raise_if_error  # type: ignore[method-assign]
    _INSTALLED = True


def context_full_message(max_model_len: int, prompt_tokens: int) -> str:
    """What a client gets for a prompt that leaves no room for an output token."""
    return (
        f"This model's maximum context length is {max_model_len} tokens and the prompt has {prompt_tokens}, "
        f"which leaves no room for even one output token: send at most {max_model_len - 1} prompt tokens, "
        f"or start the server with a larger --max-model-len."
    )


def install_context_length_message() -> None:
    """Name the prompt, not ``max_tokens``, when a prompt fills the whole context (idempotent).

    vLLM's length check rejects only prompts *longer* than ``max_model_len``; one of exactly
    ``max_model_len`` tokens gets ``max_tokens = 0`` from ``get_max_tokens`` and then fails
    ``SamplingParams``' check with "max_tokens must be at least 1, got 0", a value the client
    never sent. Each OpenAI serving module imported ``get_max_tokens`` by name, so the wrapper
    replaces that name in every loaded ``vllm.entrypoints`` module (after importing the chat and
    completion servers). A ``max_tokens`` of 0 the client did send keeps vLLM's own message.
    """
    import importlib

    from vllm.entrypoints.serve.utils import api_utils
    from vllm.exceptions import VLLMValidationError

    original = api_utils.get_max_tokens
    if getattr(original, "_auxout", False):
        return

    def get_max_tokens(
        max_model_len: int, max_tokens: int | None, input_length: int, default_sampling_params: dict, *args: Any,
        **kwargs: Any,
    ) -> int:
        n = original(max_model_len, max_tokens, input_length, default_sampling_params, *args, **kwargs)
        asked = max_tokens if max_tokens is not None else default_sampling_params.get("max_tokens")
        if n < 1 and asked != 0:
            limit = kwargs.get("truncate_prompt_tokens")
            length = input_length if limit is None else min(input_length, max_model_len if limit == -1 else limit)
            if length >= max_model_len:
                raise VLLMValidationError(
                    context_full_message(max_model_len, length), parameter="input_tokens", value=length
                )
        return n

    get_max_tokens._auxout = True  # type: ignore[attr-defined]
    for name in ("vllm.entrypoints.openai.completion.serving", "vllm.entrypoints.openai.chat_completion.serving"):
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.entrypoints") and getattr(module, "get_max_tokens", None) is original:
            module.get_max_tokens = get_max_tokens  # type: ignore[attr-defined]


MIDDLEWARE = f"{__name__}.RouteFieldsCheck"
"""The import path ``auxout serve`` passes to vLLM's ``--middleware``."""
