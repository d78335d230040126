"""Data-plane benchmark: auxout's connector pair vs. vLLM 0.32's in-tree aux-output connectors.

Drives the scheduler connector, the worker connector and the store the vLLM integration
builds by default (an ``ArenaStore`` behind a ``BackgroundStore`` writer thread; ``--sync-store``
adds a run without the thread) exactly as an engine would, with no model: every request's
routed-expert rows are random ``uint8`` arrays generated up front.
The same precomputed schedule and the same rows are replayed through vLLM's
``vllm.distributed.aux_output_connector`` (built without a GPU, as its tests do).

Workloads (profile 48 layers x top-8 uint8, hash block 16, max_num_seqs 256, budget 8192):

(a) decode      256 requests x 1 token/step after an untimed prefill warm-up; block hashes
                grow every 16 tokens, staggered so ~16 requests complete a block per step.
(b) prefill     8 new requests x 1,024 prompt tokens per step, each finishing after 1 token.
(c) multi-turn  64 conversations x 6 turns; each prompt = history + 256 new tokens, routes
                returned from position 0, so every later turn materializes its cached prefix.

Only connector/store work is timed (``time.perf_counter`` around the connector calls of each
step, plus the final terminal-event delivery and a store flush); building the step's rows and
the engine's own bookkeeping are not. Reported numbers are medians over repeats, and auxout and
vLLM runs are interleaved so machine noise hits both alike.

auxout's worker connector checks every step's rows for ids no router can produce
(``auxout.connector.row_check``, as vLLM's worker builds it; the rows fed in are ones a router can produce):
the check's own time, which is part of auxout's cost, is printed as its share of that cost.
``--unchecked`` adds a row for auxout without the check, and the paired ratio of the two.

``--bridge`` adds a row for auxout as its vLLM bridge drives it: a running request's rows are
held (``HeldRows``) until it finishes, a steady decode step is taken whole (``take_step``), and
the holding and the join at finish are timed (the other rows hold only the verified requests'
chunks, untimed; compare it with ``--time-join`` for multi-turn, whose joins copy the history).

    .venv/bin/python benchmarks/dataplane.py            # ~1-3 min on 2 cores
    .venv/bin/python benchmarks/dataplane.py --quick    # ~20 s (+ vLLM import time)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from toggle_overhead import bootstrap_median_ci

from auxout.connector.held_rows import HeldRows
from auxout.connector.messages import StepOutput
from auxout.connector.row_check import RowCheck
from auxout.connector.scheduler import SchedulerConnector
from auxout.connector.worker import WorkerConnector
from auxout.keys import KeySpace
from auxout.profile import RouteProfile
from auxout.stores import ArenaStore, BackgroundStore, make_store
from auxout.stores.rows import join_rows

PROFILE = RouteProfile(48, 8, 128)
BLOCK = 16
MAX_SEQS = 256
MAX_BATCHED = 8192
HASH_BYTES = 32
STORE_OBJECTS = 16384  # 16384 x 6 KiB = 96 MiB per store (same for both implementations)
TOKEN_NBYTES = PROFILE.token_nbytes
_I64 = np.int64

# Targets (same machine, same run): auxout's connector cost as a fraction of vLLM's in-tree connectors' cost.
MAX_COST_RATIO = {"decode": 0.25, "prefill": 0.33, "multi-turn": 0.33}
MAX_CHECK_SHARE = 0.02  # the row check's share of auxout's own connector cost, same run


# -- workload description (connector independent) ---------------------------------------------
@dataclass
class Spec:
    """One request: its prompt, output budget, prefix-cache hit and the rows of every position."""

    rid: str
    prompt_len: int
    max_tokens: int
    cached: int  # block-aligned prefix hit at admission (0 = none)
    hashes: list[bytes]  # chained block hashes of the full token sequence (shared by turns)
    rows: np.ndarray  # routes of positions [0, prompt_len + max_tokens - 1)
    follow: int = -1  # spec index queued once this request finishes (next conversation turn)
    verify: bool = False


@dataclass
class SchedOut:
    """The one field of vLLM's ``SchedulerOutput`` that its aux-output connector reads."""

    num_scheduled_tokens: dict[str, int]


