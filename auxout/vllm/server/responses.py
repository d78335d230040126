"""Routes in vLLM's OpenAI server: formats, streaming rows, session deltas, per-request checks.

vLLM's server writes ``choices[i].routed_experts`` (an ``.npy`` in base64) on finished
non-streaming responses only. This module, installed in the API-server process by
``auxout serve``, adds what an agent loop needs on ``/v1/completions`` and
``/v1/chat/completions`` (and ``/v1/chat/completions/batch``, whose choices vLLM leaves without
routes: choice ``i`` gets conversation ``i``'s):

- ``routed_experts_format``: ``"npy"`` | ``"sglang"`` | ``"packed"`` (:mod:`auxout.wire`); every
  choice states ``routed_experts_format``/``_dtype``/``_shape`` (+ ``_bits``) and
  ``routed_experts_start``, the position of its first row;
- streaming: each chunk carries the rows for the positions its tokens newly cover (rows arrive
  per engine step for streamed requests); concatenating the chunks of a choice gives exactly the
  non-streaming array;
- ``routed_experts_session``: only rows the client does not hold yet (:mod:`auxout.vllm.server.sessions`);
- keys-only output: the route manifest of each choice as ``routed_experts_manifest``;
- ``return_routing_weights: true`` (on a server started with ``--auxout-routing-weights true``):
  ``routing_weights`` next to the ids, float32, same shape, start and format (``routing_weights_*``
  fields), streamed and session-delta'd exactly like them.

:func:`install` replaces eleven methods of vLLM's classes with wrappers that call them (none is
copied): ``CompletionRequest``'s and ``ChatCompletionRequest``'s ``to_sampling_params`` (check the
new fields, 400 naming the field) and ``to_beam_search_params`` (beam search returns no routes:
refused when routes are wanted), ``AsyncLLM.generate`` (session start, per-step row access), and
the response builders of ``OpenAIServingCompletion``, ``OpenAIServingChat`` and
``OpenAIServingChatBatch`` (encode rows into the response). docs/architecture.md lists every
replacement auxout makes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import numpy as np

from auxout.metrics import COUNTS
from auxout.profile import has_weights, rows_with_weights, split_rows
from auxout.vllm.caller.completion_fields import completion_field, structured
from auxout.vllm.fields import (
    CHOICE_FACTS,
    FORMAT_FIELD,
    INLINE_REASON_HTTP,
    INTERNAL_KEY,
    MANIFEST_FIELD,
    MANIFEST_HTTP,
    OUTPUT_FLAG,
    PROMPT_START,
    REQUEST_FLAG,
    ROUTES,
    SESSION_FIELD,
    START_FIELD,
    TOP_LEVEL,
    WEIGHTS_FLAG,
    WEIGHTS_OUTPUT,
    WEIGHTS_START_FIELD,
    normalize_flag,
)
from auxout.vllm.options import SHARED_STORES, VllmOptions
from auxout.vllm.server.redis_sessions import SessionStoreError
from auxout.vllm.server.sessions import RouteSessions, SessionBusyError, SessionStore, from_zero
from auxout.vllm.server.weights_version import WeightsVersion
from auxout.wire import DEFAULT_FORMAT, FORMATS, encode

logger = logging.getLogger("vllm.auxout")  # under vLLM's logger: its handlers and format

MAX_SESSION_ID_CHARS = 256
OFFLOAD_SLOTS = 1 << 17
"""Route slots (ids, with their weights) from which a response's routes are encoded on a worker
thread, so the event loop serving every other request goes on meanwhile (numpy and zlib release
the GIL): about 340 rows at the Qwen3-30B-A3B shape; a 320-row turn (~0.5 ms) stays inline."""


def check_route_fields(extra: dict[str, Any], *, n: int, use_beam_search: bool, options: VllmOptions,
                       output_flag: object, num_prompts: int = 1) -> dict[str, Any]:
    """The auxout HTTP fields of one request, checked; raises ``ValueError(field, message)`` on a bad one.

    Checks what needs the parsed request and the server's options. The JSON types, each field's
    place and the fields that contradict each other (a session with a prompt start, a route field
    with the opt-out) are the middleware's (:mod:`auxout.vllm.server.body_checks`), which sees the
    raw body (a prompt start of 0 sent with a session, which parsing makes the default)."""
    fields: dict[str, Any] = {}
    fmt = extra.get(FORMAT_FIELD, DEFAULT_FORMAT)
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise _FieldError(FORMAT_FIELD, f"{FORMAT_FIELD} must be one of {list(FORMATS)}, got {fmt!r}")
    fields["format"] = fmt
    session = extra.get(SESSION_FIELD)
    if session is not None:
        if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_ID_CHARS:
            raise _FieldError(SESSION_FIELD, f"{SESSION_FIELD} must be a non-empty string of at most "
                              f"{MAX_SESSION_ID_CHARS} characters, got {session!r:.80}")
        if n != 1 or use_beam_search or num_prompts != 1:
            raise _FieldError(SESSION_FIELD, f"{SESSION_FIELD} needs one prompt, n=1 and no beam search "
                              "(one history per session)")
        if (output_flag if output_flag is not None else options.output) == "keys":
            raise _FieldError(SESSION_FIELD, f"{SESSION_FIELD} sends the rows a client lacks, inline, and keys-only "
                              "output sends a manifest of the whole history instead: ask for inline rows "
                              f'("vllm_xargs": {{"{OUTPUT_FLAG}": "inline"}}) or leave {SESSION_FIELD} out')
        fields["session"] = session
    weights = extra.get(WEIGHTS_FLAG, False)
    if not isinstance(weights, bool):
        raise _FieldError(WEIGHTS_FLAG, f"{WEIGHTS_FLAG} must be a boolean, got {weights!r}")
    if weights and not options.routing_weights:
        raise _FieldError(WEIGHTS_FLAG, f"{WEIGHTS_FLAG}=true needs a server that captures routing weights: "
                          "start it with --auxout-routing-weights true")
    if weights:
        fields["weights"] = True
    if output_flag == "keys" and options.store not in SHARED_STORES:
        raise _FieldError(OUTPUT_FLAG, f"{OUTPUT_FLAG}='keys' needs a server started with a shared store "
                          f"(--auxout-store {' or '.join(SHARED_STORES)}); this one uses {options.store!r}")
    return fields


class _FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ChoiceRows:
    """Rows of one streamed choice: arrive per engine step, leave as the choice's tokens cover them."""

    def __init__(self, start: int, ids_start: int | None = None) -> None:
        self.start = start
        self.ids_start = ids_start  # (a session turn whose ids start after its weights: RouteResponder.route_fields)
        self.delivered = 0
        self.tokens = 0  # prompt + output tokens the engine has produced for this choice so far
        self.pending: np.ndarray | None = None
        self.chunks: list[np.ndarray] | None = None  # vLLM's per-step list for this request (appended to)
        self.consumed = 0
        self.final: np.ndarray | None = None
        self.manifest: Any = None
        self.facts: dict[str, Any] = {}  # CHOICE_FACTS of the finished choice (its last chunk carries them)
        self.weighted = False  # chunks carry (id, weight) rows

    def observe(self, output: Any, prompt_len: int | None) -> None:
        if prompt_len is not None and self.tokens == 0:
            self.tokens = prompt_len
        self.tokens += len(output.token_ids)
        chunks = getattr(output, "auxout_chunks", None)
        if chunks is not None:
            self.chunks = chunks
        if output.routed_experts is not None:  # finished: the whole array, from ``start``
            weights = getattr(output, WEIGHTS_OUTPUT, None)
            if weights is not None:
                self.final = rows_with_weights(output.routed_experts, weights)
            elif not self.weighted:  # (vLLM's output merging keeps the ids only: the chunks have all)
                self.final = output.routed_experts

    def _pull(self) -> None:
        if self.final is not None:
            self.pending = self.final[self.delivered :]
            return
        if self.chunks is None or len(self.chunks) <= self.consumed:
            return
        new = [structured(c) for c in self.chunks[self.consumed :]]
        self.consumed += len(new)
        self.weighted = self.weighted or any(has_weights(c) for c in new)
        parts = ([self.pending] if self.pending is not None else []) + list(new)
        self.pending = np.concatenate(parts) if len(parts) > 1 else parts[0]

    def take(self, finished: bool) -> tuple[int, np.ndarray] | None:
        """``(first position, rows)`` newly covered, or None when the choice carries no routes."""
        self._pull()
        if self.pending is None:
            return None
        covered = len(self.pending) if finished else max(self.tokens - 1 - self.start - self.delivered, 0)
        rows = self.pending[:covered]
        self.pending = self.pending[covered:]
        first = self.start + self.delivered
        self.delivered += len(rows)
        return first, rows


