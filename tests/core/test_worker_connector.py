"""WorkerConnector: contract checks (§4) and the data-plane behaviours of the vLLM test catalogue (§5.1).

Rows come from ``FakeMoE`` (causal), so a row served for the wrong position or from a rejected
draft differs from the oracle; every emitted chunk is compared with the oracle bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pytest
from fake_requests import Req, h
from hypothesis import given, settings
from hypothesis import strategies as hs

from auxout.connector.messages import StepMetadata, StepOutput
from auxout.connector.scheduler import SchedulerConnector
from auxout.connector.worker import _LANE_DRAIN_EVERY, PendingStep, WorkerConnector
from auxout.errors import InvariantError, ObjectMissingError, PoolExhaustedError, RoutesUnavailableError
from auxout.keys import KeySpace, PackedHashes
from auxout.profile import RouteProfile
from auxout.stores import ArenaStore, BackgroundStore
from auxout.stores.rows import StoreRows, join_rows
from auxout.testing import FakeMoE

PROF = RouteProfile(num_layers=3, top_k=2, num_experts=16)
BS = 4
OBJ = PROF.block_nbytes(BS)
MODEL = FakeMoE(num_layers=3, top_k=2, num_experts=16, vocab_size=100, seed=11)
KS = KeySpace()
assert MODEL.profile == PROF


def key(i: int, generation: int = 0) -> str:
    return KS.keys([h(i)], generation)[0]


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 100, n).tolist()


def oracle(seed: int, n: int = 24) -> np.ndarray:
    """Routes of a full forward over ``tokens(seed, n)``."""
    return MODEL.routes(tokens(seed, n))


def junk(n: int, seed: int = 999) -> np.ndarray:
    """Rows of rejected drafts: (almost surely) different from any oracle row."""
    return MODEL.routes(tokens(seed, 64))[-n:]


class SpyStore:
    """Wraps a store and records every call (payloads are passed through untouched)."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.object_nbytes = inner.object_nbytes
        self.gets: list[list[str]] = []
        self.puts: list[tuple[list[str], list[str], list[str]]] = []
        self.closed = 0

    def put(self, objects: Sequence, *, retain: Iterable[str] = (), release: Iterable[str] = ()) -> None:
        retain, release = list(retain), list(release)
        self.puts.append(([k for k, _ in objects], retain, release))
        self.inner.put(objects, retain=retain, release=release)

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        self.gets.append(list(keys))
        return self.inner.get_concatenated(keys)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.contains(keys)

    def close(self) -> None:
        self.closed += 1
        self.inner.close()

    def references(self, k: str) -> int:
        return self.inner.references(k)


class RowsSpyStore(SpyStore):
    """A ``SpyStore`` that also hands out rows uncopied (``ArenaStore.read_rows``)."""

    def read_rows(self, keys: Sequence[str], dtype: np.dtype, shape: tuple[int, ...]) -> StoreRows | None:
        self.gets.append(list(keys))
        return self.inner.read_rows(keys, dtype, shape)  # type: ignore[no-any-return]


def make(
    capacity: int = 64,
    *,
    mcb: int = 1,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 32,
    store=None,  # type: ignore[no-untyped-def]
    rows: bool = False,
) -> tuple[WorkerConnector, SpyStore]:
    """A worker on a spied store (``rows``: prefix reads left in the arena, as the engine's default store)."""
    spy = (RowsSpyStore if rows else SpyStore)(store if store is not None else ArenaStore(capacity * OBJ, OBJ))
    w = WorkerConnector(
        PROF,
        block_size=BS,
        store=spy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_concurrent_batches=mcb,
    )
    return w, spy


def meta(
    requests: dict[str, int] | None = None,
    hashes: dict[str, list[int]] | None = None,
    finished: Sequence[str] = (),
    generation: int = 0,
) -> StepMetadata:
    packed = {rid: PackedHashes.pack([h(i) for i in ids]) for rid, ids in (hashes or {}).items()}
    return StepMetadata(generation, dict(requests or {}), packed, tuple(finished))


def prepare(w: WorkerConnector, batch: Sequence[tuple[str, int, np.ndarray]]) -> PendingStep:
    qsl = [0]
    for _, _, rows in batch:
        qsl.append(qsl[-1] + len(rows))
    rows = np.concatenate([b[2] for b in batch]) if batch else PROF.empty(0)
    p = w.prepare_output([b[0] for b in batch], [b[1] for b in batch], qsl, rows)
    assert p is not None
    return p


def run(
    w: WorkerConnector,
    m: StepMetadata,
    batch: Sequence[tuple[str, int, np.ndarray]],
    sampled: Sequence[int],
    rejected: Sequence[int] | None = None,
) -> StepOutput:
    w.begin_step(m)
    return w.process_output(prepare(w, batch), sampled, rejected)


def assert_emits(out: StepOutput, rid: str, start: int, expected: np.ndarray) -> np.ndarray:
    got = out.rows_for(rid)
    assert got is not None, f"{rid} emitted nothing"
    assert got[0] == start, f"{rid}: token_start {got[0]} != {start}"
    rows = got[1]
    assert rows.dtype == PROF.dtype and rows.shape == expected.shape, (rows.shape, expected.shape)
    assert np.array_equal(rows, expected), f"{rid}: rows differ from the oracle"
    return rows


def stored(spy: SpyStore, *keys: str) -> bytes:
    return spy.inner.get_concatenated(list(keys))


# == contract checks (§4) ============================================================================


def test_finish_and_restart_in_one_step_starts_a_new_incarnation() -> None:
    """A restart (recompute) ends one incarnation and starts the next in the same step."""
    w, spy = make()
    t = oracle(1)
    out = run(w, meta({"a": 0}, {"a": [1]}), [("a", 0, t[:6])], [0])
    assert_emits(out, "a", 0, t[:6])
    m = StepMetadata(0, {"a": 4}, {"a": PackedHashes.pack([h(1)])}, ("a",), {})
    out = run(w, m, [("a", 4, t[4:7])], [1])  # new incarnation: capture restarts at a block boundary
    assert_emits(out, "a", 4, t[4:7])
    assert stored(spy, key(1)) == t[:4].tobytes()
    assert w.tracked_requests() == ["a"]


def test_rejects_generation_moving_backwards() -> None:
    w, spy = make()
    w.begin_step(meta(generation=1))
    with pytest.raises(InvariantError, match="generation moved backwards: 0 < 1"):
        w.begin_step(meta({"a": 0}, generation=0))
    assert w.generation == 1 and w.tracked_requests() == []
    t = oracle(2)
    out = run(w, meta({"a": 0}, {"a": [1]}, generation=1), [("a", 0, t[:4])], [1])
    assert_emits(out, "a", 0, t[:4])
    assert spy.contains([key(1, 1), key(1, 0)]) == [True, False]


def test_generation_change_with_output_in_flight_voids_that_output() -> None:
    """Async scheduling: a prefix-cache reset while a step is in flight (vLLM drops its output)."""
    w, spy = make(mcb=2)
    t = oracle(3)
    run(w, meta({"a": 0}, {"a": [1]}), [("a", 0, t[:4])], [0])
    w.begin_step(meta({"a": 0}))
    p = prepare(w, [("a", 4, t[4:6])])  # in flight when the reset arrives
    assert spy.references(key(1)) == 1
    w.begin_step(meta(generation=1))
    assert w.generation == 1 and w.tracked_requests() == []
    out = w.process_output(p, [1])  # voided: nothing emitted, published or torn down twice
    assert out.rows_for("a") is None and w.num_inflight == 0
    assert spy.references(key(1)) == 0
    assert w.pool.num_free == w.pool.num_blocks
    t2 = oracle(4)  # the next generation works from a clean state
    out = run(w, meta({"b": 0}, {"b": [2]}, generation=1), [("b", 0, t2[:5])], [1])
    assert_emits(out, "b", 0, t2[:5])
    assert stored(spy, key(1)) == t[:4].tobytes()  # the object ages out LRU, it is not deleted


def test_rejects_scheduler_emit_cursor_ahead() -> None:
    w, _ = make()
    w.begin_step(meta({"a": 0}))
    with pytest.raises(
        InvariantError, match=r"emit cursor moved ahead .*'a'.*emit_start=1, worker emitted up to 0"
    ):
        w.begin_step(meta({"a": 1}))
    t = oracle(4)
    out = run(w, meta({"a": 0}), [("a", 0, t[:3])], [1])
    assert_emits(out, "a", 0, t[:3])


