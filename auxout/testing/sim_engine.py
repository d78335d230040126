"""A small but faithful engine loop that drives the real connectors and store.

It models what makes route return hard: a waiting/running queue with a token budget, chunked
prefill, a paged KV cache with prefix caching by chained block hashes (with ``cache_salt``),
preemption when KV blocks run out, speculative drafts with seeded random rejection, async
scheduling with one step in flight (scheduled optimistically on top of drafts), aborts and
prefix-cache resets, and KV that comes from outside the engine (``SimKVConnector``: a P/D
peer, an offload tier, a restarted engine's saved KV). The *runner* knows the true tokens as
soon as they are sampled; the *scheduler* learns them when it processes the step's output, as
in vLLM. Prefix hits are clipped to routes the worker can read, and a request whose prefix
rows still cannot be read is restarted and recomputes them (never a failed request).

Integrators can use it as a reference for where each connector call belongs.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from auxout.connector.held_rows import HeldRows
from auxout.connector.keys_output import KeysPublisher, store_address
from auxout.connector.messages import StepMetadata, StepOutput
from auxout.connector.row_check import RowCheck
from auxout.connector.scheduler import SchedulerConnector
from auxout.connector.worker import PendingStep, WorkerConnector
from auxout.errors import RoutesUnavailableError
from auxout.keys import KeySpace
from auxout.manifest import RouteManifest
from auxout.stores import ArenaStore, BackgroundStore, BlockStore
from auxout.testing.fake_moe import FakeMoE

_NONE_HASH = hashlib.sha256(b"auxout-sim").digest()


@dataclass
class SimResult:
    """What a finished (or aborted) request returned."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    prompt_start: int
    routed_experts: np.ndarray | None
    num_cached_tokens: int
    finish_reason: str
    error: str | None = None
    manifest: RouteManifest | None = None  # keys-only output: fetch(manifest, store) gives the routes
    inline_reason: str | None = None  # keys-only asked, rows returned inline: why
    reset_at: list[int] | None = None  # where each prefix-cache reset that hit it mid-request begins


