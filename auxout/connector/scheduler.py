"""Scheduler side (control plane): what the worker must know each step, and no payloads.

Each step it sends the emit start of every scheduled request, only the block hashes the worker
has not seen (also for tracked requests that were not scheduled), and each terminal event
(finish, abort, preemption) exactly once. It clips the worker's rows to the range the scheduler
accepted, ``[token_start, num_tokens - 1)``: the last sampled token is never fed through the
model, so it has no route. ``reset()`` bumps the generation after a prefix-cache reset so
routes computed with old weights can never be served.

A KV hit never fails for missing routes: engines clip each prefix hit with
``readable_prefix`` (a ``RouteIndex`` mirrors what the worker reports as published and lost), and
a request whose prefix rows still could not be read is named by ``begin_output``; the engine
drops that step's samples for it and restarts it (preemption semantics), and the clipped hit
recomputes the missing blocks. ``RoutesUnavailableError`` remains a guard for a request that
keeps failing (``MAX_RECOMPUTES``), which normal operation never reaches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import compress
from operator import attrgetter, ne, sub
from typing import Protocol

import numpy as np

from auxout.connector.keys_output import KeysPublisher
from auxout.connector.messages import NO_EMIT, StepMetadata, StepOutput
from auxout.connector.route_index import ContainsFn, RouteIndex
from auxout.errors import (
    BlockStoreError,
    InvariantError,
    ManifestUnavailableError,
    RequestValidationError,
    RoutesUnavailableError,
)
from auxout.keys import KeySpace, PackedHashes
from auxout.manifest import RouteManifest
from auxout.metrics import COUNTS
from auxout.stores.rows import StoreRows, join_rows

OUTPUT_MODES = ("inline", "keys")
_num_tokens = attrgetter("num_tokens")
_block_hashes = attrgetter("block_hashes")
_plus_one = (1).__add__
REASON_TWO_GENERATIONS = (
    "the weights changed while it ran (a prefix-cache reset): its rows come from two generations, "
    "and a manifest names one generation's keys"
)
MAX_RECOMPUTES = 8
"""Restarts of one request for unreadable prefix routes before it fails (a guard, not a policy)."""


class SchedRequest(Protocol):
    """What the connector reads from an engine request (vLLM's ``Request`` fits as is)."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> Sequence[bytes]: ...


def validate_prompt_start(prompt_start: object, prompt_len: int) -> int:
    """``0 <= prompt_start <= prompt_len`` (equal returns an empty first chunk); else a clear error."""
    field = "routed_experts_prompt_start"
    if isinstance(prompt_start, bool) or not isinstance(prompt_start, int | np.integer):
        raise RequestValidationError(field, prompt_start, f"must be an integer, not {type(prompt_start).__name__}")
    value = int(prompt_start)
    if value < 0:
        raise RequestValidationError(field, value, "must be non-negative")
    if value > prompt_len:
        raise RequestValidationError(field, value, f"must not exceed the prompt length {prompt_len}")
    return value


class SchedulerConnector:
    """Payload-free control plane of one engine."""

    def __init__(
        self,
        *,
        default_return: bool = True,
        publisher: KeysPublisher | None = None,
        default_output: str = "inline",
        keyspace: KeySpace | None = None,
        block_size: int | None = None,
        remote_contains: ContainsFn | None = None,
        index_capacity: int = 1 << 16,
        weights_from_worker: bool = False,
    ) -> None:
        """``keyspace``/``block_size`` must match the worker's; ``remote_contains`` asks a store
        other instances publish to (None for an in-process store). ``weights_from_worker``: the
        worker names each generation after a reset by its weights (``StepOutput.weights``); until
        its first output of that generation says how, prefix hits are taken as they are (the
        worker checks them when it reads)."""
        if default_output not in OUTPUT_MODES:
            raise ValueError(f"default_output must be one of {OUTPUT_MODES}, got {default_output!r}")
        if default_output == "keys" and publisher is None:
            raise ValueError("keys-only output needs a KeysPublisher (a store both sides can reach)")
        self.generation = 0
        self.default_return = default_return
        self.default_output = default_output
        self.publisher = publisher
        self._sent: dict[str, int] = {}  # hashes the worker has, per request it tracks
        self._finished: dict[str, PackedHashes | None] = {}  # terminal events not yet delivered
        self._options: dict[str, tuple[int, bool]] = {}  # prompt_start, return_routes
        self._keys_mode: set[str] = set()
        self._two_generations: set[str] = set()  # keys-mode requests a reset hit after rows were held
        self._delivered: dict[str, int] = {}  # first position whose rows were not returned yet
        # live requests a prefix-cache reset (an RL weight sync) hit after rows were returned:
        # the first position of each reset whose rows come from after it (the bridge reports them)
        self.reset_at: dict[str, list[int]] = {}
        self._recomputes: dict[str, int] = {}
        self._loading: dict[str, int] = {}  # requests waiting for an asynchronous KV load: their local hit
        self.keyspace = keyspace or KeySpace()
        self.block_size = block_size if block_size is not None else (publisher.block_size if publisher else 0)
        self.remote_contains = remote_contains
        self.index = RouteIndex(index_capacity)
        self.weights_from_worker = weights_from_worker
        self._keys_unknown = False  # this generation's keys await the worker's weights digest
        self.recomputed_tokens = 0  # prefix-hit tokens recomputed because their routes were unreadable
        self._recomputed: dict[str, list[tuple[int, int]]] = {}  # per live request: disjoint spans, sorted
        self.recomputed_requests = 0
        self.listed_steps = 0  # steps take_step took by the worker's list of starts (no numpy)
        self.inline_fallbacks: dict[str, str] = {}  # keys-mode requests answered inline, and why (engines pop)
        self._one_row_spans: dict[int, tuple[bytes, bytes]] = {}  # take_step: lo, hi of n one-row spans
        # take_step's last batch: (step ids, requests, position of each request in the step)
        self._step_cache: tuple[list[str], list[SchedRequest], list[int]] | None = None
        # build_metadata's last batch when it was steady: (scheduled ids, their block-hash counts);
        # while it repeats with no new hash, every emit start is the delivered cursor
        self._meta_cache: tuple[list[str], list[int]] | None = None

    def add_request(
        self,
        request_id: str,
        prompt_len: int,
        prompt_start: object = 0,
        return_routes: object = None,
        output: object = None,
    ) -> None:
        """Validate a request's route options at admission; raises ``RequestValidationError``."""
        start = validate_prompt_start(prompt_start, prompt_len)
        self._step_cache = self._meta_cache = None  # (options checked once per batch: a new request may reuse an id)
        if return_routes is None:
            ret = self.default_return
        elif isinstance(return_routes, bool):
            ret = return_routes
        else:
            raise RequestValidationError("return_routed_experts", return_routes, "must be a boolean")
        mode = self.default_output if output is None else output
        if mode not in OUTPUT_MODES:
            raise RequestValidationError("routed_experts_output", output, f"must be one of {list(OUTPUT_MODES)}")
        if mode == "keys" and self.publisher is None:
            raise RequestValidationError("routed_experts_output", output, "this engine has no shared route store")
        if mode == "keys" and ret:
            assert self.publisher is not None
            # hold whole blocks from the one containing prompt_start: a block whose hash arrives
            # with the last token can then be published from held rows, never waited for
            self.publisher.expect(request_id, start)
            self._options[request_id] = (start - start % self.publisher.block_size, ret)
            self._keys_mode.add(request_id)
        else:
            self._options[request_id] = (start, ret)
            self._keys_mode.discard(request_id)

    def returns_routes(self, request_id: str) -> bool:
        return self._options.get(request_id, (0, self.default_return))[1]

    def build_metadata(self, scheduled_ids: Iterable[str], requests: Mapping[str, SchedRequest]) -> StepMetadata:
        """Metadata for one step; call after scheduling, with every live request in ``requests``."""
        ids = list(scheduled_ids)
        cache = self._meta_cache
        if cache is not None and cache[0] == ids and not self._finished and len(self._sent) == len(ids):
            # The same batch as a step that was all decode: each emits from its delivered cursor,
            # and only requests whose hash count moved need a look (C-level maps otherwise).
            counts = list(map(len, map(_block_hashes, map(requests.__getitem__, ids))))
            new: dict[str, PackedHashes] = {}
            if counts != cache[1]:
                sent = self._sent
                for i in compress(range(len(ids)), map(ne, counts, cache[1])):
                    rid, n, nb = ids[i], cache[1][i], counts[i]
                    if nb < n:
                        raise InvariantError(f"KV block-hash history of request {rid!r} shrank from {n} to {nb}")
                    new[rid] = PackedHashes.pack(requests[rid].block_hashes[n:])
                    sent[rid] = nb
                self._meta_cache = (ids, counts)
            return StepMetadata(self.generation, dict(zip(ids, map(self._delivered.__getitem__, ids))), new, (), {})
        sent = self._sent
        options = self._options
        delivered = self._delivered
        default = (0, self.default_return)
        emit: dict[str, int] = {}
        hashes: dict[str, PackedHashes] = {}
        steady = True  # every request returns routes and has had rows delivered past its start
        for rid in ids:
            req = requests[rid]
            bh = req.block_hashes
            nb = len(bh)
            n = sent.get(rid, -1)  # -1: not announced yet
            if nb != n:  # (most decode steps bring no new hash: nothing to write)
                if nb < n:
                    raise InvariantError(f"KV block-hash history of request {rid!r} shrank from {n} to {nb}")
                if n < 0:
                    n = 0
                if nb > n:
                    hashes[rid] = PackedHashes.pack(bh[n:])
                sent[rid] = nb
            start, ret = options.get(rid, default)
            done = delivered.get(rid)
            if not ret:
                emit[rid] = NO_EMIT
                steady = False
            elif done is not None:  # rows go out as captured: resume where the last one went
                if done > start:  # (a conditional, not max(): per request per step)
                    emit[rid] = done
                else:
                    emit[rid] = start
                    steady = False
            else:
                emit[rid] = start if req.num_output_tokens == 0 else max(start, req.num_tokens - 1)
                steady = False
        if len(sent) != len(emit):  # hash-only updates for tracked requests not scheduled this step
            for rid, n in sent.items():
                if rid in emit:
                    continue
                bh = requests[rid].block_hashes
                if len(bh) > n:
                    hashes[rid] = PackedHashes.pack(bh[n:])
                    sent[rid] = len(bh)
        finished = tuple(self._finished)
        final = {rid: pack for rid, pack in self._finished.items() if pack is not None}
        self._finished = {}
        self._meta_cache = (ids, [sent[rid] for rid in ids]) if steady and len(sent) == len(emit) else None
        return StepMetadata(self.generation, emit, hashes, finished, final)

    def request_finished(self, request: SchedRequest, *, preempted: bool = False) -> None:
        """Terminal event on preemption, finish or abort; call before the KV blocks are freed."""
        rid = request.request_id
        self._step_cache = self._meta_cache = None
        self._loading.pop(rid, None)
        if not preempted:
            self._options.pop(rid, None)
            self._delivered.pop(rid, None)
            self._recomputes.pop(rid, None)
            self._recomputed.pop(rid, None)
            self._two_generations.discard(rid)
            if rid in self._keys_mode:
                self._keys_mode.discard(rid)
                assert self.publisher is not None
                self.publisher.discard(rid)
        n = self._sent.pop(rid, None)
        if n is None:
            return  # never announced to the worker, or already terminated
        bh = request.block_hashes
        if len(bh) < n:
            raise InvariantError(f"KV block-hash history of request {rid!r} shrank from {n} to {len(bh)}")
        self._finished[rid] = PackedHashes.pack(bh[n:]) if len(bh) > n else None

    def take_output(
        self, output: StepOutput | None, request: SchedRequest, *, finished: bool = False
    ) -> np.ndarray | RouteManifest | None:
        """This step's accepted rows for a request that emitted tokens (None if opted out).

        In keys-only mode the rows are held here and the request's ``RouteManifest`` is returned
        when it finishes (None before).

        Raises ``RoutesUnavailableError`` for this request alone when its routes could not be
        assembled (e.g. a prefix block was evicted): fail the request, not the engine.
        """
        got = self.take_output_parts(output, request, finished=finished)
        return join_rows(got) if type(got) is list else got  # type: ignore[return-value]

    def take_output_parts(
        self, output: StepOutput | None, request: SchedRequest, finished: bool = False
    ) -> np.ndarray | list[np.ndarray | StoreRows] | RouteManifest | None:
        """``take_output`` without joining: a list of parts where the rows come in two parts.

        A request that read a cached prefix this step gets its prefix rows (``StoreRows`` when
        they are still in an in-process store's arena), then its own rows (a view of the step's
        snapshot). An engine that gathers a request's rows over several steps anyway (vLLM's
        frontend gets them at finish) joins once at the end (``auxout.stores.rows.join_rows``),
        which copies each row once. Anything else is as ``take_output``.
        """
        rid = request.request_id
        opts = self._options.get(rid)
        if not (self.default_return if opts is None else opts[1]):
            return None
        if output is None:
            raise InvariantError(f"worker output is missing for request {rid!r}: no step output")
        if output.errors:
            err = output.errors.get(rid)
            if err is not None:
                raise RoutesUnavailableError(rid, err)
        spans = output._spans  # built once per step; read directly: this runs per request per step
        span = (spans if spans is not None else output.span_map()).get(rid)
        if span is None:
            raise InvariantError(f"worker output is missing request {rid!r}")
        token_start, lo, hi = span
        local_end = request.num_tokens - 1 - token_start
        if local_end < 0 or local_end > hi - lo:
            local_end = self._clip(rid, request, token_start, hi - lo, finished)
            if local_end < 0:
                return None
        rows = output.rows[lo : lo + local_end] if hi <= len(output.rows) else output.span_rows(rid, lo, lo + local_end)
        self._delivered[rid] = token_start + local_end
        if self._keys_mode and rid in self._keys_mode:
            return self._publish_keys(rid, request, token_start, rows, finished)
        return rows

    @staticmethod
    def _clip(rid: str, request: SchedRequest, token_start: int, n_rows: int, finished: bool) -> int:
        """The accepted end of a span that does not cover ``[token_start, num_tokens - 1)``
        exactly: -1 if nothing is accepted yet; rows as captured for a chunk that sampled nothing."""
        end = request.num_tokens - 1
        if end < token_start:
            if finished:
                raise InvariantError(
                    f"finished request {rid!r} has no accepted token range: token_end={end}, "
                    f"output=[{token_start}, {token_start + n_rows})"
                )
            return -1
        if finished:
            raise InvariantError(
                f"worker output has an invalid token range for request {rid!r}: accepted end "
                f"{end}, rows cover [{token_start}, {token_start + n_rows})"
            )
        return n_rows  # rows returned as captured (a prefill chunk that sampled nothing)

    def _publish_keys(
        self,
        rid: str,
        request: SchedRequest,
        token_start: int,
        rows: np.ndarray | list[np.ndarray | StoreRows],
        finished: bool,
    ) -> RouteManifest | np.ndarray | None:
        """Keys-only mode: hold the rows; at finish, the manifest (or the exact rows inline)."""
        assert self.publisher is not None
        for part in rows if isinstance(rows, list) else [rows]:
            self.publisher.add(rid, token_start, np.asarray(part))
            token_start += len(part)
        if not finished:
            return None
        self._keys_mode.discard(rid)
        if rid in self._two_generations:
            self._two_generations.discard(rid)
            self.inline_fallbacks[rid] = REASON_TWO_GENERATIONS
            return self.publisher.take_rows(rid, request.num_tokens - 1)
        try:
            return self.publisher.finish(
                rid, block_hashes=request.block_hashes, generation=self.generation, token_end=request.num_tokens - 1
            )
        except ManifestUnavailableError as exc:  # store full or down: the exact rows go inline
            self.inline_fallbacks[rid] = exc.reason
            return exc.rows  # type: ignore[return-value]
        except BlockStoreError as exc:  # the shared store is down or lost objects: this request fails
            raise RoutesUnavailableError(rid, f"{type(exc).__name__}: {exc}") from exc

    def take_outputs(
        self,
        output: StepOutput | None,
        requests: Sequence[SchedRequest],
        finished: Sequence[bool] | None = None,
    ) -> list[np.ndarray | RouteManifest | RoutesUnavailableError | None]:
        """``take_output`` for every request that emitted tokens this step, in one call.

        A request whose routes are unavailable gets its ``RoutesUnavailableError`` in its place
        (fail that request; the others are unaffected); contract violations still raise. The
        common case (inline rows, no errors) is one tight loop instead of a call per request.
        """
        n = len(requests)
        fin = [False] * n if finished is None else list(finished)
        if output is None or output.errors or output.heads or self._keys_mode or n == 0:
            return [self._take_or_error(output, r, f) for r, f in zip(requests, fin)]
        spans = output.span_map()
        get_span, get_opt = spans.get, self._options.get
        default = self.default_return
        delivered = self._delivered
        rows = output.rows
        res: list[np.ndarray | RouteManifest | RoutesUnavailableError | None] = []
        append = res.append
        for r in requests:
            rid = r.request_id
            opt = get_opt(rid)
            if not (default if opt is None else opt[1]):
                append(None)  # opted out
                continue
            sp = get_span(rid)
            if sp is None:
                return [self._take_or_error(output, q, f) for q, f in zip(requests, fin)]
            t, lo, hi = sp
            e = r.num_tokens - 1 - t
            if e < 0 or e > hi - lo:
                return [self._take_or_error(output, q, f) for q, f in zip(requests, fin)]
            append(rows[lo : lo + e])  # (no heads: every span is in the snapshot)
            delivered[rid] = t + e
        return res

    def take_step(
        self, output: StepOutput | None, requests: Sequence[SchedRequest], num_tokens: Sequence[int] | None = None
    ) -> np.ndarray | None:
        """``take_outputs`` for a plain decode step, vectorized: the step's rows, or None.

        Applies when ``requests`` (any order) are exactly the step's requests, none finished
        or in keys-only mode, all returning routes, and each accepted exactly the one row it
        emitted (``num_tokens - 1 == token_start + 1``). Then row ``i`` of the result belongs to
        ``output.req_ids[i]`` (hold it with ``HeldRows.add_step``) and the delivered cursors
        moved as ``take_outputs`` would move them. None: nothing changed, use ``take_outputs``.
        ``num_tokens[i]`` is ``requests[i].num_tokens``, when the engine read it already (after
        the forward, reading it again from every request costs about 3 us each, cold).
        """
        n = len(requests)
        if output is None or n == 0 or n != len(output.req_ids) or output.errors or output.heads or self._keys_mode:
            return None
        # (every numpy call runs cold after the forward, ~10 us each in the engine: none when the
        # worker's lane says the step is one row each, at rows[i]; the rest in Python)
        ts = output.one_row_starts
        if ts is None:
            spans = self._one_row_spans.get(n)
            if spans is None:
                q = np.arange(n + 1, dtype=np.int64)
                spans = self._one_row_spans[n] = (q[:n].tobytes(), q[1:].tobytes())
            if output.lo.tobytes() != spans[0] or output.hi.tobytes() != spans[1]:
                return None  # (not one row each at rows[i]; int64 both sides)
            ts = output.token_starts.tolist()
        ids = output.req_ids
        cache = self._step_cache
        if cache is not None and cache[1] == requests and cache[0] == ids:  # (identity first: the same objects)
            perm = cache[2]
        else:
            index = {rid: i for i, rid in enumerate(ids)}
            default = (0, self.default_return)
            perm = [index.get(r.request_id, -1) for r in requests]
            if -1 in perm or len(set(perm)) != n or not all(self._options.get(r.request_id, default)[1] for r in requests):
                return None
            self._step_cache = (list(ids), list(requests), perm)
        counts = map(_num_tokens, requests) if num_tokens is None else num_tokens
        if set(map(sub, counts, map(ts.__getitem__, perm))) != {2}:  # (C-level maps: no frame per request)
            return None  # (a request accepted other than its one row: the per-request path clips)
        self._delivered.update(zip(ids, map(_plus_one, ts)))
        self.listed_steps += output.one_row_starts is not None
        rows = output.rows
        return rows if len(rows) == n else rows[:n]

    def _take_or_error(
        self, output: StepOutput | None, request: SchedRequest, finished: bool
    ) -> np.ndarray | RouteManifest | RoutesUnavailableError | None:
        try:
            return self.take_output(output, request, finished=finished)
        except RoutesUnavailableError as exc:
            return exc

    def reset(self) -> None:
        """After a successful prefix-cache reset: new generation, everything re-sent.

        A live request keeps the rows it was returned (each position's route as that token was
        processed); vLLM recomputes its KV, and its rows from its delivered cursor on come from
        the recompute: the cursor is kept (a request reset mid chunked prefill would otherwise
        emit its returned rows again). Where it lies is kept in ``reset_at`` (the weights may differ)."""
        default = (0, self.default_return)
        for rid, done in self._delivered.items():
            start, ret = self._options.get(rid, default)
            if not ret or done <= start:
                continue
            if rid in self._keys_mode:  # (held from its prompt_start's block start)
                assert self.publisher is not None
                if done <= self.publisher.first(rid):  # nothing returned yet: hold the recompute's rows
                    self.publisher.rewind(rid)
                    self._delivered[rid] = start
                    continue
                self._two_generations.add(rid)  # its manifest would name only the new weights' blocks
            self.reset_at.setdefault(rid, []).append(done)
        self.generation += 1
        self._keys_unknown = self.weights_from_worker
        self._meta_cache = None
        self._sent.clear()
        self._finished.clear()
        self.index.clear()

    def forget(self, request_id: str) -> None:
        """Drop a request that was rejected before it was ever scheduled."""
        self._step_cache = self._meta_cache = None
        self._options.pop(request_id, None)
        self._delivered.pop(request_id, None)
        self._recomputed.pop(request_id, None)
        self._loading.pop(request_id, None)

    # -- prefix hits without routes: clip, then recompute ------------------------------------
    def readable_prefix(self, request: SchedRequest, num_hit_tokens: int, num_local_tokens: int | None = None) -> int:
        """The part of a prefix hit whose routes the worker can read (hash-block aligned).

        ``num_hit_tokens`` is what the KV cache (and a KV connector) would skip, the first
        ``num_local_tokens`` of it local (default: all). Only blocks from the one holding the
        request's emit start are needed; an opted-out request needs none. Engines clip their
        hit to the returned length; the tokens cut off are recomputed (and counted).
        """
        bs = self.block_size
        if num_hit_tokens <= 0 or bs <= 0:
            return max(num_hit_tokens, 0)
        rid = request.request_id
        start, ret = self._options.get(rid, (0, self.default_return))
        if not ret:
            return num_hit_tokens
        first = max(start, self._delivered.get(rid, 0)) // bs
        hit_blocks = num_hit_tokens // bs
        if first >= hit_blocks:
            return num_hit_tokens
        local = hit_blocks if num_local_tokens is None else num_local_tokens // bs
        if self._keys_unknown:
            # Right after a reset, before the worker named the generation by its weights: the hit
            # is taken as it is, and the worker, which knows the keys, reads the rows or reports
            # them missing (``begin_output``: that request recomputes). Clipping instead would
            # recompute every hit of the first batch after each RL weight sync.
            return num_hit_tokens
        keys = self.keyspace.keys(request.block_hashes[first:hit_blocks], self.generation)
        ready = first + self.index.readable_blocks(keys, local - first, self.remote_contains)
        if ready >= hit_blocks:
            return num_hit_tokens
        clipped = ready * bs
        self.count_recompute(rid, clipped, num_hit_tokens)
        return clipped

    def external_hit(self, request: SchedRequest, num_local_tokens: int, num_external: int, load_async: bool) -> int:
        """How much of a KV connector's hit to take: all of it (``num_external``) or nothing.

        A connector places the blocks it matched by its own rule (from the front, or lined up
        from the end, as NIXL and Mooncake's P/D connector do), whatever count the engine
        allocates for, so a cut count loads wrong KV. An asynchronous load is taken whole when
        some block past the local hit would be used (otherwise it is skipped): where computation
        resumes once it lands is :meth:`resume_after_load`'s answer. A synchronous
        load counts as computed at once, so it is taken only when it ends on a hash-block
        boundary before the last token with every route block readable; otherwise it is
        refused and recomputed.
        """
        if num_external <= 0:
            return 0
        total = num_local_tokens + num_external
        if load_async:
            if self._resume_point(request, total, num_local_tokens) > num_local_tokens:
                self._loading[request.request_id] = num_local_tokens
                return num_external
            self.count_recompute(request.request_id, num_local_tokens, min(total, request.num_tokens - 1))
            return 0  # (nothing past the local hit would be used: the transfer is skipped)
        if (
            total % max(self.block_size, 1) == 0
            and total < request.num_tokens  # (the last token is computed: it samples the next)
            and self.readable_prefix(request, total, num_local_tokens) == total
        ):
            return num_external
        self.count_recompute(request.request_id, num_local_tokens, total)
        return 0

    def resume_after_load(self, request: SchedRequest, num_loaded_tokens: int) -> int:
        """Where computation resumes once a KV load taken by :meth:`external_hit` has landed.

        The engine would resume at ``num_loaded_tokens`` (one short of the prompt for a whole
        prompt hit), possibly inside a block; the worker captures from hash-block boundaries only,
        and rows of a partial block live in no stored block. So it resumes at the last hash-block
        boundary up to which routes are readable; the KV loaded past it is valid and is written
        again by the recompute. The positions recomputed are counted.
        """
        local = self._loading.pop(request.request_id, 0)
        keep = self._resume_point(request, num_loaded_tokens, local)
        resume = min(num_loaded_tokens, request.num_tokens - 1)
        if keep < resume:
            self.count_recompute(request.request_id, keep, resume)
        return keep

    def _resume_point(self, request: SchedRequest, num_loaded_tokens: int, num_local_tokens: int) -> int:
        resume = min(num_loaded_tokens, request.num_tokens - 1)
        keep = self.readable_prefix(request, resume, min(num_local_tokens, resume)) if resume > 0 else 0
        return keep - keep % max(self.block_size, 1)

    def count_recompute(self, request_id: str, lo: int, hi: int) -> int:
        """Positions ``[lo, hi)`` of a request's prefix hit are recomputed for lack of routes;
        returns how many positions of it were, each counted once (an engine asks again for the
        same hit each time a request waits for KV blocks, and clips local and connector hits
        separately: a sum would exceed the prompt)."""
        spans = self._recomputed.setdefault(request_id, [])
        before = sum(b - a for a, b in spans)
        if hi > lo:
            merged: list[tuple[int, int]] = []
            for a, b in sorted([*spans, (lo, hi)]):
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], b))
                else:
                    merged.append((a, b))
            spans[:] = merged
        total = sum(b - a for a, b in spans)
        self.recomputed_tokens += total - before
        COUNTS.add("recomputed_prefix_tokens", total - before)
        return total

    def _adopt_weights(self, generation: int, weights: str) -> None:
        """The worker keyed ``generation`` by the weights digest ``weights`` ("": by its life token)."""
        if generation != self.generation:  # (a report of an older generation: nothing to learn)
            return
        self.keyspace = replace(self.keyspace, weights=weights)
        if self.publisher is not None:
            self.publisher.keyspace = self.keyspace
        self._keys_unknown = False

    def begin_output(self, output: StepOutput | None) -> list[str]:
        """Ingest a step output's store reports; returns requests the engine must recompute.

        For each returned id the engine discards the step's sampled tokens and restarts the
        request (``request_finished(req, preempted=True)``, KV freed, rescheduled): its prefix
        rows could not be read, and the lost keys now clip its next hit. A request that failed
        ``MAX_RECOMPUTES`` times is not returned; ``take_output`` then raises for it.
        """
        if output is None:
            return []
        if output.weights is not None:
            self._adopt_weights(*output.weights)
        if output.published or output.lost:
            self.index.apply(output.published, output.lost)
        if not output.errors:
            return []
        redo: list[str] = []
        for rid in output.errors:
            n = self._recomputes.get(rid, 0)
            if n < MAX_RECOMPUTES and self.returns_routes(rid):
                self._recomputes[rid] = n + 1
                self.recomputed_requests += 1
                redo.append(rid)
        return redo