def test_emit_start_is_not_checked_while_output_in_flight() -> None:
    w, _ = make(mcb=2)
    t = oracle(5)
    w.begin_step(meta({"a": 0}))
    p1 = prepare(w, [("a", 0, t[:4])])
    w.begin_step(meta({"a": 4}))  # built optimistically before step 1 was processed: allowed
    p2 = prepare(w, [("a", 4, t[4:5])])
    assert_emits(w.process_output(p1, [1]), "a", 0, t[:4])
    assert_emits(w.process_output(p2, [1]), "a", 4, t[4:5])


def test_rejects_outputs_not_consumed_in_order() -> None:
    w, _ = make(mcb=1)
    t = oracle(6)
    w.begin_step(meta({"a": 0}))
    p1 = prepare(w, [("a", 0, t[:4])])
    w.begin_step(meta({}))
    with pytest.raises(
        InvariantError, match="not consumed in order: 1 unprocessed, limit max_concurrent_batches=1"
    ):
        w.prepare_output(["a"], [4], [0, 1], t[4:5])
    assert w.num_inflight == 1
    assert_emits(w.process_output(p1, [1]), "a", 0, t[:4])
    assert w.num_inflight == 0


def test_rejects_processing_out_of_order() -> None:
    w, _ = make(mcb=2)
    t = oracle(7)
    w.begin_step(meta({"a": 0}))
    p1 = prepare(w, [("a", 0, t[:4])])
    w.begin_step(meta({"a": 0}))
    p2 = prepare(w, [("a", 4, t[4:5])])
    with pytest.raises(InvariantError, match="processed in the order they were prepared"):
        w.process_output(p2, [1])
    assert w.num_inflight == 2
    assert_emits(w.process_output(p1, [1]), "a", 0, t[:4])
    assert_emits(w.process_output(p2, [1]), "a", 4, t[4:5])


@pytest.mark.parametrize("rejected", [-1, 5])
def test_rejects_invalid_rejected_count(rejected: int) -> None:
    w, _ = make()
    t = oracle(8)
    w.begin_step(meta({"a": 0}))
    p = prepare(w, [("a", 0, t[:4])])
    with pytest.raises(
        InvariantError, match=f"rejected-token count {rejected} is invalid for request 'a' which executed 4"
    ):
        w.process_output(p, [1], [rejected])
    assert w.num_inflight == 0
    out = run(w, meta({"a": 0}), [("a", 0, t[:4])], [1], [0])  # the state was not advanced
    assert_emits(out, "a", 0, t[:4])


def test_rejects_wrong_count_lengths() -> None:
    w, _ = make()
    t = oracle(9)
    w.begin_step(meta({"a": 0}))
    p = prepare(w, [("a", 0, t[:4])])
    with pytest.raises(InvariantError, match="needs 1 sampled and rejected counts"):
        w.process_output(p, [])
    assert w.num_inflight == 0


def test_rejects_zero_token_request() -> None:
    w, _ = make()
    a, b = oracle(10), oracle(11)
    w.begin_step(meta({"a": 0, "b": 0}))
    p = w.prepare_output(["a", "b"], [0, 0], [0, 0, 3], b[:3])
    assert p is not None
    with pytest.raises(InvariantError, match="request 'a' executed 0 tokens; must be positive"):
        w.process_output(p, [0, 1])
    assert w.num_inflight == 0
    out = run(w, meta({"a": 0, "b": 0}), [("a", 0, a[:2]), ("b", 0, b[:3])], [1, 1])
    assert_emits(out, "a", 0, a[:2])
    assert_emits(out, "b", 0, b[:3])


@pytest.mark.parametrize(
    "rows",
    [
        pytest.param(np.zeros((2, 3, 3), dtype=np.uint8), id="shape"),
        pytest.param(np.zeros((2, 3, 2), dtype=np.int32), id="dtype"),
        pytest.param(np.zeros((2, 6), dtype=np.uint8), id="flat"),
    ],
)
def test_rejects_changed_capture_profile(rows: np.ndarray) -> None:
    w, _ = make()
    w.begin_step(meta({"a": 0}))
    with pytest.raises(InvariantError, match=r"captured rows profile changed: got .* expected uint8\[3, 2\]"):
        w.prepare_output(["a"], [0], [0, 2], rows)
    assert w.num_inflight == 0
    t = oracle(12)
    assert_emits(run(w, meta({"a": 0}), [("a", 0, t[:2])], [1]), "a", 0, t[:2])


def test_rejects_step_claiming_more_rows_than_snapshot() -> None:
    w, _ = make()
    w.begin_step(meta({"a": 0}))
    with pytest.raises(InvariantError, match="claims 5 rows but the snapshot has 4"):
        w.prepare_output(["a"], [0], [0, 5], oracle(13)[:4])
    assert w.num_inflight == 0


def test_rejects_unannounced_and_untracked_requests() -> None:
    w, _ = make()
    w.begin_step(meta({"a": 0}))
    with pytest.raises(InvariantError, match="'ghost' executed but was never announced"):
        w.prepare_output(["ghost"], [0], [0, 1], oracle(14)[:1])
    assert w.num_inflight == 0
    with pytest.raises(
        InvariantError, match="block hashes for request 'ghost' which the worker does not track"
    ):
        w.begin_step(meta({}, {"ghost": [1]}))
    with pytest.raises(InvariantError, match="terminal event for request 'ghost'"):
        w.begin_step(meta({}, finished=("ghost",)))


def _broken_then_restarted(w: WorkerConnector, p: PendingStep, why: str, restart: list[tuple[str, int, np.ndarray]], emit: int) -> None:
    """A step with a request whose capture cannot continue: that request alone gets an error
    and emits nothing (in this step and later ones of its incarnation); request 'b' in the same
    batch commits as usual; once the engine restarts 'a', its new incarnation captures again."""
    t_b = oracle(40)
    out = w.process_output(p, [1, 1])
    assert set(out.errors) == {"a"} and why in out.errors["a"], out.errors
    assert out.rows_for("a") is None
    assert_emits(out, "b", 0, t_b[:3])
    later = run(w, meta({"a": 0, "b": 0}), [("a", restart[0][1], restart[0][2]), ("b", 3, t_b[3:4])], [1, 1])
    assert later.rows_for("a") is None and not later.errors, "reported once per incarnation"
    assert_emits(later, "b", 3, t_b[3:4])
    rows = restart[0][2]
    out = run(w, meta({"a": emit}, finished=("a",)), restart, [1])
    assert not out.errors
    assert_emits(out, "a", emit, rows[emit - restart[0][1] :])


def test_capture_moving_backwards_fails_that_request_alone() -> None:
    w, _ = make()
    t = oracle(15)
    run(w, meta({"a": 4}, {"a": [1]}), [("a", 4, t[4:7])], [0])  # resumes at a cached block boundary
    w.begin_step(meta({"a": 4, "b": 0}))
    p = prepare(w, [("a", 6, t[6:8]), ("b", 0, oracle(40)[:3])])
    _broken_then_restarted(w, p, "capture moved backwards: step starts at 6, rows up to 7", [("a", 0, t[:6])], 0)


def test_unbacked_capture_gap_fails_that_request_alone() -> None:
    w, _ = make()
    t = oracle(16)
    assert_emits(run(w, meta({"a": 0}), [("a", 0, t[:1])], [1]), "a", 0, t[:1])
    w.begin_step(meta({"a": 1, "b": 0}))
    p = prepare(w, [("a", 2, t[2:3]), ("b", 0, oracle(40)[:3])])
    why = "unbacked token gap: step starts at 2, capture cursor 1"
    _broken_then_restarted(w, p, why, [("a", 0, t[:3])], 1)


def test_unaligned_first_capture_fails_that_request_alone() -> None:
    """A first capture off a hash-block boundary (a KV hit that ends inside a block) would stage
    rows of a block whose head no one holds: that request recomputes instead of the engine dying."""
    w, _ = make()
    t = oracle(17)
    w.begin_step(meta({"a": 3, "b": 0}))
    p = prepare(w, [("a", 3, t[3:5]), ("b", 0, oracle(40)[:3])])
    why = "capture is not contiguous: first rows start at 3, not a multiple of the hash block size 4"
    _broken_then_restarted(w, p, why, [("a", 0, t[:5])], 3)