@dataclass
class Step:
    admit: list[int]  # spec indices admitted (announced) this step
    sched: list[int]  # spec indices scheduled, in batch order
    rids: list[str]
    counts: list[int]
    starts: np.ndarray  # computed tokens before the step (int64)
    qsl: np.ndarray  # query_start_loc (int64, n + 1)
    sampled: np.ndarray  # int64, 1 where the request sampled a token
    rejected: np.ndarray  # int64 zeros (no speculative decoding)
    emitters: list[int]  # spec indices that sampled
    finished: list[int]  # emitters that finished
    chunked: list[int]  # scheduled, sampled nothing (a prefill chunk)
    out_rows: int  # rows the step returns to requests
    sched_out: SchedOut


@dataclass
class Workload:
    name: str
    specs: list[Spec]
    steps: list[Step]
    t_start: int  # first timed step; earlier steps are an untimed warm-up

    @property
    def timed_steps(self) -> list[Step]:
        return self.steps[self.t_start :]


@dataclass
class _SimState:
    spec: Spec
    computed: int = 0
    num_tokens: int = 0
    n_out: int = 0
    emitted: int = 0


def simulate(specs: list[Spec], initial: Sequence[int], max_steps: int) -> list[Step]:
    """A plain engine scheduler (running first, then admission; chunked prefill; no spec decode)."""
    waiting: deque[int] = deque(initial)
    running: list[int] = []
    state: dict[int, _SimState] = {}
    steps: list[Step] = []
    while (waiting or running) and len(steps) < max_steps:
        budget = MAX_BATCHED
        sched: list[int] = []
        counts: list[int] = []
        starts: list[int] = []
        admit: list[int] = []
        for i in running:
            st = state[i]
            n = min(st.num_tokens - st.computed, budget)
            if n <= 0:
                continue
            sched.append(i)
            counts.append(n)
            starts.append(st.computed)
            budget -= n
        while waiting and budget > 0 and len(running) < MAX_SEQS:
            i = waiting.popleft()
            sp = specs[i]
            st = state[i] = _SimState(sp, sp.cached, sp.prompt_len)
            n = min(sp.prompt_len - sp.cached, budget)
            running.append(i)
            admit.append(i)
            sched.append(i)
            counts.append(n)
            starts.append(st.computed)
            budget -= n
        sampled = np.zeros(len(sched), dtype=_I64)
        emitters: list[int] = []
        finished: list[int] = []
        out_rows = 0
        for k, (i, n) in enumerate(zip(sched, counts)):
            st = state[i]
            st.computed += n
            if st.computed == st.num_tokens:
                sampled[k] = 1
                st.n_out += 1
                st.num_tokens += 1
                emitters.append(i)
                out_rows += st.num_tokens - 1 - st.emitted
                st.emitted = st.num_tokens - 1
                if st.n_out == st.spec.max_tokens:
                    finished.append(i)
        for i in finished:
            running.remove(i)
            if specs[i].follow >= 0:
                waiting.append(specs[i].follow)
        rids = [specs[i].rid for i in sched]
        qsl = np.zeros(len(sched) + 1, dtype=_I64)
        np.cumsum(counts, out=qsl[1:])
        steps.append(
            Step(
                admit, sched, rids, counts, np.array(starts, dtype=_I64), qsl, sampled,
                np.zeros(len(sched), dtype=_I64), emitters, finished,
                [i for k, i in enumerate(sched) if not sampled[k]], out_rows,
                SchedOut(dict(zip(rids, counts))),
            )
        )
    return steps


def _hashes(rng: np.random.Generator, n: int) -> list[bytes]:
    blob = rng.bytes(HASH_BYTES * n)
    return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