class SimKVConnector:
    """KV saved outside the engine (a P/D peer, an offload tier, a restarted engine's saved KV).

    Engines sharing one connector see each other's KV: a finished request's computed KV is
    saved. Routes do not travel with the KV: they come from the route store or are recomputed.
    Two placements, as real connectors differ:

    - ``align="front"`` (vLLM's ``ExampleConnector``): saved full blocks by block hash; a later
      request anywhere matches the longest saved run beyond its local hit, in whole blocks, and
      the load writes that run into the blocks after the local hit.
    - ``align="tail"`` (NIXL, Mooncake's P/D connector): a peer's whole prompt, partial last
      block included, matched by the exact prompt; the load lines the peer's blocks up from
      the end with the blocks the engine allocated past its local hit.

    ``load`` is the placement oracle: it raises if the count the engine takes would make any
    block land on the wrong position (a cut hit: wrong KV on a real engine, or a crash).
    ``async_load``: the load lands between steps (NIXL): the engine resumes where
    ``SchedulerConnector.resume_after_load`` says; otherwise it counts as computed at once.
    """

    def __init__(self, align: str = "front", async_load: bool = False) -> None:
        if align not in ("front", "tail"):
            raise ValueError(f"align must be 'front' or 'tail', got {align!r}")
        self.align = align
        self.async_load = async_load
        self.saved: set[bytes] = set()
        self.prompts: dict[bytes, int] = {}  # tail: a prompt's key -> tokens of KV saved
        self.loaded_tokens = 0

    def match(self, hashes: list[bytes], start: int, limit: int) -> int:
        """Blocks ``start..`` (below ``limit``) saved here, counted from ``start``."""
        n = start
        while n < limit and hashes[n] in self.saved:
            n += 1
        return n - start

    def match_tokens(self, key: bytes, hashes: list[bytes], num_tokens: int, local: int, block_size: int) -> int:
        """Tokens past ``local`` the connector would load for a fresh request."""
        if self.align == "tail":
            return max(0, self.prompts.get(key, 0) - local)
        limit = min((num_tokens - 1) // block_size, len(hashes))
        return self.match(hashes, local // block_size, limit) * block_size

    def save(self, key: bytes, hashes: list[bytes], num_computed: int, prompt_len: int, block_size: int) -> None:
        """A finished request's KV: its computed full blocks, and (tail) its prompt's tokens."""
        self.saved.update(hashes[: num_computed // block_size])
        n = min(num_computed, prompt_len)
        if self.align == "tail" and n:
            self.prompts[key] = max(self.prompts.get(key, 0), n)

    def load(self, matched: int, local: int, taken: int, block_size: int) -> None:
        """Check that taking ``taken`` of ``matched`` tokens past ``local`` places every block right."""
        if taken == matched:
            return
        raise AssertionError(
            f"KV connector ({self.align}-aligned) matched {matched} tokens past {local} but the engine "
            f"allocated for {taken}: its blocks would land on the wrong positions"
        )

    def clear(self) -> None:
        self.saved.clear()
        self.prompts.clear()


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    max_tokens: int
    prompt_start: int
    salt: str | None
    want_routes: bool
    output: list[int] = field(default_factory=list)  # tokens the scheduler has processed
    truth: list[int] = field(default_factory=list)  # tokens the runner knows (incl. in-flight samples)
    num_computed: int = 0  # scheduler view (optimistic under async scheduling)
    true_computed: int = 0  # positions whose KV the runner really holds
    inflight: int = 0  # scheduled-but-unprocessed output tokens (async placeholders)
    block_hashes: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1
    manifest: RouteManifest | None = None
    incarnation: int = 0
    error: str | None = None

    @property
    def request_id(self) -> str:
        return self.rid

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output)

    def tokens(self) -> list[int]:
        return self.prompt + self.output


class _KVCache:
    """Paged KV blocks with a prefix cache keyed by block hash; LRU free queue (tail-first)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.refs = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}

    def lookup(self, req: _Request) -> list[int]:
        """Cached blocks of the longest prefix hit, leaving at least one token to compute."""
        limit = (req.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in req.block_hashes[:limit]:
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def lookup_len(self, tokens: list[int], salt: str | None = None) -> int:
        """Tokens of ``tokens`` the KV cache holds as a prefix (for tests and metrics)."""
        probe = _Request("probe", list(tokens), 1, 0, salt, False)
        _hash_blocks(probe, self.block_size)
        return len(self.lookup(probe)) * self.block_size

    def allocate(self, req: _Request, hit: list[int], num_tokens_total: int) -> bool:
        need = -(-num_tokens_total // self.block_size) - len(req.blocks) - len(hit)
        evictable = len(self.free) - sum(1 for b in hit if self.refs[b] == 0)
        if need > evictable:
            return False
        for b in hit:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1
        req.blocks.extend(hit)
        for _ in range(max(need, 0)):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(b, None)
            if h is not None and self.cached.get(h) == b:
                del self.cached[h]
            self.refs[b] = 1
            req.blocks.append(b)
        return True

    def cache_full_blocks(self, req: _Request) -> None:
        """Register full blocks with known hashes as soon as they are scheduled (as vLLM does)."""
        n = min(req.num_computed // self.block_size, len(req.block_hashes), len(req.blocks))
        for i in range(n):
            b, h = req.blocks[i], req.block_hashes[i]
            if self.hash_of.get(b) is None and h not in self.cached:
                self.hash_of[b] = h
                self.cached[h] = b

    def release(self, req: _Request) -> None:
        for b in reversed(req.blocks):  # tail first: the tail of a chain is evicted first
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None
        req.blocks = []

    def reset(self) -> None:
        self.hash_of.clear()
        self.cached.clear()


@dataclass
class _Scheduled:
    req: _Request
    incarnation: int
    num_tokens: int
    num_drafts: int
    reported_start: int


class SimEngine:
    """Engine loop over ``FakeMoE`` with auxout's real scheduler/worker connectors and store."""

    def __init__(
        self,
        model: FakeMoE,
        *,
        block_size: int = 16,
        max_num_batched_tokens: int = 256,
        max_num_seqs: int = 8,
        num_kv_blocks: int = 512,
        async_scheduling: bool = False,
        num_speculative_tokens: int = 0,
        draft_acceptance: float = 0.7,
        store_bytes: int | None = None,
        seed: int = 0,
        store: BlockStore | None = None,
        output: str = "inline",
        inline_below: int = 0,
        kv_connector: SimKVConnector | None = None,
        shared_store: bool = False,
        namespace: str = "sim",
        on_finish: Callable[[SimResult], None] | None = None,
        bulk_steps: bool = True,
        fused_steps: bool = True,
        life: str = "",
        weights_digest: Callable[[], str] | None = None,
        row_check: bool = True,
    ) -> None:
        """``shared_store``: ``store`` is reachable by other engines too (the scheduler may ask it
        for routes this engine did not publish). ``bulk_steps``: take a plain decode step's rows
        whole (``take_step``), as vLLM's bridge does; False: always per request. ``fused_steps``:
        with one batch in flight, offer each step without drafts to ``commit_lane_step`` first,
        as vLLM's worker does (the three calls only when it declines). ``life``: this engine's lifetime token (``KeySpace.life``);
        ``weights_digest``: names each generation after a reset by the weights (``KeySpace.weights``),
        as vLLM's worker does for a shared store (swap ``model`` and reset to update weights).
        ``row_check``: check every step's rows for ids no router can produce, as vLLM's worker
        does (``auxout.connector.row_check``)."""
        self.model = model
        self.kv_connector = kv_connector
        self.on_finish = on_finish  # called as each request finishes (e.g. fetch its manifest at once)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.async_scheduling = async_scheduling
        self.num_spec = num_speculative_tokens
        self.draft_acceptance = draft_acceptance
        self.rng = np.random.default_rng(seed)
        self.kv = _KVCache(num_kv_blocks, block_size)
        profile = model.profile
        object_nbytes = profile.block_nbytes(block_size)
        inner = store if store is not None else ArenaStore(store_bytes or num_kv_blocks * object_nbytes, object_nbytes)
        self.store = BackgroundStore(inner, max_pending=2 * max_num_seqs, inline_below=inline_below)
        self.held = HeldRows(compact_every=3)  # small: every long request exercises compaction
        self.bulk_steps = bulk_steps
        self.fused_steps = fused_steps and not async_scheduling
        self.bulk_taken = 0  # decode steps whose rows were taken whole (take_step)
        keyspace = KeySpace(namespace, life)
        publisher = KeysPublisher(
            self.store, profile=profile, keyspace=keyspace, block_size=block_size, address=store_address(inner)
        )
        self.scheduler = SchedulerConnector(
            publisher=publisher,
            default_output=output,
            keyspace=keyspace,
            block_size=block_size,
            remote_contains=self.store.contains if shared_store else None,
            weights_from_worker=weights_digest is not None,
        )
        self.worker = WorkerConnector(
            profile,
            block_size=block_size,
            store=self.store,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_concurrent_batches=2 if async_scheduling else 1,
            keyspace=keyspace,
            weights_digest=weights_digest,
            row_check=RowCheck(profile) if row_check else None,
        )
        self.requests: dict[str, _Request] = {}
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self._inflight: deque[tuple[PendingStep | StepOutput | None, list[_Scheduled], np.ndarray, np.ndarray, list]] = (
            deque()
        )
        self._done: dict[str, SimResult] = {}
        self.num_steps = 0
        self.num_preemptions = 0

    # -- public API -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        prompt_start: int = 0,
        cache_salt: str | None = None,
        return_routed_experts: bool = True,
        output: str | None = None,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already running")
        if not prompt or max_tokens <= 0:
            raise ValueError("a request needs a non-empty prompt and max_tokens > 0")
        need = -(-(len(prompt) + max_tokens + self.num_spec) // self.block_size)
        if need > len(self.kv.refs):
            raise ValueError(f"request {request_id!r} needs {need} KV blocks; the cache has {len(self.kv.refs)}")
        self.scheduler.add_request(request_id, len(prompt), prompt_start, return_routed_experts, output)
        req = _Request(request_id, list(prompt), max_tokens, prompt_start, cache_salt, return_routed_experts)
        req.truth = list(prompt)
        self._update_hashes(req)
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        self._finish(req, "abort")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Succeeds only when nothing holds KV blocks and no output is in flight (like vLLM);
        ``reset_running_requests`` first preempts the running requests (an RL weight sync while
        they run: they recompute), when no output is in flight."""
        if reset_running_requests and not self._inflight:
            for req in list(self.running):
                self._preempt(req)
        if self.running or self._inflight or any(r.blocks for r in self.waiting):
            return False
        self.kv.reset()
        self.scheduler.reset()
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._inflight)

    def run(self, max_steps: int = 1_000_000) -> dict[str, SimResult]:
        """Step until idle; returns every request that finished during the call."""
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            self.step()
        else:
            raise RuntimeError(f"SimEngine did not become idle within {max_steps} steps")
        done, self._done = self._done, {}
        return done

    def step(self) -> None:
        """One engine step: schedule, execute, and process the oldest output when due."""
        scheduled = self._schedule()
        meta = self.scheduler.build_metadata([s.req.rid for s in scheduled], self.requests)
        self.num_steps += 1
        if scheduled and self.fused_steps:  # (the metadata is applied with the step's rows)
            self._inflight.append(self._execute(scheduled, meta))
        else:
            self.worker.begin_step(meta)
            if scheduled:
                self._inflight.append(self._execute(scheduled))
        limit = 2 if self.async_scheduling else 1
        if self._inflight and (len(self._inflight) >= limit or not scheduled):
            self._process(*self._inflight.popleft())

    def close(self) -> None:
        self.worker.close()

    # -- scheduling -------------------------------------------------------------------------
    def _schedule(self) -> list[_Scheduled]:
        budget = self.max_num_batched_tokens
        out: list[_Scheduled] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            total_out = len(req.output) + req.inflight
            if total_out >= req.max_tokens:  # its last token is in flight
                i += 1
                continue
            pending_known = req.num_tokens + req.inflight - req.num_computed
            drafts = 0
            if pending_known == 1 and self.num_spec:
                drafts = max(0, min(self.num_spec, req.max_tokens - total_out - 1, budget - 1))
            n = min(pending_known + drafts, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate(req, [], req.num_computed + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req not in self.running:
                break
            out.append(_Scheduled(req, req.incarnation, n, drafts, req.num_computed))
            req.num_computed += n
            self.kv.cache_full_blocks(req)
            if req.num_computed >= req.num_tokens + req.inflight:  # samples this step
                req.inflight += 1 + drafts
            budget -= n
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit, start = self._prefix_hit(req)
            n = min(req.num_tokens - start, budget)
            if not self.kv.allocate(req, hit, start + n):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = start
            req.num_computed = req.true_computed = start
            self.running.append(req)
            out.append(_Scheduled(req, req.incarnation, n, 0, start))
            req.num_computed += n
            self.kv.cache_full_blocks(req)
            if req.num_computed >= req.num_tokens:
                req.inflight += 1
            budget -= n
        return out

    def _prefix_hit(self, req: _Request) -> tuple[list[int], int]:
        """Local cached blocks (clipped to readable routes) and the tokens to skip: the local hit,
        plus a KV connector's hit taken whole or not at all (``SchedulerConnector.external_hit``)."""
        if req.num_computed != 0:
            return [], 0
        bs = self.block_size
        hit = self.kv.lookup(req)
        keep = self.scheduler.readable_prefix(req, len(hit) * bs) // bs
        hit = hit[:keep]
        local = keep * bs
        conn = self.kv_connector
        if conn is None or req.incarnation or req.output:
            return hit, local
        ext = conn.match_tokens(self._prompt_key(req), req.block_hashes, req.num_tokens, local, bs)
        if ext <= 0:
            return hit, local
        taken = self.scheduler.external_hit(req, local, ext, conn.async_load)
        if not taken:
            return hit, local
        conn.load(ext, local, taken, bs)
        conn.loaded_tokens += taken
        if conn.async_load:  # (lands before the next step here)
            return hit, self.scheduler.resume_after_load(req, local + taken)
        return hit, local + taken

    @staticmethod
    def _prompt_key(req: _Request) -> bytes:
        return hashlib.sha256(repr((req.salt, req.prompt)).encode()).digest()

    def _preempt(self, req: _Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.scheduler.request_finished(req, preempted=True)
        self.kv.release(req)
        req.num_computed = req.true_computed = 0
        req.inflight = 0
        req.truth = req.tokens()
        req.incarnation += 1  # outputs in flight for the old incarnation are dropped
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- the runner ---------------------------------------------------------------------------
    def _execute(self, scheduled: list[_Scheduled], meta: StepMetadata | None = None):  # type: ignore[no-untyped-def]
        rows: list[np.ndarray] = []
        qsl = [0]
        sampled_tokens: list[list[int]] = []
        num_sampled: list[int] = []
        num_rejected: list[int] = []
        for s in scheduled:
            req = s.req
            start = req.true_computed
            known = s.num_tokens - s.num_drafts
            inputs = req.truth[start : start + known]
            samples = start + known == len(req.truth)
            drafts: list[int] = []
            context = req.truth[: start + known]
            if s.num_drafts:
                c = list(context)
                for _ in range(s.num_drafts):
                    t = self.model.next_token(c)
                    if self.rng.random() >= self.draft_acceptance:
                        t = (t + 1 + int(self.rng.integers(self.model.vocab_size - 1))) % self.model.vocab_size
                    drafts.append(t)
                    c.append(t)
            seq = context + drafts
            rows.append(self.model.routes(seq, start))
            assert len(rows[-1]) == len(inputs) + len(drafts)
            qsl.append(qsl[-1] + s.num_tokens)
            toks: list[int] = []
            rejected = 0
            if samples:
                accepted = 0
                for j, d in enumerate(drafts):
                    if self.model.next_token(context + drafts[:j]) != d:
                        break
                    accepted += 1
                toks = drafts[:accepted] + [self.model.next_token(context + drafts[:accepted])]
                rejected = len(drafts) - accepted
                req.truth.extend(toks)
            req.true_computed = start + s.num_tokens - rejected
            sampled_tokens.append(toks)
            num_sampled.append(len(toks))
            num_rejected.append(rejected)
        batch = np.concatenate(rows) if rows else self.model.profile.empty(0)
        ids, starts = [s.req.rid for s in scheduled], [s.reported_start for s in scheduled]
        if meta is not None:
            no_drafts = not any(s.num_drafts for s in scheduled)
            done = self.worker.commit_lane_step(meta, ids, starts, qsl, batch) if no_drafts else None
            if done is not None:
                return done, scheduled, np.array(num_sampled), np.array(num_rejected), sampled_tokens
            self.worker.begin_step(meta)
        pending = self.worker.prepare_output(ids, starts, qsl, batch)
        return pending, scheduled, np.array(num_sampled), np.array(num_rejected), sampled_tokens

    # -- processing a step's output (scheduler side) -----------------------------------------
    def _process(
        self,
        pending: PendingStep | StepOutput | None,
        scheduled: list[_Scheduled],
        num_sampled: np.ndarray,
        num_rejected: np.ndarray,
        sampled_tokens: list[list[int]],
    ) -> None:
        output: StepOutput | None = None
        if isinstance(pending, StepOutput):  # committed when prepared (``commit_lane_step``)
            output = pending
        elif pending is not None:
            output = self.worker.process_output(pending, num_sampled, num_rejected)
        redo = set(self.scheduler.begin_output(output))
        spans = output.span_map() if output is not None else {}
        emitted: list[_Request] = []
        for s, toks, rej in zip(scheduled, sampled_tokens, num_rejected.tolist()):
            req = s.req
            if req.rid not in self.requests or s.incarnation != req.incarnation:
                continue  # aborted or preempted while this step was in flight
            if req.rid in redo:  # its prefix routes were unreadable: drop the samples, recompute
                self._preempt(req)
                continue
            req.num_computed -= rej
            if toks:
                req.inflight -= 1 + s.num_drafts
                room = req.max_tokens - len(req.output)
                req.output.extend(toks[:room])
                self._update_hashes(req)
            if toks or req.rid in spans:  # rows are returned as soon as they are captured
                emitted.append(req)
        finished = [len(r.output) >= r.max_tokens for r in emitted]
        if self.bulk_steps and output is not None and not any(finished):  # as vLLM's bridge does
            step_rows = self.scheduler.take_step(output, emitted)
            if step_rows is not None:
                self.held.add_step(output.req_ids, step_rows)
                self.bulk_taken += 1
                return
        chunks = self.scheduler.take_outputs(output, emitted, finished)
        for req, fin, chunk in zip(emitted, finished, chunks):
            if isinstance(chunk, RoutesUnavailableError):  # fail this request, not the engine
                req.error = str(chunk)
                self._finish(req, "error")
                continue
            if isinstance(chunk, RouteManifest):
                req.manifest = chunk
            elif chunk is not None:
                self.held.add(req.rid, chunk)
            if fin:
                self._finish(req, "length")

    def _finish(self, req: _Request, reason: str) -> None:
        self.scheduler.request_finished(req)
        if self.kv_connector is not None:  # save the computed KV for other engines / later
            self.kv_connector.save(
                self._prompt_key(req), req.block_hashes, req.true_computed, len(req.prompt), self.block_size
            )
        self.kv.release(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        del self.requests[req.rid]
        routes = self.held.pop(req.rid)
        if not (req.want_routes and req.error is None and req.manifest is None):
            routes = None
        elif routes is None:
            routes = self.model.profile.empty(0)
        inline_reason = self.scheduler.inline_fallbacks.pop(req.rid, None)  # keys-only answered inline
        reset_at = self.scheduler.reset_at.pop(req.rid, None)
        result = self._done[req.rid] = SimResult(
            req.rid,
            req.tokens(),
            len(req.prompt),
            req.prompt_start,
            routes,
            max(req.num_cached_tokens, 0),
            reason,
            req.error,
            req.manifest,
            inline_reason,
            reset_at,
        )
        if self.on_finish is not None:
            self.on_finish(result)

    def _update_hashes(self, req: _Request) -> None:
        _hash_blocks(req, self.block_size)


def _hash_blocks(req: _Request, bs: int) -> None:
    """Chained block hashes of every full block of the request's known tokens (salt in the first)."""
    toks = req.tokens()
    hashes = req.block_hashes
    for i in range(len(hashes), len(toks) // bs):
        prev = hashes[i - 1] if i else _NONE_HASH
        h = hashlib.sha256(prev)
        h.update(np.asarray(toks[i * bs : (i + 1) * bs], dtype=np.int64).tobytes())
        if i == 0 and req.salt is not None:
            h.update(req.salt.encode())
        hashes.append(h.digest())


def oracle_routes(model: FakeMoE, result: SimResult) -> np.ndarray:
    """What ``result.routed_experts`` must equal: a full pass over the request's tokens."""
    return model.routes(result.tokens[: len(result.tokens) - 1], 0)[result.prompt_start :]