def test_pool_exhaustion_fails_closed() -> None:
    w, _ = make(max_num_seqs=1, max_num_batched_tokens=4, mcb=1)
    assert w.pool.num_blocks == 4
    t = oracle(18)
    w.begin_step(meta({"a": 0}))  # no hashes: all five full blocks must wait in the pool
    p = prepare(w, [("a", 0, t[:20])])
    with pytest.raises(
        PoolExhaustedError, match="staging pool is exhausted: need 5 block slots, 4 of 4 free"
    ) as ei:
        w.process_output(p, [0])
    assert isinstance(ei.value, InvariantError)
    assert w.pool.num_free == 4 and w.num_inflight == 0


def test_closed_connector_rejects_calls_and_closes_store_once() -> None:
    w, spy = make()
    w.close()
    w.close()
    assert spy.closed == 1
    with pytest.raises(InvariantError, match="worker connector is closed"):
        w.begin_step(meta({"a": 0}))
    with pytest.raises(InvariantError, match="closed"):
        w.prepare_output([], [], [0], PROF.empty(0))


def test_constructor_rejects_store_smaller_than_a_block() -> None:
    with pytest.raises(ValueError, match="smaller than one hash block"):
        WorkerConnector(
            PROF, block_size=BS, store=ArenaStore(OBJ, OBJ - 1), max_num_seqs=1, max_num_batched_tokens=4
        )
    with pytest.raises(ValueError, match="block_size"):
        WorkerConnector(
            PROF, block_size=0, store=ArenaStore(OBJ, OBJ), max_num_seqs=1, max_num_batched_tokens=4
        )


# == data plane (§5.1) =============================================================================


def test_publishes_blocks_and_reuses_prefix() -> None:
    w, spy = make()
    first = tokens(20, 8)
    t1 = MODEL.routes(first)
    out = run(w, meta({"first": 0}, {"first": [1, 2]}), [("first", 0, t1)], [1])
    assert_emits(out, "first", 0, t1)
    assert stored(spy, key(1), key(2)) == t1.tobytes()
    w.begin_step(meta(finished=("first",)))
    assert spy.references(key(1)) == 0 and spy.references(key(2)) == 0
    second = first + [5, 6]
    t2 = MODEL.routes(second)
    out = run(w, meta({"second": 0}, {"second": [1, 2]}), [("second", 8, t2[8:10])], [1])
    assert_emits(out, "second", 0, t2)
    assert spy.gets == [[key(1), key(2)]]  # the first 8 rows came from the store


def test_publishes_entire_batch_before_materializing() -> None:
    w, spy = make()
    toks = tokens(21, 10)
    t = MODEL.routes(toks)
    m = meta({"consumer": 0, "producer": 0}, {"consumer": [1, 2], "producer": [1, 2]})
    out = run(w, m, [("consumer", 8, t[8:10]), ("producer", 0, t[:8])], [1, 1])
    assert_emits(out, "consumer", 0, t)
    assert_emits(out, "producer", 0, t[:8])
    assert spy.gets == [[key(1), key(2)]]


def test_defers_full_block_until_hash_arrives() -> None:
    w, spy = make()
    t = oracle(22)
    total = w.pool.num_blocks
    assert_emits(run(w, meta({"a": 0}), [("a", 0, t[:4])], [1]), "a", 0, t[:4])
    assert spy.contains([key(1)]) == [False]
    assert w.pool.num_free == total - 1  # the unkeyed block waits in the pool
    out = run(w, meta({"a": 4}, {"a": [1]}), [("a", 4, t[4:5])], [1])
    assert_emits(out, "a", 4, t[4:5])
    assert stored(spy, key(1)) == t[:4].tobytes()
    assert w.pool.num_free == total - 1  # staged block freed, the new tail holds one slot
    assert spy.references(key(1)) == 1


def test_hash_only_metadata_publishes_pending_block_without_forward() -> None:
    w, spy = make()
    t = oracle(23)
    total = w.pool.num_blocks
    run(w, meta({"a": 0}), [("a", 0, t[:8])], [1])
    assert spy.contains([key(1), key(2)]) == [False, False]
    w.begin_step(meta({}, {"a": [1]}))  # one hash arrives, nothing scheduled
    assert spy.contains([key(1), key(2)]) == [True, False]
    w.begin_step(meta({}, {"a": [2]}))
    assert stored(spy, key(1), key(2)) == t[:8].tobytes()
    assert w.pool.num_free == total
    assert spy.references(key(1)) == 1 and spy.references(key(2)) == 1


def test_terminal_event_publishes_hash_discovered_after_last_schedule() -> None:
    w, spy = make()
    t = oracle(24)
    sc = SchedulerConnector()
    r = Req("a", 4)
    w.begin_step(sc.build_metadata(["a"], {"a": r}))
    assert_emits(w.process_output(prepare(w, [("a", 0, t[:4])]), [1]), "a", 0, t[:4])
    r.num_tokens, r.num_output_tokens, r.block_hashes = 5, 1, [h(1)]
    sc.request_finished(r)
    m = sc.build_metadata([], {})
    assert m.finished == ("a",) and list(m.final_hashes["a"]) == [h(1)]
    w.begin_step(m)
    assert stored(spy, key(1)) == t[:4].tobytes()
    assert w.tracked_requests() == [] and spy.references(key(1)) == 0
    assert w.pool.num_free == w.pool.num_blocks


@pytest.mark.parametrize("n_inflight", [1, 2])
def test_deferred_teardown_while_outputs_in_flight(n_inflight: int) -> None:
    w, spy = make(mcb=2)
    t = oracle(25)
    w.begin_step(meta({"a": 0}, {"a": [1]}))
    pending = [prepare(w, [("a", 0, t[:4])])]
    if n_inflight == 2:
        w.begin_step(meta({"a": 0}))
        pending.append(prepare(w, [("a", 4, t[4:6])]))
    w.begin_step(meta(finished=("a",)))
    assert w.tracked_requests() == []
    assert spy.references(key(1)) == 1, "keys stay pinned while an output covering the request is in flight"
    out1 = w.process_output(pending[0], [1])
    assert_emits(out1, "a", 0, t[:4])
    assert stored(spy, key(1)) == t[:4].tobytes()
    if n_inflight == 2:
        assert spy.references(key(1)) == 1
        out2 = w.process_output(pending[1], [1])
        assert_emits(out2, "a", 4, t[4:6])
    assert spy.references(key(1)) == 0
    assert w.pool.num_free == w.pool.num_blocks
    assert spy.contains([key(1)]) == [True]


def test_replays_rejected_speculative_gap() -> None:
    """§3.3: 5 tokens with 4 rejected → 1 row; start 5 with 3 of 4 rejected → re-attached at 1;
    start 6 with 3 rows → attached at 2, block 0 published; capture cursor ends at 5."""
    w, spy = make(mcb=2)
    t = oracle(26)
    j = junk(7)
    assert not any(np.array_equal(j[i], t[k]) for i in range(7) for k in range(6))
    w.begin_step(meta({"a": 0}))
    p1 = prepare(w, [("a", 0, np.concatenate([t[0:1], j[0:4]]))])
    w.begin_step(meta({"a": 0}))  # scheduled optimistically: all drafts assumed accepted
    p2 = prepare(w, [("a", 5, np.concatenate([t[1:2], j[4:7]]))])
    assert_emits(w.process_output(p1, [1], [4]), "a", 0, t[0:1])
    w.begin_step(meta({"a": 1}, {"a": [1]}))
    p3 = prepare(w, [("a", 6, t[2:5])])
    assert_emits(w.process_output(p2, [1], [3]), "a", 1, t[1:2])
    assert spy.contains([key(1)]) == [False]
    assert_emits(w.process_output(p3, [1], [0]), "a", 2, t[2:5])
    assert stored(spy, key(1)) == t[:4].tobytes()
    # the capture cursor is 5: the next step continues there, one that starts earlier is rejected
    out = run(w, meta({"a": 5}), [("a", 5, t[5:6])], [1])
    assert_emits(out, "a", 5, t[5:6])
    w.begin_step(meta({"a": 6}))
    p = prepare(w, [("a", 5, t[5:6])])
    out = w.process_output(p, [1])
    assert "capture moved backwards" in out.errors["a"] and out.rows_for("a") is None