def _rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows a router can produce (distinct ids per (token, layer)), so the row check passes them."""
    spread = np.arange(PROFILE.top_k, dtype=np.int64) * (PROFILE.num_experts // PROFILE.top_k)
    base = rng.integers(0, PROFILE.num_experts, size=(n, PROFILE.num_layers, 1))
    return ((base + spread) % PROFILE.num_experts).astype(np.uint8)


def _mark_verify(specs: list[Spec], n: int) -> None:
    stride = max(1, len(specs) // n)
    for sp in specs[::stride]:
        sp.verify = True
    specs[-1].verify = True


def decode_workload(rng: np.random.Generator, n_steps: int, n_req: int = 256, prompt: int = 240) -> Workload:
    specs: list[Spec] = []
    for i in range(n_req):
        plen = prompt + (i % BLOCK)  # staggered: 16 requests complete a block each step
        max_tokens = n_steps + 64
        total = plen + max_tokens
        specs.append(Spec(f"d{i}", plen, max_tokens, 0, _hashes(rng, total // BLOCK), _rows(rng, total - 1)))
    _mark_verify(specs, 16)
    steps = simulate(specs, range(n_req), max_steps=n_steps + 64)
    t_start = next(
        k for k, s in enumerate(steps) if len(s.sched) == n_req and all(c == 1 for c in s.counts)
    )
    return Workload("decode", specs, steps[: t_start + n_steps], t_start)


def prefill_workload(rng: np.random.Generator, n_steps: int, warmup: int = 4, per_step: int = 8) -> Workload:
    plen = MAX_BATCHED // per_step
    pool = [_rows(rng, MAX_BATCHED) for _ in range(4)]  # cycled: 4 x 3 MiB distinct step payloads
    specs: list[Spec] = []
    total = (n_steps + warmup) * per_step
    all_hashes = _hashes(rng, total * (plen // BLOCK))
    nb = plen // BLOCK
    for j in range(total):
        step, k = divmod(j, per_step)
        rows = pool[step % len(pool)][k * plen : (k + 1) * plen]
        specs.append(Spec(f"p{j}", plen, 1, 0, all_hashes[j * nb : (j + 1) * nb], rows))
    _mark_verify(specs, 16)
    steps = simulate(specs, range(total), max_steps=10**4)
    assert len(steps) == n_steps + warmup and all(len(s.sched) == per_step for s in steps)
    return Workload("prefill", specs, steps, warmup)


def multiturn_workload(
    rng: np.random.Generator, n_conv: int = 64, turns: int = 6, new_tokens: int = 256, out_tokens: int = 4
) -> Workload:
    specs: list[Spec] = []
    first: list[int] = []
    for c in range(n_conv):
        total = turns * (new_tokens + out_tokens)
        hashes = _hashes(rng, total // BLOCK)
        rows = _rows(rng, total)
        prev_total = 0  # tokens of the previous turn (prompt + outputs)
        for t in range(turns):
            plen = prev_total + new_tokens
            cached = 0
            if t:
                # the previous turn computed prev_total - 1 tokens; the hit is block aligned and
                # leaves at least one prompt token to compute (as vLLM's prefix cache does)
                cached = min((prev_total - 1) // BLOCK, (plen - 1) // BLOCK) * BLOCK
            idx = len(specs)
            if t:
                specs[idx - 1].follow = idx
            else:
                first.append(idx)
            specs.append(Spec(f"c{c}t{t}", plen, out_tokens, cached, hashes, rows[: plen + out_tokens - 1]))
            prev_total = plen + out_tokens
    _mark_verify(specs, 24)
    steps = simulate(specs, first, max_steps=10**5)
    return Workload("multi-turn", specs, steps, 0)


WORKLOADS = ("decode", "prefill", "multi-turn")


def build_workload(name: str, rng: np.random.Generator, *, quick: bool = False) -> Workload:
    """One of ``WORKLOADS`` at this script's sizes (``quick``: the ~20 s sizes); the other
    benchmarks that replay these workloads build them here, so their numbers compare."""
    if name == "decode":
        return decode_workload(rng, 48 if quick else 192)
    if name == "prefill":
        return prefill_workload(rng, 16 if quick else 48)
    if name == "multi-turn":
        return multiturn_workload(rng, n_conv=24 if quick else 64)
    raise ValueError(f"unknown workload {name!r}; known: {WORKLOADS}")


# -- replay -------------------------------------------------------------------------------------
JOIN = [False]
"""``--time-join``: every request holds its chunks and joins them when it finishes, inside the timed
emit (both drivers). By default only verified requests hold chunks and their join is not timed:
an engine joins a request's rows once when it hands them over, whichever connector produced them."""
CLOCK: list[Callable[[], float]] = [time.perf_counter]
CHECK_SECONDS = [0.0]  # the row check's time within the timed connector calls of the current replay


class TimedRowCheck(RowCheck):
    """``RowCheck`` timing itself (inside the connector's timed calls, so part of its step cost)."""

    def __call__(self, rows: np.ndarray) -> np.ndarray | None:
        clock = CLOCK[0]
        t = clock()
        try:
            return super().__call__(rows)
        finally:
            CHECK_SECONDS[0] += clock() - t
"""What ``replay`` times with; ``--thread-time`` swaps in the step thread's CPU time, for A/B runs of
two commits on a shared machine (it leaves out the writer thread and time spent waiting)."""