class RouteResponder:
    """Server-wide state and hooks (one per API-server process)."""

    def __init__(self, options: VllmOptions, *, max_sessions: int = 4096, max_session_tokens: int = 1 << 26,
                 sessions: RouteSessions | None = None) -> None:  # fmt: skip
        self.options = options
        # (in memory by default; auxout.vllm.server.redis_sessions.RedisSessionStore shares sessions across replicas)
        self.sessions: RouteSessions = sessions if sessions is not None else SessionStore(max_sessions, max_session_tokens)
        self.num_experts: int | None = None
        self.weights_version = WeightsVersion()  # (session turns follow it: auxout.vllm.server.weights_version)

    # -- request side -------------------------------------------------------------------------
    def checked_params(self, request: Any, params: Any) -> Any:
        from vllm.exceptions import VLLMValidationError

        extra_fields = dict(getattr(request, "model_extra", None) or {})
        extra_args = params.extra_args or {}
        try:
            fields = check_route_fields(
                extra_fields,
                n=int(getattr(params, "n", 1) or 1),
                use_beam_search=bool(getattr(request, "use_beam_search", False)),
                options=self.options,
                output_flag=extra_args.get(OUTPUT_FLAG),
                num_prompts=_num_prompts(getattr(request, "prompt", None)),
            )
        except _FieldError as exc:
            raise VLLMValidationError(str(exc), parameter=exc.field, value=extra_fields.get(exc.field)) from None
        params.extra_args = {**extra_args, INTERNAL_KEY: fields}
        off = not self.options.default_return
        if off and normalize_flag(extra_args.get(REQUEST_FLAG)) is None and self.wants_routes(request):
            params.extra_args[REQUEST_FLAG] = True  # (the route field is the request's opt-in)
        if fields.get("weights"):  # the engine core sends this request's rows with their weights
            params.extra_args[WEIGHTS_FLAG] = True
        return params

    def wants_routes(self, request: Any) -> bool:
        """Whether a request without an explicit ``return_routed_experts`` gets routes: the server's
        default, or on a server off by default, any route field it sends (a session, a format,
        a prompt start, weights or keys output: that field is its request for routes)."""
        if self.options.default_return:
            return True
        extra_fields = getattr(request, "model_extra", None) or {}
        return (
            any(extra_fields.get(name) is not None for name in TOP_LEVEL)
            or PROMPT_START in (getattr(request, "model_fields_set", None) or ())
            or (getattr(request, "vllm_xargs", None) or {}).get(OUTPUT_FLAG) is not None
        )

    def check_beam_search(self, request: Any) -> None:
        """Beam search runs as many one-token engine requests whose routes no beam gets: a request
        that wants routes is refused (400) rather than answered without them."""
        from vllm.exceptions import VLLMValidationError

        flag = normalize_flag((getattr(request, "vllm_xargs", None) or {}).get(REQUEST_FLAG))
        if flag is False or (flag is None and not self.wants_routes(request)):
            return
        raise VLLMValidationError(
            "use_beam_search: routes are not returned for beam search (vLLM runs it as many one-token requests). "
            f'Sample without beam search, or opt out of routes with "vllm_xargs": {{"{REQUEST_FLAG}": false}}',
            parameter="use_beam_search",
            value=True,
        )

    # -- engine side --------------------------------------------------------------------------
    async def generate(self, engine: Any, original: Callable[..., AsyncIterator[Any]], prompt: Any,
                       sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        fields = (getattr(sampling_params, "extra_args", None) or {}).get(INTERNAL_KEY) or {}
        session = fields.get("session")
        prompt_ids = _prompt_token_ids(prompt)
        arrays = (WEIGHTS_OUTPUT,) if fields.get("weights") else ()
        ids_start = None  # (a session turn: the ids' own start, when the weights start earlier)
        turn = None  # (the session claim this request holds: request_id, until recorded or released)
        version = None  # (a session turn: the weights version it runs, held until it ends)
        if session is not None and prompt_ids is not None:
            version = await self.weights_version.enter_turn(engine)
            try:
                starts, turn = await self._begin_turn(session, prompt_ids, arrays, request_id, version)
            except BaseException:
                self.weights_version.leave_turn()
                raise
            ids_start = starts[ROUTES]
            # the engine returns rows from the earliest start any array needs; the ids skip the rest
            sampling_params.routed_experts_prompt_start = min(starts.values())
        start = int(getattr(sampling_params, PROMPT_START, 0) or 0)
        outputs = self._generate_turn(engine, original, prompt, sampling_params, request_id, args, kwargs,
                                      session, turn, prompt_ids, arrays, start, ids_start, version or "")  # fmt: skip
        try:
            async for out in outputs:
                if turn is not None and getattr(out, "auxout_turn_recorded", False):
                    turn = None
                yield out
        finally:
            try:
                await outputs.aclose()  # (a client gone: vLLM's generator aborts the request on close)
                if turn is not None:  # (failed, aborted or disconnected: the session stays where it was)
                    await self._session_call("release", self.sessions.release, session, turn)
            finally:
                if version is not None:
                    self.weights_version.leave_turn()

    async def _begin_turn(self, session: str, prompt_ids: list[int], arrays: tuple[str, ...],
                          turn: str, version: str) -> tuple[dict[str, int], str | None]:  # fmt: skip
        """Claim ``session`` for this turn: its starts per array, and the claim (None when the
        session store cannot be reached: the turn then starts at 0, the whole history, and is
        not recorded). Another turn of the session in flight: HTTP 409. ``version``: the weights
        version the turn runs (a session recorded with another starts at 0)."""
        from http import HTTPStatus

        from vllm.exceptions import GracefulHTTPError

        try:
            if getattr(self.sessions, "remote", False):
                starts = await asyncio.to_thread(self.sessions.begin, session, prompt_ids, arrays, turn=turn,
                                                 weights_version=version)  # fmt: skip
            else:
                starts = self.sessions.begin(session, prompt_ids, arrays, turn=turn, weights_version=version)
        except SessionBusyError as exc:
            COUNTS.add("session_conflicts")
            raise GracefulHTTPError(str(exc), HTTPStatus.CONFLICT) from None
        except SessionStoreError as exc:
            logger.warning("auxout: %s; this turn of routed_experts_session %r sends the whole history", exc, session)
            return from_zero(arrays), None
        return starts, turn

    async def _session_call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """A session store call after the turn ran; a store that cannot be reached is logged (the
        session then stays where it was: the next turn starts earlier, never past the client's rows)."""
        try:
            if getattr(self.sessions, "remote", False):
                await asyncio.to_thread(fn, *args, **kwargs)
            else:
                fn(*args, **kwargs)
        except SessionStoreError as exc:
            logger.warning("auxout: %s (session turn not %s)", exc, "recorded" if what == "record" else "released")
            return False
        return True

    async def _generate_turn(self, engine: Any, original: Callable[..., AsyncIterator[Any]], prompt: Any,
                             sampling_params: Any, request_id: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                             session: str | None, turn: str | None, prompt_ids: list[int] | None,
                             arrays: tuple[str, ...], start: int, ids_start: int | None,
                             version: str) -> AsyncGenerator[Any, None]:  # fmt: skip
        output_ids: list[int] = []
        delivered = False
        async for out in original(engine, prompt, sampling_params, request_id, *args, **kwargs):
            out.auxout_route_start = start
            out.auxout_ids_start = ids_start
            states = _request_states(engine, request_id)
            for o in out.outputs:
                state = states.get(o.index)
                if state is not None:
                    o.auxout_chunks = state.routed_experts_chunks
            if session is not None and out.outputs:
                o = out.outputs[0]
                if _is_delta(sampling_params):
                    output_ids.extend(o.token_ids)
                else:
                    output_ids = list(o.token_ids)
                delivered = delivered or o.routed_experts is not None
                ok = delivered and o.finish_reason not in (None, "error", "abort")
                if out.finished and ok and prompt_ids is not None:
                    turn_start = start if ids_start is None else ids_start
                    if turn is not None:
                        await self._session_call("record", self.sessions.delivered, session,
                                                 [*prompt_ids, *output_ids], start=turn_start, arrays=arrays,
                                                 turn=turn, weights_version=version)  # fmt: skip
                        out.auxout_turn_recorded = True  # (recorded or not, the claim is over)
                    COUNTS.add("session_turns")
                    COUNTS.add("session_rows_saved", turn_start)
            yield out

    # -- response side ------------------------------------------------------------------------
    def route_fields(
        self, rows: np.ndarray | None, start: int, fmt: str, manifest: Any = None, ids_start: int | None = None
    ) -> dict[str, Any]:
        """The route fields of ``rows`` (positions from ``start``). ``ids_start``: a session turn
        whose client holds ids beyond its weights: the ids from there, the weights from ``start``."""
        fields: dict[str, Any] = {}
        if rows is not None:
            ids, weights = split_rows(rows)
            first = start if ids_start is None or ids_start <= start else ids_start
            sent = ids[first - start :]
            fields = encode(sent, fmt, num_experts=self.num_experts)
            fields[START_FIELD] = first
            nbytes = len(fields[ROUTES])
            if weights is not None:
                fields.update(encode(weights, fmt, name=WEIGHTS_OUTPUT))
                fields[WEIGHTS_START_FIELD] = start
                nbytes += len(fields[WEIGHTS_OUTPUT])
            COUNTS.add("route_rows", len(sent), fmt)
            COUNTS.add("route_bytes", nbytes, fmt)
        if manifest is not None:
            fields[MANIFEST_HTTP] = manifest
            fields.setdefault(START_FIELD, start)  # (every choice states where its routes start)
        return fields

    async def route_fields_async(
        self, rows: np.ndarray | None, start: int, fmt: str, manifest: Any = None, ids_start: int | None = None
    ) -> dict[str, Any]:
        """:meth:`route_fields`, on a worker thread from :data:`OFFLOAD_SLOTS` slots on."""
        if rows is not None and rows.size >= OFFLOAD_SLOTS:
            return await asyncio.to_thread(self.route_fields, rows, start, fmt, manifest, ids_start)
        return self.route_fields(rows, start, fmt, manifest, ids_start)

    async def decorate_choices_async(self, response: Any, request: Any, found: dict[int, tuple[Any, Any]]) -> Any:
        """:meth:`decorate_choices`, on a worker thread when the choices hold :data:`OFFLOAD_SLOTS` slots."""
        slots = sum(getattr(o.routed_experts, "size", 0) for _, o in found.values())
        if slots >= OFFLOAD_SLOTS:
            return await asyncio.to_thread(self.decorate_choices, response, request, found)
        return self.decorate_choices(response, request, found)

    def decorate_choices(self, response: Any, request: Any, found: dict[int, tuple[Any, Any]]) -> Any:
        """Replace vLLM's ``routed_experts`` of each non-streamed choice with the requested encoding.

        ``found``: choice index -> (the engine's ``RequestOutput``, its ``CompletionOutput``)."""
        fmt = _fmt(request)
        for choice in getattr(response, "choices", None) or []:
            hit = found.get(choice.index)
            if hit is None:
                continue
            res, output = hit
            manifest = completion_field(output, res, MANIFEST_FIELD)
            rows, weights = output.routed_experts, getattr(output, WEIGHTS_OUTPUT, None)
            if rows is not None and weights is not None:
                rows = rows_with_weights(rows, weights)
            start, ids_start = getattr(res, "auxout_route_start", 0), getattr(res, "auxout_ids_start", None)
            fields = self.route_fields(rows, start, fmt, manifest, ids_start)
            fields.update(choice_facts(output, res))
            count_completion(rows is not None, manifest is not None, fields)
            for key, value in fields.items():
                setattr(choice, key, value)
        return response

    def check_batch(self, request: Any) -> None:
        """A route session follows one conversation: a batch of several cannot share one (400)."""
        from vllm.exceptions import VLLMValidationError

        session = (getattr(request, "model_extra", None) or {}).get(SESSION_FIELD)
        n = len(getattr(request, "messages", None) or ())
        if session is not None and n > 1:
            raise VLLMValidationError(
                f"{SESSION_FIELD} follows one conversation, and this batch has {n}: send each conversation "
                f"with its own session (one request each), or leave {SESSION_FIELD} out",
                parameter=SESSION_FIELD,
                value=session,
            )

    async def decorate_stream(self, lines: AsyncIterator[str], trackers: dict[int, ChoiceRows], request: Any,
                              serving: Any = None) -> AsyncIterator[str]:
        """vLLM's stream lines, each choice's chunk with the rows its tokens newly cover.

        A failure here ends the stream the way vLLM ends one that fails: an error event naming
        the cause, then ``[DONE]`` (not a connection cut mid-body), and the request is aborted."""
        try:
            async for line in self._decorate_lines(lines, trackers, _fmt(request)):
                yield line
        except Exception as exc:  # (vLLM's own failures are events already: only ours get here)
            logger.exception("auxout: the routes of a streamed response could not be encoded")
            message = f"auxout could not encode this response's routes ({type(exc).__name__}: {exc}); the request was aborted"
            yield f"data: {_error_event(serving, message)}\n\n"
            yield "data: [DONE]\n\n"
            aclose = getattr(lines, "aclose", None)
            if aclose is not None:
                await aclose()  # (closing vLLM's generator aborts the request in the engine)

    async def _decorate_lines(self, lines: AsyncIterator[str], trackers: dict[int, ChoiceRows],
                              fmt: str) -> AsyncIterator[str]:
        async for line in lines:
            if not line.startswith("data: {") or not trackers:
                yield line
                continue
            data = json.loads(line[6:])
            changed = False
            for choice in data.get("choices") or []:
                tracker = trackers.get(choice.get("index"))
                if tracker is None:
                    continue
                finished = choice.get("finish_reason") is not None
                taken = tracker.take(finished)
                manifest = tracker.manifest if finished else None
                if taken is not None or manifest is not None:
                    first, rows = taken if taken is not None else (tracker.start, None)
                    choice.update(await self.route_fields_async(rows, first, fmt, manifest, tracker.ids_start))
                    changed = True
                if finished and tracker.facts:
                    choice.update(tracker.facts)
                    changed = True
                if finished:
                    count_completion(taken is not None or tracker.delivered > 0, manifest is not None, tracker.facts)
            yield f"data: {json.dumps(data, separators=(',', ':'))}\n\n" if changed else line


def _error_event(serving: Any, message: str) -> str:
    """A stream's error event as vLLM writes its own (``{"error": {...}}``), status 500."""
    from http import HTTPStatus

    make = getattr(serving, "create_streaming_error_response", None)
    if make is not None:
        return str(make(message, err_type="InternalServerError", status_code=HTTPStatus.INTERNAL_SERVER_ERROR))
    return json.dumps({"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}})


def _num_prompts(prompt: Any) -> int:
    """Prompts in a completions request's ``prompt`` (a text, a token list, or a list of either)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def _fmt(request: Any) -> str:
    return str((getattr(request, "model_extra", None) or {}).get(FORMAT_FIELD, DEFAULT_FORMAT))


def _is_delta(params: Any) -> bool:
    from vllm.sampling_params import RequestOutputKind

    return bool(params.output_kind == RequestOutputKind.DELTA)


def _prompt_token_ids(prompt: Any) -> list[int] | None:
    if isinstance(prompt, dict):
        target = prompt.get("decoder_prompt", prompt) if "decoder_prompt" in prompt else prompt
        ids = target.get("prompt_token_ids") if isinstance(target, dict) else None
        return list(ids) if ids is not None else None
    return None


def _request_states(engine: Any, request_id: str) -> dict[int, Any]:
    """vLLM's output-processor states of a request's choices, by choice index (the per-step row lists)."""
    processor = getattr(engine, "output_processor", None)
    if processor is None:
        return {}
    internal = processor.external_req_ids.get(request_id, ())
    states = {}
    for iid in internal:
        state = processor.request_states.get(iid)
        if state is not None:
            states[state.request_index] = state
    return states


async def _tap(results: AsyncIterator[Any], trackers: dict[int, ChoiceRows], num_choices: int,
               prompt_lens: dict[int, int], indexed: bool) -> AsyncIterator[Any]:
    """Pass the engine's results through, updating each choice's row tracker on the way."""
    async for item in results:
        prompt_idx, res = item if indexed else (0, item)
        if res.prompt_token_ids is not None:
            prompt_lens.setdefault(prompt_idx, len(res.prompt_token_ids))
        start = getattr(res, "auxout_route_start", 0)
        for output in res.outputs:
            i = output.index + prompt_idx * num_choices
            tracker = trackers.get(i)
            if tracker is None:
                tracker = trackers[i] = ChoiceRows(start, getattr(res, "auxout_ids_start", None))
                tracker.tokens = prompt_lens.get(prompt_idx, 0)
            tracker.observe(output, None)
            if output.finish_reason is not None:
                tracker.manifest = completion_field(output, res, MANIFEST_FIELD)
                tracker.facts = choice_facts(output, res)
        yield item


def count_completion(rows: bool, manifest: bool, facts: dict[str, Any]) -> None:
    """Count a finished choice that returned routes (``auxout.metrics``)."""
    if manifest:
        COUNTS.add("routed_completions", 1, "keys")
    elif rows:
        COUNTS.add("routed_completions", 1, "inline")
    if facts.get(INLINE_REASON_HTTP) is not None:
        COUNTS.add("inline_fallbacks")


def choice_facts(output: Any, res: Any) -> dict[str, Any]:
    """The ``CHOICE_FACTS`` one finished completion has, under their HTTP names."""
    facts = {}
    for key, out in CHOICE_FACTS:
        value = completion_field(output, res, key)
        if value is not None:
            facts[out] = value
    return facts


_INSTALLED: RouteResponder | None = None


def install(options: VllmOptions, *, max_sessions: int = 4096, max_session_tokens: int = 1 << 26,
            sessions: RouteSessions | None = None) -> RouteResponder:  # fmt: skip
    """Wrap vLLM's server methods (API-server process only; idempotent: the latest options win).
    ``sessions``: the route session store (default: in memory, bounded by the two limits)."""
    global _INSTALLED
    if _INSTALLED is not None:
        _INSTALLED.options = options
        if sessions is not None:
            _INSTALLED.sessions = sessions
        return _INSTALLED
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.v1.engine.async_llm import AsyncLLM

    responder = RouteResponder(options, max_sessions=max_sessions, max_session_tokens=max_session_tokens,
                               sessions=sessions)  # fmt: skip

    for cls in (CompletionRequest, ChatCompletionRequest):
        original_params = cls.to_sampling_params

        @functools.wraps(original_params)
        def to_sampling_params(self: Any, *args: Any, __orig: Any = original_params, **kwargs: Any) -> Any:
            return responder.checked_params(self, __orig(self, *args, **kwargs))

        cls.to_sampling_params = to_sampling_params  # type: ignore[method-assign]
        original_beam = cls.to_beam_search_params

        @functools.wraps(original_beam)
        def to_beam_search_params(self: Any, *args: Any, __orig: Any = original_beam, **kwargs: Any) -> Any:
            responder.check_beam_search(self)
            return __orig(self, *args, **kwargs)

        cls.to_beam_search_params = to_beam_search_params  # type: ignore[method-assign]

    original_generate = AsyncLLM.generate

    @functools.wraps(original_generate)
    def generate(self: Any, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        return responder.generate(self, original_generate, prompt, sampling_params, request_id, *args, **kwargs)

    AsyncLLM.generate = generate  # type: ignore[method-assign]

    def _experts(serving: Any) -> None:
        if responder.num_experts is None:
            responder.num_experts = int(serving.model_config.get_num_experts())

    original_cmpl = OpenAIServingCompletion.request_output_to_completion_response

    @functools.wraps(original_cmpl)
    def cmpl_response(self: Any, final_res_batch: list[Any], request: Any, *args: Any, **kwargs: Any) -> Any:
        _experts(self)
        response = original_cmpl(self, final_res_batch, request, *args, **kwargs)
        n = request.n or 1
        found = {o.index + p * n: (res, o) for p, res in enumerate(final_res_batch) for o in res.outputs}
        return responder.decorate_choices(response, request, found)

    OpenAIServingCompletion.request_output_to_completion_response = cmpl_response  # type: ignore[method-assign]

    original_cmpl_stream = OpenAIServingCompletion.completion_stream_generator

    @functools.wraps(original_cmpl_stream)
    def cmpl_stream(self: Any, request: Any, engine_inputs: Any, result_generator: Any, *args: Any, **kwargs: Any) -> Any:
        _experts(self)
        trackers: dict[int, ChoiceRows] = {}
        tapped = _tap(result_generator, trackers, request.n or 1, {}, indexed=True)
        lines = original_cmpl_stream(self, request, engine_inputs, tapped, *args, **kwargs)
        return responder.decorate_stream(lines, trackers, request, self)

    OpenAIServingCompletion.completion_stream_generator = cmpl_stream  # type: ignore[method-assign]

    original_chat_full = OpenAIServingChat.chat_completion_full_generator

    @functools.wraps(original_chat_full)
    async def chat_full(self: Any, request: Any, result_generator: Any, *args: Any, **kwargs: Any) -> Any:
        _experts(self)
        last: list[Any] = []

        async def keep_last(results: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for res in results:
                last[:] = [res]
                yield res

        response = await original_chat_full(self, request, keep_last(result_generator), *args, **kwargs)
        if last and hasattr(response, "choices"):
            found = {o.index: (last[0], o) for o in last[0].outputs}
            await responder.decorate_choices_async(response, request, found)
        return response

    OpenAIServingChat.chat_completion_full_generator = chat_full  # type: ignore[method-assign]

    original_chat_stream = OpenAIServingChat.chat_completion_stream_generator

    @functools.wraps(original_chat_stream)
    def chat_stream(self: Any, request: Any, result_generator: Any, *args: Any, **kwargs: Any) -> Any:
        _experts(self)
        trackers: dict[int, ChoiceRows] = {}
        tapped = _tap(result_generator, trackers, request.n or 1, {}, indexed=False)
        lines = original_chat_stream(self, request, tapped, *args, **kwargs)
        return responder.decorate_stream(lines, trackers, request, self)

    OpenAIServingChat.chat_completion_stream_generator = chat_stream  # type: ignore[method-assign]
    _install_batch_chat(responder, _experts)
    _INSTALLED = responder
    return responder


def _install_batch_chat(responder: RouteResponder, experts: Callable[[Any], None]) -> None:
    """``/v1/chat/completions/batch``: each conversation's choice gets its routes, as in chat.

    vLLM builds that response itself (choice ``i`` is conversation ``i``; ``n`` must be 1) and
    leaves ``routed_experts`` null, so without this a batch answered without routes, silently. It
    also reports no prompt token ids, so with ``return_token_ids`` each choice gets its
    conversation's (the templated prompt its routes start on).
    """
    try:
        from vllm.entrypoints.openai.chat_completion.batch_serving import OpenAIServingChatBatch
    except ImportError:  # a vLLM without the batch endpoint
        return
    original_create = OpenAIServingChatBatch.create_batch_chat_completion

    @functools.wraps(original_create)
    async def create(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        responder.check_batch(request)
        return await original_create(self, request, *args, **kwargs)

    OpenAIServingChatBatch.create_batch_chat_completion = create  # type: ignore[method-assign]
    original_full = OpenAIServingChatBatch.chat_completion_full_generator_batch

    @functools.wraps(original_full)
    async def full(self: Any, request: Any, generators: list[Any], *args: Any, **kwargs: Any) -> Any:
        experts(self)
        last: dict[int, Any] = {}

        async def keep_last(i: int, results: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for res in results:
                last[i] = res
                yield res

        tapped: list[Any] = [keep_last(i, g) for i, g in enumerate(generators)]
        response = await original_full(self, request, tapped, *args, **kwargs)
        if hasattr(response, "choices"):
            found = {i: (res, res.outputs[0]) for i, res in last.items() if res.outputs}
            await responder.decorate_choices_async(response, request, found)
            if getattr(request, "return_token_ids", False):  # (vLLM's batch response has no prompt ids at all)
                for choice in response.choices:
                    res = last.get(choice.index)
                    if res is not None and getattr(choice, "prompt_token_ids", None) is None:
                        choice.prompt_token_ids = list(res.prompt_token_ids or [])  # type: ignore[union-attr]  # (extra field)
        return response

    OpenAIServingChatBatch.chat_completion_full_generator_batch = full  # type: ignore[method-assign]