def test_does_not_rematerialize_emitted_rows() -> None:
    w, spy = make(mcb=2)
    t = oracle(27)
    w.begin_step(meta({"a": 0}, {"a": [1]}))
    p1 = prepare(w, [("a", 0, t[:5])])
    w.begin_step(meta({"a": 0}))  # stale emit start from an async schedule
    p2 = prepare(w, [("a", 5, t[5:6])])
    assert_emits(w.process_output(p1, [1]), "a", 0, t[:5])
    assert_emits(w.process_output(p2, [1]), "a", 5, t[5:6])
    # settled now; a stale (lagging) emit start is still fine and nothing is re-emitted
    assert_emits(run(w, meta({"a": 0}), [("a", 6, t[6:7])], [1]), "a", 6, t[6:7])
    assert spy.gets == []


def test_resumes_from_scheduler_emit_boundary() -> None:
    w, spy = make()
    t = oracle(28)
    run(w, meta({"p": 0}, {"p": [1]}), [("p", 0, t[:4])], [1])  # another request cached block 0
    out = run(w, meta({"a": 4}, {"a": [1]}), [("a", 4, t[4:5])], [1])
    assert_emits(out, "a", 4, t[4:5])
    assert_emits(run(w, meta({"a": 5}), [("a", 5, t[5:6])], [1]), "a", 5, t[5:6])
    assert spy.gets == []


def test_resumed_request_recomputes_without_emitting_returned_rows() -> None:
    w, spy = make()
    t = oracle(29)
    out = run(w, meta({"a": 6}, {"a": [1]}), [("a", 0, t[:7])], [1])  # recompute after preemption
    assert_emits(out, "a", 6, t[6:7])
    assert stored(spy, key(1)) == t[:4].tobytes()
    assert spy.gets == []


def test_emits_mid_block_chunked_prefill() -> None:
    w, _ = make()
    t = oracle(30)
    out = run(w, meta({"a": 0}), [("a", 0, t[:2])], [0])
    assert_emits(out, "a", 0, t[:2])  # rows go out as soon as they are captured
    out = run(w, meta({"a": 0}), [("a", 2, t[2:3])], [1])
    assert_emits(out, "a", 2, t[2:3])


def test_emits_published_block_and_mid_block_tail() -> None:
    w, spy = make()
    t = oracle(31)
    out = run(w, meta({"a": 0}, {"a": [1]}), [("a", 0, t[:6])], [0])
    assert_emits(out, "a", 0, t[:6])
    assert stored(spy, key(1)) == t[:4].tobytes()
    out = run(w, meta({"a": 0}), [("a", 6, t[6:7])], [1])
    assert_emits(out, "a", 6, t[6:7])
    assert spy.gets == [], "a request's own rows are never read back from the store"


def test_chunked_prefill_across_unkeyed_staged_blocks() -> None:
    w, spy = make()
    t = oracle(32)
    out = run(w, meta({"a": 0}), [("a", 0, t[:6])], [0])  # block 0 staged (no hash), rows 4..5 in the tail
    assert_emits(out, "a", 0, t[:6])
    out = run(w, meta({"a": 0}), [("a", 6, t[6:9])], [0])  # completes block 1 (staged), opens a tail at 8
    assert_emits(out, "a", 6, t[6:9])
    out = run(w, meta({"a": 0}), [("a", 9, t[9:10])], [1])
    assert_emits(out, "a", 9, t[9:10])
    assert spy.gets == []


def test_output_does_not_alias_released_tail_buffer() -> None:
    w, _ = make()
    ta, tb = oracle(33), oracle(34)
    first = assert_emits(run(w, meta({"a": 0}), [("a", 0, ta[:2])], [0]), "a", 0, ta[:2])
    out = run(w, meta({"a": 0}), [("a", 2, ta[2:3])], [1])
    rows_a = np.concatenate([first, assert_emits(out, "a", 2, ta[2:3])])
    assert not np.shares_memory(first, w.pool.blocks)
    w.begin_step(meta(finished=("a",)))
    run(w, meta({"b": 0}), [("b", 0, tb[:3])], [0])  # reuses the freed tail slot
    run(w, meta({"b": 0}), [("b", 3, tb[3:7])], [0])
    assert np.array_equal(rows_a, ta[:3])


def test_matches_kv_eviction_order_after_requests_finish() -> None:
    w, spy = make(capacity=3)
    plan = {"s": [0], "ab": [1, 2], "c": [3], "d": [4]}
    for n, (rid, ids) in enumerate(plan.items()):
        t = oracle(40 + n)
        k = BS * len(ids)
        assert_emits(run(w, meta({rid: 0}, {rid: ids}), [(rid, 0, t[:k])], [1]), rid, 0, t[:k])
        w.begin_step(meta(finished=(rid,)))
    assert spy.contains([key(i) for i in range(5)]) == [False, True, False, True, True]
    with pytest.raises(ObjectMissingError) as ei:
        spy.inner.get_concatenated([key(1), key(2)])
    assert ei.value.keys == [key(2)]
    assert stored(spy, key(1)) == oracle(41)[:4].tobytes()
    assert w.dropped_batches == 0


def test_missing_cached_prefix_fails_only_that_request() -> None:
    w, spy = make()
    sc = SchedulerConnector()
    th, tok = oracle(50), oracle(51)
    hit, ok = Req("hit", 10, 0, [h(1), h(2)]), Req("ok", 3)
    live = {"hit": hit, "ok": ok}
    w.begin_step(sc.build_metadata(["hit", "ok"], live))
    out = w.process_output(prepare(w, [("hit", 8, th[8:10]), ("ok", 0, tok[:3])]), [1, 1])
    assert out.rows_for("hit") is None
    err = out.errors["hit"]
    assert "ObjectMissingError" in err and key(1) in err and "max_bytes" in err
    hit.num_tokens, hit.num_output_tokens = 11, 1
    ok.num_tokens, ok.num_output_tokens = 4, 1
    with pytest.raises(RoutesUnavailableError, match="'hit'") as ei:
        sc.take_output(out, hit)
    assert key(1) in ei.value.reason
    got = sc.take_output(out, ok)
    assert got is not None and np.array_equal(got, tok[:3])
    # the engine keeps serving: the failed request is dropped, the other one decodes on
    sc.request_finished(hit)
    del live["hit"]
    w.begin_step(sc.build_metadata(["ok"], live))
    assert w.tracked_requests() == ["ok"]
    assert spy.references(key(1)) == 0 and spy.references(key(2)) == 0
    out = w.process_output(prepare(w, [("ok", 3, tok[3:4])]), [1])
    ok.num_tokens, ok.num_output_tokens = 5, 2
    got = sc.take_output(out, ok)
    assert got is not None and np.array_equal(got, tok[3:4])


def test_releases_terminal_pins_before_same_step_publish() -> None:
    w, spy = make(capacity=1)
    tv, tp = oracle(60), oracle(61)
    out = run(w, meta({"v": 0, "p": 0}, {"v": [1]}), [("v", 0, tv[:4]), ("p", 0, tp[:4])], [1, 1])
    assert_emits(out, "v", 0, tv[:4])
    assert_emits(out, "p", 0, tp[:4])
    assert spy.references(key(1)) == 1 and spy.contains([key(1)]) == [True]
    w.begin_step(meta({}, {"p": [2]}, finished=("v",)))  # v's release and p's publish in one put
    assert spy.contains([key(1), key(2)]) == [False, True]
    assert stored(spy, key(2)) == tp[:4].tobytes()
    assert w.dropped_batches == 0


def test_capacity_rejected_publication_is_dropped_and_reads_fail_closed() -> None:
    w, spy = make(capacity=1)
    t = oracle(62)
    out = run(w, meta({"a": 0}, {"a": [1, 2]}), [("a", 0, t[:8])], [1])
    assert_emits(out, "a", 0, t[:8])  # rows of this step are still emitted
    assert w.dropped_batches == 1
    assert spy.contains([key(1), key(2)]) == [False, False]
    out = run(w, meta({"b": 0}, {"b": [1, 2]}), [("b", 8, t[8:9])], [1])
    assert out.rows_for("b") is None and "missing from the store" in out.errors["b"]