class _SamplingParams:
    __slots__ = ("routed_experts_prompt_start",)

    def __init__(self, prompt_start: int) -> None:
        self.routed_experts_prompt_start = prompt_start


class Req:
    """What both scheduler connectors read from an engine request (plain attributes)."""

    __slots__ = (
        "request_id", "num_tokens", "num_output_tokens", "num_prompt_tokens", "block_hashes",
        "sampling_params", "finished", "chunks", "spec", "joined",
    )

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.request_id = spec.rid
        self.num_prompt_tokens = spec.prompt_len
        self.num_tokens = spec.prompt_len
        self.num_output_tokens = 0
        self.block_hashes: list[bytes] = spec.hashes[: spec.prompt_len // BLOCK]
        self.sampling_params = _SamplingParams(0)
        self.finished = False
        self.chunks: list[np.ndarray] | None = [] if spec.verify or JOIN[0] else None
        self.joined: np.ndarray | None = None

    def is_finished(self) -> bool:
        return self.finished


class Driver(Protocol):
    name: str

    def step(self, st: Step, rows: np.ndarray, live: dict[str, Req], admitted: list[Req]) -> Any: ...
    def emit(self, out: Any, emitters: list[Req], finished: list[Req], chunked: list[Req]) -> None: ...
    def drain(self, live: dict[str, Req]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def check(self) -> str | None: ...


def _hold(chunks: list[np.ndarray], parts: object) -> None:
    if type(parts) is list:
        chunks.extend(parts)
    elif isinstance(parts, np.ndarray):
        chunks.append(parts)


def _join_finished(finished: list[Req]) -> None:
    """``--time-join``: the hand-over join of each finished request (timed, both drivers)."""
    if JOIN[0]:
        for r in finished:
            if r.chunks:
                r.joined = join_rows(r.chunks)


class AuxoutDriver:
    """auxout with the store the vLLM integration builds (``make_store("arena")``: writer thread,
    small batches applied in place while it is idle)."""

    name = "auxout"
    background = True
    checked = True  # (the row check, as vLLM's worker builds it)

    def __init__(self) -> None:
        nbytes = PROFILE.block_nbytes(BLOCK)
        self.store = make_store("arena", max_bytes=STORE_OBJECTS * nbytes, object_nbytes=nbytes, background=self.background)
        inner = self.store.inner if isinstance(self.store, BackgroundStore) else self.store
        assert isinstance(inner, ArenaStore)
        arena = inner._arena  # steady state: fault the arena in (untimed), as a warm engine has
        if arena is not None:
            arena.fill(0)
        self.sched = SchedulerConnector()
        self.worker = WorkerConnector(
            PROFILE, block_size=BLOCK, store=self.store, max_num_seqs=MAX_SEQS,
            max_num_batched_tokens=MAX_BATCHED, keyspace=KeySpace("bench"),
            row_check=TimedRowCheck(PROFILE) if self.checked else None,  # (its own time is kept apart)
        )

    def step(self, st: Step, rows: np.ndarray, live: dict[str, Req], admitted: list[Req]) -> StepOutput:
        sched, worker = self.sched, self.worker
        for r in admitted:
            sched.add_request(r.request_id, r.num_prompt_tokens, 0)
        meta = sched.build_metadata(st.rids, live)
        # as vLLM's worker makes the calls: a step without drafts is final, and the decode lane's
        # next step is committed in one call (the cursors as the lists it reads them into)
        out = worker.commit_lane_step(meta, st.rids, st.starts.tolist(), st.qsl.tolist(), rows)
        if out is not None:
            return out
        worker.begin_step(meta)
        pending = worker.prepare_output(st.rids, st.starts, st.qsl, rows)
        assert pending is not None
        return worker.process_output(pending, st.sampled, st.rejected)

    def emit(self, out: StepOutput, emitters: list[Req], finished: list[Req], chunked: list[Req]) -> None:
        # as the vLLM bridge does: a prefix hit's rows come in two parts (prefix, own rows), held
        # per request and joined once when handed over (not timed, for either connector)
        take = self.sched.take_output_parts
        for r in emitters:
            parts = take(out, r, finished=r.finished)
            if r.chunks is not None:
                _hold(r.chunks, parts)
        # rows go out as captured: a prefill chunk that sampled nothing is collected too (the vLLM
        # bridge holds them until the request emits, ``hold_uncollected``)
        for r in chunked:
            parts = take(out, r)
            if r.chunks is not None:
                _hold(r.chunks, parts)
        _join_finished(finished)
        for r in finished:
            self.sched.request_finished(r)

    def drain(self, live: dict[str, Req]) -> None:
        self.worker.begin_step(self.sched.build_metadata((), live))
        self.flush()

    def flush(self) -> None:
        if isinstance(self.store, BackgroundStore):
            self.store.flush()

    def close(self) -> None:
        self.worker.close()

    def check(self) -> str | None:
        drops = self.worker.dropped_batches + getattr(self.store, "dropped_batches", 0)
        return f"{drops} store batches dropped" if drops else None


class AuxoutUncheckedDriver(AuxoutDriver):
    """auxout without the row check (``--unchecked``): the same run's cost of the check, paired."""

    name = "auxout-unchecked"
    checked = False


class AuxoutSyncDriver(AuxoutDriver):
    """auxout with a bare ``ArenaStore``: publication on the step's own thread (``--sync-store``)."""

    name = "auxout-sync"
    background = False


class AuxoutBridgeDriver(AuxoutDriver):
    """auxout as its vLLM bridge drives it (``--bridge``): every request's rows are held until it
    finishes (``HeldRows``, timed), and a plain decode step is taken whole (``take_step``).

    vLLM's loop asks the bridge for each request; the bridge only queues a running request then
    (no rows are handed over before it finishes) and takes the queued ones after the loop, in one
    call for a steady decode batch. Holding every request's rows and joining them at its finish
    are timed here, while the other drivers hold only the verified requests' chunks, untimed:
    this row is the conservative one."""

    name = "auxout-bridge"

    def __init__(self) -> None:
        super().__init__()
        self.held = HeldRows()

    def emit(self, out: StepOutput, emitters: list[Req], finished: list[Req], chunked: list[Req]) -> None:
        take, held = self.sched.take_output_parts, self.held
        bulk = not out.heads and not out.errors  # (the bridge queues only in a step without them)
        queued: list[Req] = []
        tokens: list[int] = []
        for r in emitters:  # (the bridge's take_output, called per request by vLLM's loop)
            if bulk and not r.finished:
                queued.append(r)
                tokens.append(r.num_tokens)
                continue
            self._keep(r, take(out, r, finished=r.finished))
            if r.finished:
                rows = held.pop(r.request_id)  # handed over joined, as the bridge's engine_rows
                if r.chunks is not None and rows is not None:
                    r.chunks.append(rows)
        if queued:
            whole = self.sched.take_step(out, queued, tokens)
            if whole is not None:
                held.add_step(out.req_ids, whole)
            else:
                for r, taken in zip(queued, self.sched.take_outputs(out, queued)):
                    self._keep(r, taken)
        for r in chunked:  # prefill chunks that sampled nothing: held too
            self._keep(r, take(out, r))
        for r in finished:
            self.sched.request_finished(r)

    def _keep(self, r: Req, parts: object) -> None:
        """Hold what ``take_output_parts``/``take_outputs`` gave for ``r`` (a list: parts in order)."""
        if type(parts) is list:
            for part in parts:
                self.held.add(r.request_id, part)
        elif isinstance(parts, np.ndarray):
            self.held.add(r.request_id, parts)

    def drain(self, live: dict[str, Req]) -> None:
        super().drain(live)
        for r in live.values():  # the rows still held are handed over (timed, as replay times drain)
            rows = self.held.pop(r.request_id)
            if r.chunks is not None and rows is not None:
                r.chunks.append(rows)


class VllmDriver:
    """vLLM's in-tree connectors; the worker is built with ``object.__new__`` (no GPU/model)."""

    name = "vLLM"

    def __init__(self, mods: dict[str, Any]) -> None:
        conn, worker_mod, re_mod, store_mod = mods["connector"], mods["worker"], mods["routed_experts"], mods["store"]
        nbytes = PROFILE.block_nbytes(BLOCK)
        self.store = store_mod.BackgroundBlockObjectStore(
            store_mod.BlockObjectStore(max_bytes=STORE_OBJECTS * nbytes, object_nbytes=nbytes),
            max_pending_batches=2 * MAX_SEQS,
        )
        arena = self.store._store._arena  # steady state: fault the arena in (untimed), as for auxout
        arena.write(bytes(len(arena)))
        arena.seek(0)
        self.sched = conn.AuxOutputSchedulerConnector()
        w = object.__new__(worker_mod.AuxOutputWorkerConnector)
        w._capturer = None
        w._store = self.store
        w._buffer = re_mod.RoutedExpertsBuffer(
            PROFILE.dtype, PROFILE.shape_per_token, BLOCK, MAX_SEQS, MAX_BATCHED, 1
        )
        w._requests = {}
        w._generation = 0
        w._step_metadata = None
        w._pending_outputs = []
        w._lock = threading.Lock()
        w._max_concurrent_batches = 1
        self.worker = w
        self.pending_cls = worker_mod.PendingAuxOutput

    def step(self, st: Step, rows: np.ndarray, live: dict[str, Req], admitted: list[Req]) -> Any:
        w = self.worker
        w.begin_step(self.sched.build_connector_meta(st.sched_out, live))
        # AuxOutputWorkerConnector.prepare_output minus the GPU snapshot ...
        pending = self.pending_cls(
            connector=w, request_ids=list(st.rids), token_starts=st.starts,
            query_start_loc=st.qsl, routed_experts_gpu=None,
        )
        with w._lock:
            assert len(w._pending_outputs) < w._max_concurrent_batches
            w._pending_outputs.append(pending)
            for rid in pending.request_ids:
                w._requests[rid].pending_outputs += 1
        # ... and PendingAuxOutput.enqueue_cpu_copy with the host rows filled in directly.
        pending.num_sampled = st.sampled
        pending.num_rejected = st.rejected
        pending.routed_experts = rows
        return w.process_output(pending)

    def emit(self, out: Any, emitters: list[Req], finished: list[Req], chunked: list[Req]) -> None:
        take = self.sched.take_output
        for r in emitters:
            chunk = take(r, out)
            if r.chunks is not None and chunk is not None:
                r.chunks.append(chunk)
        _join_finished(finished)
        for r in finished:
            self.sched.request_finished(r)

    def drain(self, live: dict[str, Req]) -> None:
        self.worker.begin_step(self.sched.build_connector_meta(SchedOut({}), live))
        self.store._queue.join()

    def flush(self) -> None:
        self.store._queue.join()

    def close(self) -> None:
        self.worker.close()

    def check(self) -> str | None:
        err = self.store._error
        return f"writer failed: {err!r}" if err is not None else None


@dataclass
class RunResult:
    seconds: float
    mismatches: list[str] = field(default_factory=list)
    note: str | None = None
    check_seconds: float = 0.0  # of ``seconds``, the row check's (auxout drivers)


def replay(wl: Workload, make: Callable[[], Driver], verify: bool) -> RunResult:
    reqs = [Req(sp) for sp in wl.specs]
    drv = make()
    live: dict[str, Req] = {}
    total = 0.0
    perf = CLOCK[0]
    gc.collect()
    gc.disable()
    try:
        for k, st in enumerate(wl.steps):
            if k == wl.t_start:
                drv.flush()  # warm-up publications land before the clock starts
                CHECK_SECONDS[0] = 0.0
            # engine side (untimed): admission and this step's captured rows
            admitted = [reqs[i] for i in st.admit]
            for r in admitted:
                live[r.request_id] = r
            rows = np.concatenate(
                [reqs[i].spec.rows[s : s + n] for i, s, n in zip(st.sched, st.starts.tolist(), st.counts)]
            )
            t0 = perf()
            out = drv.step(st, rows, live, admitted)
            t1 = perf()
            emitters = [reqs[i] for i in st.emitters]
            for r in emitters:  # the engine appends the sampled token; hashes follow full blocks
                r.num_tokens += 1
                r.num_output_tokens += 1
                nb = r.num_tokens // BLOCK
                if nb > len(r.block_hashes):
                    r.block_hashes.extend(r.spec.hashes[len(r.block_hashes) : nb])
            finished = [reqs[i] for i in st.finished]
            for r in finished:
                r.finished = True
            t2 = perf()
            drv.emit(out, emitters, finished, [reqs[i] for i in st.chunked])
            t3 = perf()
            for r in finished:
                del live[r.request_id]
            if k >= wl.t_start:
                total += (t1 - t0) + (t3 - t2)
        t0 = perf()
        drv.drain(live)  # deliver the last terminal events; wait for the writer thread
        total += perf() - t0
    finally:
        gc.enable()
    note = drv.check()
    drv.close()
    res = RunResult(total, note=note, check_seconds=CHECK_SECONDS[0])
    if verify:
        for r in reqs:
            if r.chunks is None or r.num_output_tokens == 0:
                continue
            want = r.spec.rows[0 : r.num_tokens - 1]
            got = r.joined if r.joined is not None else join_rows(r.chunks) if r.chunks else PROFILE.empty(0)
            if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
                res.mismatches.append(f"{r.request_id}: got {got.shape}, want {want.shape}")
    return res


# -- reporting ----------------------------------------------------------------------------------
@dataclass
class Measured:
    times: list[float]
    mismatches: list[str]
    verified: int
    notes: list[str]
    check_times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def measure(wl: Workload, drivers: list[tuple[str, Callable[[], Driver]]], repeats: int) -> dict[str, Measured]:
    out = {name: Measured([], [], 0, []) for name, _ in drivers}
    for rep in range(repeats):
        for name, make in drivers:  # interleaved so noise hits both alike
            res = replay(wl, make, verify=rep == 0)
            m = out[name]
            m.times.append(res.seconds)
            m.check_times.append(res.check_seconds)
            m.mismatches += res.mismatches
            if rep == 0:
                m.verified = sum(1 for sp in wl.specs if sp.verify)
            if res.note:
                m.notes.append(res.note)
    return out


def report(wl: Workload, res: dict[str, Measured]) -> list[tuple[str, bool]]:
    steps = wl.timed_steps
    n = len(steps)
    tokens = sum(sum(s.counts) for s in steps)
    out_bytes = sum(s.out_rows for s in steps) * TOKEN_NBYTES
    in_bytes = tokens * TOKEN_NBYTES
    handled = out_bytes  # route bytes returned to requests (= captured bytes unless a prefix is reused)
    print(
        f"\n== {wl.name}: {n} timed steps, {tokens:,} tokens computed, "
        f"{in_bytes / 1e6:,.1f} MB captured, {out_bytes / 1e6:,.1f} MB returned"
    )
    a = res["auxout"]
    for name, m in res.items():
        t = m.median
        spread = f"[{min(m.times) * 1e3:.1f}..{max(m.times) * 1e3:.1f} ms over {len(m.times)}]"
        print(
            f"  {name:<13} {t / n * 1e6:10.1f} us/step {t / tokens * 1e9:9.1f} ns/token "
            f"{handled / t / 1e6:10.1f} MB/s   total {t * 1e3:8.1f} ms {spread}"
        )
        status = "OK" if not m.mismatches else f"MISMATCH ({len(m.mismatches)}): {m.mismatches[:3]}"
        print(f"          verified {m.verified} requests bit-for-bit: {status}" + "".join(f"; NOTE {x}" for x in m.notes))
    checks: list[tuple[str, bool]] = [(f"{wl.name}: auxout outputs equal the rows fed in", not a.mismatches)]
    # the row check (every step's rows, for ids no router can produce), inside auxout's step
    shares = sorted(c / t for c, t in zip(a.check_times, a.times))
    share = statistics.median(shares)
    print(
        f"  row check     {statistics.median(a.check_times) / n * 1e6:10.1f} us/step: {100 * share:.2f}% of auxout's "
        f"connector cost (included in it; per repeat {100 * shares[0]:.2f}..{100 * shares[-1]:.2f}%)"
    )
    checks.append((f"{wl.name}: row check < {100 * MAX_CHECK_SHARE:.0f}% of the connector's cost", share < MAX_CHECK_SHARE))
    unchecked = res.get("auxout-unchecked")
    if unchecked is not None:
        print(f"  paired ratio auxout/auxout-unchecked {_paired(a, unchecked)}")
    bridge = res.get("auxout-bridge")
    if bridge is not None:
        checks.append((f"{wl.name}: auxout-bridge outputs equal the rows fed in", not bridge.mismatches))
    v = res.get("vLLM")
    if v is not None:
        ratio = a.median / v.median
        print(f"  ratio auxout/vLLM cost {ratio:.3f}   speed-up vLLM/auxout {1 / ratio:.2f}x")
        print(f"  paired ratio auxout/vLLM {_paired(a, v)}")
        for other in ("auxout-sync", "auxout-bridge", "auxout-unchecked"):
            o = res.get(other)
            if o is not None:
                print(f"  ratio {other}/vLLM cost {o.median / v.median:.3f}   paired {_paired(o, v)}")
    target = MAX_COST_RATIO.get(wl.name)
    if wl.name == "prefill":
        print(f"  prefill route bytes: {handled / a.median / 1e9:.2f} GB/s")
    if target is not None:
        if v is None:
            print(f"  target {wl.name} cost <= {target:.2f} x vLLM: n/a (no vLLM)")
        else:
            ratio = a.median / v.median
            ok = ratio <= target
            print(f"  target {wl.name} cost <= {target:.2f} x vLLM: {ratio:.3f} {'PASS' if ok else 'MISS'}")
            checks.append((f"{wl.name} cost <= {target:.2f} x vLLM", ok))
    return checks


def _paired(x: Measured, base: Measured) -> str:
    """Median, 95% bootstrap interval and range of the per-repeat ratios: each repeat runs both
    back to back, so a slow phase of a shared machine (seen as 2x swings of absolute times within
    one run) hits both."""
    r = sorted(a / b for a, b in zip(x.times, base.times))
    lo, hi = bootstrap_median_ci(r)
    return f"{statistics.median(r):.3f} [95% CI {lo:.3f}..{hi:.3f}; range {r[0]:.3f}..{r[-1]:.3f}]"


def load_vllm() -> dict[str, Any] | None:
    base = "vllm.distributed.aux_output_connector"
    t = time.perf_counter()
    try:
        mods = {m: importlib.import_module(f"{base}.{m}") for m in ("connector", "routed_experts", "store", "worker")}
    except Exception as exc:  # noqa: BLE001 - any import failure means "run auxout alone"
        print(f"NOTE: vLLM's in-tree aux-output connector is unavailable ({type(exc).__name__}: {exc}); "
              "running auxout alone")
        return None
    print(f"vLLM aux_output_connector imported in {time.perf_counter() - t:.1f} s (not part of any measurement)")
    return mods


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="small sizes, ~20 s")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per workload (median reported)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline")
    ap.add_argument("--only", choices=WORKLOADS, action="append")
    ap.add_argument("--sync-store", action="store_true", help="also run auxout without the writer thread")
    ap.add_argument("--thread-time", action="store_true", help="time the step thread's CPU time, not wall time")
    ap.add_argument("--time-join", action="store_true", help="also time each request's hand-over join (both drivers)")
    ap.add_argument("--bridge", action="store_true", help="also run auxout as its vLLM bridge drives it (HeldRows, take_step)")
    ap.add_argument("--unchecked", action="store_true", help="also run auxout without the row check")
    args = ap.parse_args(argv)
    JOIN[0] = args.time_join
    if args.thread_time:
        CLOCK[0] = time.thread_time
    repeats = args.repeats or (2 if args.quick else 5)
    t_all = time.perf_counter()
    print(
        f"auxout data-plane benchmark: profile {PROFILE.num_layers}x{PROFILE.top_k} {PROFILE.dtype} "
        f"({TOKEN_NBYTES} B/token), hash block {BLOCK}, max_num_seqs {MAX_SEQS}, "
        f"max_num_batched_tokens {MAX_BATCHED}, store {STORE_OBJECTS} objects, repeats {repeats}"
        f"{' (quick)' if args.quick else ''}"
    )
    mods = None if args.no_vllm else load_vllm()
    drivers: list[tuple[str, Callable[[], Driver]]] = [("auxout", AuxoutDriver)]
    if args.sync_store:
        drivers.append(("auxout-sync", AuxoutSyncDriver))
    if args.bridge:
        drivers.append(("auxout-bridge", AuxoutBridgeDriver))
    if args.unchecked:
        drivers.append(("auxout-unchecked", AuxoutUncheckedDriver))
    if mods is not None:
        drivers.append(("vLLM", lambda: VllmDriver(mods)))

    rng = np.random.default_rng(20261129)
    checks: list[tuple[str, bool]] = []
    for name in WORKLOADS:
        if args.only and name not in args.only:
            continue
        t = time.perf_counter()
        wl = build_workload(name, rng, quick=args.quick)
        t_build = time.perf_counter() - t
        res = measure(wl, drivers, repeats)
        checks += report(wl, res)
        print(f"  (workload built in {t_build:.1f} s, measured in {time.perf_counter() - t - t_build:.1f} s)")
    print("\n== summary")
    for what, ok in checks:
        print(f"  {'PASS' if ok else 'MISS' if 'outputs' not in what else 'FAIL'}  {what}")
    print(f"total wall time {time.perf_counter() - t_all:.1f} s")
    return 1 if any(not ok for what, ok in checks if "outputs" in what) else 0


if __name__ == "__main__":
    sys.exit(main())