@pytest.mark.parametrize("chunk", [2, 4])
@pytest.mark.parametrize("max_tokens", [1, 2])
def test_prompt_start_equal_to_prompt_length(chunk: int, max_tokens: int) -> None:
    w, _ = make()
    sc = SchedulerConnector()
    t = oracle(63)
    sc.add_request("r", prompt_len=4, prompt_start=4)
    r = Req("r", 4, 0, [h(1)])
    for start in range(0, 4, chunk):
        m = sc.build_metadata(["r"], {"r": r})
        assert m.requests == {"r": 4}
        w.begin_step(m)
        samples = start + chunk == 4
        out = w.process_output(prepare(w, [("r", start, t[start : start + chunk])]), [int(samples)])
        if not samples:
            assert out.rows_for("r") is None
    r.num_tokens, r.num_output_tokens = 5, 1
    first = sc.take_output(out, r, finished=max_tokens == 1)
    assert first is not None and first.shape == (0, 3, 2) and first.dtype == PROF.dtype
    if max_tokens == 2:
        m = sc.build_metadata(["r"], {"r": r})
        assert m.requests == {"r": 4}
        w.begin_step(m)
        out = w.process_output(prepare(w, [("r", 4, t[4:5])]), [1])
        r.num_tokens, r.num_output_tokens = 6, 2
        second = sc.take_output(out, r, finished=True)
        assert second is not None and np.array_equal(second, t[4:5])
    sc.request_finished(r)
    w.begin_step(sc.build_metadata([], {}))
    assert w.tracked_requests() == []


def test_ignores_cuda_graph_padding_entries() -> None:
    w, _ = make()
    ta, tb = oracle(64), oracle(65)
    w.begin_step(meta({"a": 0, "b": 0}))
    rows = np.concatenate([ta[:1], tb[:1], junk(2)])  # padded snapshot
    p = w.prepare_output(["a", "b"], np.array([0, 0, 0, 0]), np.array([0, 1, 2, 2, 2]), rows)
    assert p is not None
    out = w.process_output(p, np.array([1, 1, 0]), np.array([0, 0, 0]))
    assert_emits(out, "a", 0, ta[:1])
    assert_emits(out, "b", 0, tb[:1])


def test_internal_warmup_step_produces_no_output() -> None:
    w, spy = make()
    w.begin_step(None)
    assert w.prepare_output(["x"], [0], [0, 1], junk(1)) is None
    assert w.num_inflight == 0 and w.tracked_requests() == []
    t = oracle(66)
    assert_emits(run(w, meta({"a": 0}), [("a", 0, t[:3])], [1]), "a", 0, t[:3])
    w.begin_step(None)  # a dummy run between real steps
    assert w.prepare_output(["a"], [3], [0, 1], t[3:4]) is None
    assert w.num_inflight == 0
    assert_emits(run(w, meta({"a": 3}), [("a", 3, t[3:4])], [1]), "a", 3, t[3:4])
    assert spy.puts == []


def test_re_announced_request_gets_a_fresh_incarnation() -> None:
    w, spy = make(mcb=2)
    t = oracle(67)
    w.begin_step(meta({"a": 0}, {"a": [1]}))
    p1 = prepare(w, [("a", 0, t[:4])])
    w.begin_step(meta(finished=("a",)))  # preempted while step 1 is in flight
    w.begin_step(meta({"a": 4}, {"a": [1]}))  # resumed at once: a new incarnation
    assert w.tracked_requests() == ["a"]
    p2 = prepare(w, [("a", 0, t[:5])])  # recompute from 0; rows before 4 were already returned
    assert_emits(w.process_output(p1, [1]), "a", 0, t[:4])
    assert spy.references(key(1)) == 1  # the old incarnation released its pin, the new one holds one
    assert w.tracked_requests() == ["a"]
    assert_emits(w.process_output(p2, [1]), "a", 4, t[4:5])
    assert stored(spy, key(1)) == t[:4].tobytes()
    assert_emits(run(w, meta({"a": 5}), [("a", 5, t[5:6])], [1]), "a", 5, t[5:6])
    w.begin_step(meta(finished=("a",)))
    assert spy.references(key(1)) == 0 and w.tracked_requests() == []
    assert w.pool.num_free == w.pool.num_blocks


def test_generation_bump_uses_new_namespace() -> None:
    w, spy = make()
    t = oracle(68)
    run(w, meta({"a": 0}, {"a": [1]}), [("a", 0, t[:5])], [1])
    w.begin_step(meta({}, generation=1))
    assert spy.references(key(1)) == 0 and w.tracked_requests() == []
    # a surviving request is re-announced with all hashes; its old routes are never served
    out = run(w, meta({"b": 0}, {"b": [1]}, generation=1), [("b", 4, t[4:6])], [1])
    assert out.rows_for("b") is None and key(1, 1) in out.errors["b"]
    assert spy.contains([key(1, 0), key(1, 1)]) == [True, False]


def test_many_requests_grow_slot_arrays() -> None:
    w, spy = make(max_num_seqs=2, max_num_batched_tokens=64)
    n = 20  # more live requests than the initial slot arrays hold
    ids = [f"r{i}" for i in range(n)]
    ts = [oracle(100 + i) for i in range(n)]
    hashes = {r: [10 * i + 1, 10 * i + 2] for i, r in enumerate(ids)}
    out = run(w, meta(dict.fromkeys(ids, 0), hashes), [(r, 0, t[:4]) for r, t in zip(ids, ts)], [1] * n)
    for r, t in zip(ids, ts):
        assert_emits(out, r, 0, t[:4])
    out = run(w, meta({r: 4 for r in ids}), [(r, 4, t[4:8]) for r, t in zip(ids, ts)], [1] * n)
    for i, (r, t) in enumerate(zip(ids, ts)):
        assert_emits(out, r, 4, t[4:8])
        assert stored(spy, key(10 * i + 1), key(10 * i + 2)) == t[:8].tobytes()
    assert sorted(w.tracked_requests()) == sorted(ids)


def test_request_slots_run_held_back_writes_before_any_cursor_access() -> None:
    """A decode lane holds cursor and tail-row writes back (``SlotTable.defer_writes``): every
    access to the cursors or tails runs them first, and freeing a slot with writes held fails."""
    from auxout.connector.slot_table import SlotTable

    table = SlotTable(4, block_size=BS)
    s = table.new("a", 0)
    flushed: list[int] = []

    def flush() -> None:
        flushed.append(s)
        table.cursors[s] = (7, 7, 7)  # (the flush itself reads the cursors: nothing left to run)

    for access in ("capture", "sched", "emit", "tail", "cursors"):
        table.defer_writes(flush)
        getattr(table, access)
    assert flushed == [s] * 5
    assert table.capture[s] == table.sched[s] == table.emit[s] == 7
    table.defer_writes(flush)
    with pytest.raises(AssertionError, match="leave it before freeing"):
        table.free([s])


def test_background_store_end_to_end_prefix_reuse() -> None:
    bg = BackgroundStore(ArenaStore(16 * OBJ, OBJ), max_pending=4)
    w = WorkerConnector(PROF, block_size=BS, store=bg, max_num_seqs=4, max_num_batched_tokens=32)
    t = oracle(69)
    assert_emits(run(w, meta({"a": 0}, {"a": [1, 2]}), [("a", 0, t[:9])], [1]), "a", 0, t[:9])
    w.begin_step(meta(finished=("a",)))
    out = run(w, meta({"b": 0}, {"b": [1, 2]}), [("b", 8, t[8:10])], [1])
    assert_emits(out, "b", 0, t[:10])
    w.close()
    with pytest.raises(Exception, match="closed"):
        bg.get_concatenated([key(1)])


def test_prefix_hit_with_prompt_start_inside_cached_prefix() -> None:
    w, spy = make()
    t = oracle(70)
    run(w, meta({"p": 0}, {"p": [1, 2]}), [("p", 0, t[:8])], [0])
    out = run(w, meta({"a": 2}, {"a": [1, 2]}), [("a", 8, t[8:10])], [1])
    assert_emits(out, "a", 2, t[2:10])
    assert spy.gets == [[key(1), key(2)]]
    out = run(w, meta({"b": 6}, {"b": [1, 2]}), [("b", 8, t[8:9])], [1])
    assert_emits(out, "b", 6, t[6:9])
    assert spy.gets[-1] == [key(2)]  # only the block holding rows 6..7 is read


def test_opted_out_request_publishes_but_never_emits() -> None:
    w, spy = make()
    sc = SchedulerConnector()
    sc.add_request("r", prompt_len=8, return_routes=False)
    t = oracle(71)
    r = Req("r", 8, 0, [h(1), h(2)])
    w.begin_step(sc.build_metadata(["r"], {"r": r}))
    out = w.process_output(prepare(w, [("r", 0, t[:8])]), [1])
    assert out.rows_for("r") is None and out.errors == {}
    r.num_tokens, r.num_output_tokens = 9, 1
    assert sc.take_output(out, r) is None
    assert stored(spy, key(1), key(2)) == t[:8].tobytes()  # still reusable by other requests


def test_non_contiguous_snapshot_is_handled() -> None:
    w, spy = make()
    t = oracle(72)
    fortran = np.asfortranarray(t[:6])
    assert not fortran.flags.c_contiguous
    w.begin_step(meta({"a": 0}, {"a": [1]}))
    p = w.prepare_output(["a"], [0], [0, 6], fortran)
    assert p is not None
    assert_emits(w.process_output(p, [1]), "a", 0, t[:6])
    assert stored(spy, key(1)) == t[:4].tobytes()


def test_empty_step_and_non_sampling_step() -> None:
    w, _ = make()
    w.begin_step(meta({}))
    p = w.prepare_output([], [], [0], PROF.empty(0))
    assert p is not None
    out = w.process_output(p, [])
    assert out.req_ids == [] and len(out.rows) == 0
    t = oracle(73)
    out = run(w, meta({"a": 0}), [("a", 0, t[:3])], [0])
    assert_emits(out, "a", 0, t[:3])  # a step that samples nothing still returns its rows


def test_rejected_metadata_creates_no_state_for_other_requests() -> None:
    w, spy = make()
    w.begin_step(meta({"a": 0}))
    with pytest.raises(InvariantError, match="emit cursor moved ahead .*'a'"):
        w.begin_step(meta({"b": 0, "a": 2}, {"b": [1]}))
    assert w.tracked_requests() == ["a"] and spy.puts == []
    t = oracle(74)
    out = run(w, meta({"b": 0, "a": 0}, {"b": [1]}), [("b", 0, t[:4]), ("a", 0, t[:2])], [1, 1])
    assert_emits(out, "b", 0, t[:4])
    assert_emits(out, "a", 0, t[:2])


def test_output_buffers_are_reused_only_without_live_views() -> None:
    from auxout.connector.store_io import BufferRecycler

    prof = RouteProfile(3, 2, 40)  # a shape no other test uses: its pool starts empty here
    a_pool, b_pool = BufferRecycler(prof), BufferRecycler(prof)
    held = a_pool.take(1500)
    capacity = len(held.base) if held.base is not None else 0  # (no `.base` inside asserts: pytest keeps those)
    assert capacity == 2048, "sizes round up to a power of two"
    held[:] = 7
    other = b_pool.take(1000)  # the pool is shared per process and shape, and `held` is alive
    assert not np.shares_memory(held, other)
    other[:] = 9
    assert (held == 7).all(), "a buffer with a live view was handed out again"
    base_id = id(held.base)  # not a reference: holding the base would keep it busy
    del held, other
    again = b_pool.take(2000)
    assert id(again.base) == base_id, "a buffer without live views is reused (warm pages, no faults)"


def test_generation_change_tears_down_requests_finished_with_output_in_flight() -> None:
    """A request that finished while its output was in flight, then a reset voids that output:
    its pins are released with the reset (nothing else would release them)."""
    w, spy = make(mcb=2)
    t = oracle(5)
    w.begin_step(meta({"a": 0}, {"a": [1, 2]}))
    p = prepare(w, [("a", 0, t[:6])])  # in flight
    w.begin_step(meta(finished=("a",)))  # teardown deferred: the output is still in flight
    assert spy.references(key(1)) == 1 and spy.references(key(2)) == 1
    w.begin_step(meta(generation=1))
    out = w.process_output(p, [1])
    assert out.rows_for("a") is None and w.num_inflight == 0
    assert spy.references(key(1)) == 0 and spy.references(key(2)) == 0
    assert w.pool.num_free == w.pool.num_blocks
    t2 = oracle(6)  # and the slot is reusable
    out = run(w, meta({"b": 0}, {"b": [3]}, generation=1), [("b", 0, t2[:5])], [1])
    assert_emits(out, "b", 0, t2[:5])


def _publish_chain(w: WorkerConnector, rid: str, ids: list[int], t: np.ndarray) -> None:
    """Run one request over ``len(ids)`` whole blocks of ``t`` and finish it: its blocks are stored."""
    k = BS * len(ids)
    assert_emits(run(w, meta({rid: 0}, {rid: ids}), [(rid, 0, t[:k])], [1]), rid, 0, t[:k])
    w.begin_step(meta(finished=(rid,)))


@pytest.mark.parametrize("uncopied", [False, True])
def test_prefix_hits_of_a_step_are_read_together_and_own_rows_stay_in_the_snapshot(uncopied: bool) -> None:
    w, spy = make(rows=uncopied)
    t0, t1 = oracle(80), oracle(81)
    _publish_chain(w, "p0", [1, 2], t0)
    _publish_chain(w, "p1", [3, 4], t1)
    spy.gets.clear()
    # x and y hit whole stored blocks; z emits from mid-block (prompt_start 2) over x's prefix
    m = meta({"x": 0, "y": 0, "z": 2}, {"x": [1, 2], "y": [3, 4], "z": [1, 2]})
    out = run(w, m, [("x", 8, t0[8:11]), ("y", 8, t1[8:10]), ("z", 8, t0[8:9])], [1, 1, 1])
    assert_emits(out, "x", 0, t0[:11])
    assert_emits(out, "y", 0, t1[:10])
    assert_emits(out, "z", 2, t0[2:9])
    assert spy.gets[0] == [key(1), key(2), key(3), key(4)]  # one store read for both whole heads
    assert len(spy.gets) == 2  # and one for z's
    for rid in ("x", "y", "z"):
        _, lo, hi = out.span_map()[rid]
        head, own = out.span_rows(rid, lo, hi)
        assert np.shares_memory(own, out.rows)  # own rows are not copied
        # whole heads stay in the store's arena when it can leave them there (copied once, when joined)
        assert isinstance(head, StoreRows) == (uncopied and rid != "z")


def test_uncopied_prefix_rows_stay_exact_after_their_request_ends_and_the_store_evicts_them() -> None:
    """Rows handed out uncopied outlive their pins: the store must not reuse their slots."""
    w, spy = make(capacity=6, rows=True, max_num_seqs=8)
    t0 = oracle(84)
    _publish_chain(w, "p0", [1, 2], t0)
    out = run(w, meta({"x": 0}, {"x": [1, 2]}), [("x", 8, t0[8:10])], [1])
    _, lo, hi = out.span_map()["x"]
    parts = out.span_rows("x", lo, hi)
    assert isinstance(parts, list) and isinstance(parts[0], StoreRows)
    held = parts[0]  # an engine holds this until the request finishes (or longer, preempted)
    del out, parts
    w.begin_step(meta(finished=["x"]))  # x's pins go: keys 1 and 2 are now evictable
    for n in range(3):  # 3 more chains of 2 blocks into the 6-slot store: the oldest (x's) go first
        _publish_chain(w, f"f{n}", [10 + 2 * n, 11 + 2 * n], oracle(90 + n))
    assert spy.inner.contains([key(1), key(2)]) == [False, False]  # evicted (else the test proves nothing)
    assert np.array_equal(join_rows([held]), t0[:8])
    assert len(spy.inner._index.quarantine) == 2  # their slots wait for the reader
    assert np.array_equal(stored(spy, key(14), key(15)), oracle(92)[:8].tobytes())  # the newest took other slots
    del held
    _publish_chain(w, "after", [70, 71], oracle(95))
    assert not spy.inner._index.quarantine  # reused once nobody reads them


def test_a_failed_batched_prefix_read_fails_only_the_request_whose_blocks_are_gone() -> None:
    w, spy = make()
    t0, t1 = oracle(82), oracle(83)
    _publish_chain(w, "p0", [1, 2], t0)
    m = meta({"x": 0, "y": 0}, {"x": [1, 2], "y": [5, 6]})  # y's blocks were never stored
    out = run(w, m, [("x", 8, t0[8:10]), ("y", 8, t1[8:10])], [1, 1])
    assert_emits(out, "x", 0, t0[:10])
    assert out.rows_for("y") is None
    assert "ObjectMissingError" in out.errors["y"] and key(5) in out.errors["y"] and "x" not in out.errors


def _pins_seen(spy: SpyStore, k: str) -> tuple[int, int]:
    """How often ``k`` was retained and released, over every put so far."""
    return sum(p[1].count(k) for p in spy.puts), sum(p[2].count(k) for p in spy.puts)


@pytest.mark.parametrize("heirs", [1, 2])
def test_a_next_turn_admitted_as_its_previous_turn_ends_takes_over_its_pins(heirs: int) -> None:
    w, spy = make(max_num_batched_tokens=64)
    t = oracle(84, 48)
    hist = list(range(1, 9))  # 8 blocks: long enough for the worker to reuse the chain's keys
    assert_emits(run(w, meta({"t1": 0}, {"t1": hist}), [("t1", 0, t[:32])], [1]), "t1", 0, t[:32])
    assert [spy.references(key(i)) for i in hist] == [1] * 8
    before = [_pins_seen(spy, key(i)) for i in hist]
    # t1 ends in the step that admits the next turn(s) over the same history
    nxt = {f"t2{c}": 0 for c in "ab"[:heirs]}
    out = run(
        w, meta(nxt, {r: hist + [9] for r in nxt}, finished=("t1",)),
        [(r, 32, t[32:36]) for r in nxt], [1] * heirs,
    )  # fmt: skip
    for r in nxt:
        assert_emits(out, r, 0, t[:36])
    after = [_pins_seen(spy, key(i)) for i in hist]
    # the first heir inherits t1's pins: no retain/release pair on the history; a second retains its own
    assert [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)] == [(heirs - 1, 0)] * 8
    assert [spy.references(key(i)) for i in hist] == [heirs] * 8
    w.begin_step(meta(finished=tuple(nxt)))
    assert [spy.references(key(i)) for i in hist + [9]] == [0] * 9
    # released tail-first, as without the hand-over: the chain's tail is the least recently used
    assert spy.inner.stored_keys[:9] == [key(i) for i in range(9, 0, -1)]


@pytest.mark.parametrize("meta_order", [("a", "b"), ("b", "a")])
def test_lane_checks_the_scheduler_emit_starts_in_any_metadata_order(meta_order: tuple[str, str]) -> None:
    """In the decode lane begin_step compares the emit starts with plain lists: same verdicts."""
    t = {"a": oracle(23), "b": oracle(24)}
    lead = {"a": 0, "b": 3}  # b prefills 4 rows in the first step: the two stay 3 positions apart
    w, _ = make()
    steps = 2 * BS + 2
    for k in range(steps):
        pos = {r: 0 if k == 0 else k + lead[r] for r in "ab"}
        n = {r: 1 + lead[r] if k == 0 else 1 for r in "ab"}
        done = {r: [{"a": 100, "b": 200}[r] + (pos[r] + n[r]) // BS] for r in "ab" if (pos[r] + n[r]) % BS < n[r]}
        w.begin_step(meta({r: pos[r] for r in meta_order}, done))
        rows = np.concatenate([t[r][pos[r] : pos[r] + n[r]] for r in "ab"])
        p = w.prepare_output(["a", "b"], [pos["a"], pos["b"]], [0, n["a"], n["a"] + n["b"]], rows)
        assert p is not None
        out = w.process_output(p, [1, 1])
        for r in "ab":
            assert_emits(out, r, pos[r], t[r][pos[r] : pos[r] + n[r]])
    assert w.lane_stats.steps > 0 and w.lane_stats.begins >= w.lane_stats.steps - 1
    nxt = {r: steps + lead[r] for r in meta_order}
    ahead = dict(nxt, b=nxt["b"] + 1)
    with pytest.raises(InvariantError, match=rf"emit cursor moved ahead .*'b'.*emit_start={nxt['b'] + 1}"):
        w.begin_step(meta(ahead))
    w.begin_step(meta(dict(nxt, a=nxt["a"] - 1)))  # behind the worker's cursor (rows re-sent): allowed


def test_lane_reports_the_store_lost_keys_within_a_few_steps() -> None:
    """A lane step asks the store for lost keys only every few steps (and when it publishes):
    a key the store lost between publications still reaches the scheduler, a few steps late."""

    class LossyStore(SpyStore):
        def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
            super().__init__(inner)
            self.lost: list[str] = []
            self.drains = 0

        def drain_lost(self) -> list[str]:
            self.drains += 1
            out, self.lost = self.lost, []
            return out

    bs = 32  # (an engine's block: a lane publishes, and so drains, only every 32 steps per request)
    store = LossyStore(ArenaStore(8 * PROF.block_nbytes(bs), PROF.block_nbytes(bs)))
    w = WorkerConnector(PROF, block_size=bs, store=store, max_num_seqs=4, max_num_batched_tokens=64)
    t = {"a": oracle(25, 64), "b": oracle(26, 64)}
    reported: list[tuple[int, list[str]]] = []
    steps = 60
    for k in range(steps):
        if k == bs + 2:
            store.lost.append("gone")  # e.g. the writer dropped a batch, or another engine evicted it
        done = {r: [{"a": 100, "b": 200}[r] + (k + 1) // bs] for r in "ab"} if (k + 1) % bs == 0 else None
        w.begin_step(meta({"a": k, "b": k}, done))
        p = w.prepare_output(["a", "b"], [k, k], [0, 1, 2], np.concatenate([t[r][k : k + 1] for r in "ab"]))
        assert p is not None
        out = w.process_output(p)
        if out.lost:
            reported.append((k, out.lost))
    assert w.lane_stats.steps > bs
    assert reported and reported[0][1] == ["gone"] and len(reported) == 1
    assert reported[0][0] - (bs + 2) <= _LANE_DRAIN_EVERY, reported  # a few steps late at most
    assert store.drains < steps // 2  # (most lane steps did not call the store)


def test_lane_rows_written_late_reach_the_store_when_the_batch_changes_mid_block() -> None:
    """Lane steps put their rows into the staging pool only when a tail fills or the lane ends:
    a batch that changes mid-block (b finishes) must not lose a's rows of that block."""
    t = {"a": oracle(27), "b": oracle(28)}
    w, spy = make()
    for k in range(2 * BS):
        live = "ab" if k < BS + 2 else "a"
        finished = ("b",) if k == BS + 2 else ()
        done = {r: [{"a": 100, "b": 200}[r] + k // BS] for r in live if (k + 1) % BS == 0}
        w.begin_step(meta({r: k for r in live}, done, finished))
        rows = np.concatenate([t[r][k : k + 1] for r in live])
        p = w.prepare_output(list(live), [k] * len(live), list(range(len(live) + 1)), rows)
        assert p is not None
        out = w.process_output(p)
        for r in live:
            assert_emits(out, r, k, t[r][k : k + 1])
    assert w.lane_stats.steps >= 3  # the lane ran (a mid-block stretch of it included), and was left
    assert stored(spy, key(100), key(101)) == t["a"][: 2 * BS].tobytes()


# == a steady decode step's output, predicted before the connector runs (peek_lane_step) =============
def _peeked_step(
    w: WorkerConnector, m: StepMetadata, batch: Sequence[tuple[str, int, np.ndarray]]
) -> tuple[StepOutput | None, StepOutput]:
    """``peek_lane_step``, then the three calls an engine makes: (what was predicted, what they returned)."""
    qsl = [0]
    for _, _, rows in batch:
        qsl.append(qsl[-1] + len(rows))
    rows = np.concatenate([b[2] for b in batch]) if batch else PROF.empty(0)
    ids, starts = [b[0] for b in batch], [b[1] for b in batch]
    peek = w.peek_lane_step(m, list(ids), list(starts), list(qsl), rows)
    w.begin_step(m)
    p = w.prepare_output(ids, starts, qsl, rows)
    assert p is not None
    return peek, w.process_output(p)


_sched_op = hs.sampled_from(["decode"] * 14 + ["add", "add", "finish", "stall"])


def _random_decode_schedule(
    ops: list[str], seed: int, route_seed: int
) -> Iterator[tuple[StepMetadata, list[tuple[str, int, np.ndarray]]]]:
    """Steps of a random engine schedule (metadata and ``(rid, start, rows)`` batch, maybe empty):
    requests join with a prefill, finish, or sit a step out; blocks fill and their hashes arrive."""
    rng = np.random.default_rng(seed)
    routes: dict[str, np.ndarray] = {}
    pos: dict[str, int] = {}  # live requests: tokens computed
    nhash: dict[str, int] = {}
    order: list[str] = []
    for k, op in enumerate(["add", "add", *ops]):  # (two requests to start with)
        finished: tuple[str, ...] = ()
        batch_ids = list(order)
        if op == "add" and len(order) < 3:
            rid = f"r{k}"
            routes[rid], pos[rid], nhash[rid] = oracle(route_seed + k, 160), 0, 0
            order.append(rid)
            batch_ids = list(order)
        elif op == "finish" and order:
            gone = order.pop(int(rng.integers(len(order))))
            finished, batch_ids = (gone,), list(order)
        elif op == "stall" and len(order) > 1:
            batch_ids = [r for r in order if r != order[int(rng.integers(len(order)))]]
        n = {r: (int(rng.integers(1, 7)) if pos[r] == 0 else 1) for r in batch_ids}
        batch_ids = [r for r in batch_ids if pos[r] + n[r] <= len(routes[r])]
        hashes = {}
        for r in batch_ids:
            done = (pos[r] + n[r]) // BS
            if done > nhash[r]:
                hashes[r] = [int(r[1:]) * 1000 + b for b in range(nhash[r], done)]
                nhash[r] = done
        yield meta({r: pos[r] for r in batch_ids}, hashes, finished), [
            (r, pos[r], routes[r][pos[r] : pos[r] + n[r]]) for r in batch_ids
        ]
        for r in batch_ids:
            pos[r] += n[r]




@settings(max_examples=150, deadline=None)
@given(hs.lists(_sched_op, min_size=1, max_size=90), hs.integers(0, 2**16))
def test_a_peeked_lane_step_is_what_the_connector_then_returns(ops: list[str], seed: int) -> None:
    """Whenever ``peek_lane_step`` predicts an output, the real calls return exactly it (same spans,
    starts and rows), and peeking changes nothing: a second worker that never peeks emits and
    stores the same. Random batches: requests join with a prefill, finish, or sit a step out."""
    peeker, spy_p = make(capacity=256, max_num_seqs=4)
    plain, spy_q = make(capacity=256, max_num_seqs=4)
    hits = 0
    for m, batch in _random_decode_schedule(ops, seed, 1000):
        if not batch:  # (nothing scheduled: the engine makes no connector call but the metadata's)
            peeker.begin_step(m)
            plain.begin_step(m)
            continue
        peek, out = _peeked_step(peeker, m, batch)
        plain.begin_step(m)
        ref = plain.process_output(prepare(plain, batch))
        for r, start, rows in batch:
            assert_emits(out, r, start, rows)
            assert_emits(ref, r, start, rows)
        if peek is not None:
            hits += 1
            assert out.lo is peek.lo and out.hi is peek.hi and out.rows is peek.rows
            assert out.token_starts.tolist() == peek.token_starts.tolist() == [b[1] for b in batch]
            assert out.one_row_starts == peek.one_row_starts and out.req_ids == peek.req_ids
            assert not out.errors and not out.heads and out.weights is None
            assert peek.published == [] and peek.lost == []
    assert spy_p.puts == spy_q.puts  # (peeking never moved the connector: same publications and pins)
    if hits:  # (a prediction was checked above: the lane ran)
        assert peeker.lane_stats.steps >= hits


def _same_output(a: StepOutput, b: StepOutput) -> None:
    assert a.req_ids == b.req_ids and a.rows is b.rows and a.one_row_starts == b.one_row_starts
    for name in ("token_starts", "lo", "hi"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert (a.published, a.lost, a.errors, a.heads, a.weights) == (b.published, b.lost, b.errors, b.heads, b.weights)


@settings(max_examples=150, deadline=None)
@given(hs.lists(_sched_op, min_size=1, max_size=90), hs.integers(0, 2**16))
def test_a_fused_lane_step_equals_the_three_calls(ops: list[str], seed: int) -> None:
    """``commit_lane_step`` where it accepts a step, the three calls where it declines: every
    output equals that of a worker that always makes the three calls, and so do the store's puts
    and pins, step by step. Random batches: requests join with a prefill, finish, or sit a step
    out; blocks fill and their hashes arrive on the way."""
    fused, spy_f = make(capacity=256, max_num_seqs=4)
    plain, spy_p = make(capacity=256, max_num_seqs=4)
    for k, (m, batch) in enumerate(_random_decode_schedule(ops, seed, 2000)):
        if not batch:
            fused.begin_step(m)
            plain.begin_step(m)
            continue
        ids, starts = [b[0] for b in batch], [b[1] for b in batch]
        qsl = [0]
        for _, _, rows in batch:
            qsl.append(qsl[-1] + len(rows))
        rows = np.concatenate([b[2] for b in batch])
        out = fused.commit_lane_step(m, list(ids), list(starts), list(qsl), rows)
        if out is None:
            fused.begin_step(m)
            pf = fused.prepare_output(ids, starts, qsl, rows)
            assert pf is not None
            out = fused.process_output(pf)
        plain.begin_step(m)
        pp = plain.prepare_output(ids, starts, qsl, rows)
        assert pp is not None
        _same_output(out, plain.process_output(pp))
        for r, start, want in batch:
            assert_emits(out, r, start, want)
        assert spy_f.puts == spy_p.puts, k
    assert fused.lane_stats.steps == plain.lane_stats.steps
    assert fused.lane_stats.fused <= fused.lane_stats.steps and plain.lane_stats.fused == 0


def test_commit_lane_step_takes_the_steady_steps_and_declines_the_rest() -> None:
    """Two requests decoding: once the lane runs, every step is committed in one call, the steps
    whose block hashes arrive included (their blocks are published, as begin_step would); a
    terminal event is declined, with nothing done."""
    t = {"a": oracle(41, 64), "b": oracle(42, 64)}
    w, _ = make()
    taken = []
    for s in range(40):
        hashes = {r: [{"a": 100, "b": 200}[r] + (s + 1) // BS] for r in "ab"} if (s + 1) % BS == 0 else None
        m = meta({"a": s, "b": s}, hashes)
        rows = np.concatenate([t[r][s : s + 1] for r in "ab"])
        out = w.commit_lane_step(m, ["a", "b"], [s, s], [0, 1, 2], rows)
        taken.append(out is not None)
        if out is None:
            w.begin_step(m)
            p = w.prepare_output(["a", "b"], [s, s], [0, 1, 2], rows)
            assert p is not None
            out = w.process_output(p)
        for r in "ab":
            assert_emits(out, r, s, t[r][s : s + 1])
    assert not any(taken[:2]) and all(taken[3:]), taken
    assert w.lane_stats.fused == sum(taken)
    assert w.store.contains([k for r in "ab" for k in w._table.keys[w._table.slot_of[r]]]) == [True] * (2 * (40 // BS))
    s = 40
    rows = np.concatenate([t["a"][s : s + 1]])
    before = w.lane_stats.steps
    assert w.commit_lane_step(meta({"a": s}, None, ("b",)), ["a"], [s], [0, 1], rows) is None
    assert w.lane_stats.steps == before  # (declined: nothing moved)


def test_peek_predicts_the_steady_decode_steps_and_nothing_else() -> None:
    """Two requests decoding: after the lane starts every step is predicted, block fills included;
    a terminal event, a new generation or a different batch is not."""
    t = {"a": oracle(31, 64), "b": oracle(32, 64)}
    w, _ = make()
    predicted = []
    for s in range(40):
        hashes = {r: [{"a": 100, "b": 200}[r] + (s + 1) // BS] for r in "ab"} if (s + 1) % BS == 0 else None
        peek, out = _peeked_step(w, meta({"a": s, "b": s}, hashes), [(r, s, t[r][s : s + 1]) for r in "ab"])
        predicted.append(peek is not None)
        for r in "ab":
            assert_emits(out, r, s, t[r][s : s + 1])
    assert not any(predicted[:2]) and all(predicted[3:]), predicted  # (the lane opens at the third step)
    s = 40
    rows = np.concatenate([t[r][s : s + 1] for r in "ab"])
    assert w.peek_lane_step(meta({"a": s, "b": s}), ["a", "b"], [s, s], [0, 1, 2], rows) is not None
    assert w.peek_lane_step(meta({"a": s}, finished=("b",)), ["a"], [s], [0, 1], rows[:1]) is None
    assert w.peek_lane_step(meta({"a": s, "b": s}, generation=1), ["a", "b"], [s, s], [0, 1, 2], rows) is None
    assert w.peek_lane_step(meta({"b": s, "a": s}), ["b", "a"], [s, s], [0, 1, 2], rows) is None
    assert w.peek_lane_step(meta({"a": s, "b": s}), ["a", "b"], [s, s + 1], [0, 1, 2], rows) is None
    assert w.peek_lane_step(meta({"a": s, "b": s + 1}), ["a", "b"], [s, s], [0, 1, 2], rows) is None
    assert w.peek_lane_step(meta({"a": s, "b": s}), ["a", "b"], [s, s], [0, 1, 3], rows) is None
