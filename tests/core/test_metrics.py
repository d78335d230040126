"""Route counters: summed over processes exactly, exposed under vLLM-style names, counted where
the engine reads the store (hits, misses), recomputes a prefix, or refuses rows."""

from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from auxout import metrics
from auxout.metrics import COUNTERS, COUNTS, ENV_DIR, LAYOUT, SIZE, Counters, RouteMetricsCollector, totals
from auxout.stores import ArenaStore
from auxout.testing import FakeMoE, SimEngine, oracle_routes

KEYS = [(c.name, v) for c in COUNTERS for v in c.values]


def _adder(directory: str, plan: list[tuple[int, int]], threads: int) -> None:
    """A process (spawned) adding ``plan`` (key index, value) from ``threads`` threads at once."""
    import os

    os.environ[ENV_DIR] = directory
    counters = Counters()

    def run() -> None:
        for i, v in plan:
            name, labels = KEYS[i]
            counters.add(name, v, *labels)

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def test_counts_from_several_processes_and_threads_sum_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    ctx = mp.get_context("spawn")
    plans = [[(int(rng.integers(len(KEYS))), int(rng.integers(1, 1000))) for _ in range(400)] for _ in range(3)]
    procs = [ctx.Process(target=_adder, args=(str(tmp_path), plan, 4)) for plan in plans]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    expected = np.zeros(SIZE, dtype=np.int64)
    for plan in plans:
        for i, v in plan:
            expected[i] += 4 * v  # every thread ran the whole plan
    (tmp_path / f"auxout-{'0' * 12}-1-x.i64").write_bytes(np.full(SIZE, 7, np.int64).tobytes())  # another layout
    (tmp_path / f"auxout-{LAYOUT}-2-x.i64").write_bytes(b"\0" * 12)  # (torn: never summed)
    assert len(list(tmp_path.glob(f"auxout-{LAYOUT}-*.i64"))) == 4  # one file per process, and the torn one
    assert np.array_equal(totals(tmp_path), expected)

    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(RouteMetricsCollector(tmp_path, "tiny"))
    text = generate_latest(registry).decode()
    samples = scrape(text)
    want = {}
    for (name, labels), value in zip(KEYS, expected.tolist()):
        counter = next(c for c in COUNTERS if c.name == name)
        want[(f"vllm:auxout_{name}_total", frozenset({"model_name": "tiny", **dict(zip(counter.labels, labels))}.items()))] = value
    assert {k: v for k, v in samples.items() if k[0].startswith("vllm:auxout_")} == want
    assert "# TYPE vllm:auxout_store_misses_total counter" in text


def scrape(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text as ``{(sample name, labels): value}`` (prometheus_client's own parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


@given(st.lists(st.tuples(st.integers(0, len(KEYS) - 1), st.integers(-3, 10**9)), max_size=50))
def test_a_process_counts_what_it_was_given(adds: list[tuple[int, int]]) -> None:
    counters = Counters()
    model = dict.fromkeys(range(len(KEYS)), 0)
    for i, v in adds:
        name, labels = KEYS[i]
        counters.add(name, v, *labels)
        model[i] += max(v, 0)  # (a counter never goes down: non-positive adds are ignored)
    assert [counters.value(name, *labels) for name, labels in KEYS] == [model[i] for i in range(len(KEYS))]


def test_a_forked_child_writes_its_own_file(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    counters = Counters()
    counters.add("session_turns", 5)
    ctx = mp.get_context("fork")
    child = ctx.Process(target=counters.add, args=("session_turns", 7))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert counters.value("session_turns") == 5  # the parent's file was not written by the child
    assert len(list(tmp_path.glob("auxout-*.i64"))) == 2
    assert totals(tmp_path)[metrics._INDEX[("session_turns", ())]] == 12


def test_formats_match_the_wire() -> None:
    from auxout.wire import FORMATS

    assert metrics.FORMATS == FORMATS


MODEL = FakeMoE(num_layers=2, top_k=2, num_experts=8, vocab_size=100, seed=3)


def _exact(res) -> bool:  # type: ignore[no-untyped-def]
    return res.error is None and np.array_equal(res.routed_experts, oracle_routes(MODEL, res))


def test_engine_counts_store_hits_misses_and_recomputed_tokens() -> None:
    """A prefix hit's rows read back: hits; objects gone behind the scheduler's back: misses, and
    the recompute is counted as the scheduler counts it."""
    bs = 4
    arena = ArenaStore(64 * MODEL.profile.block_nbytes(bs), MODEL.profile.block_nbytes(bs))
    eng = SimEngine(MODEL, block_size=bs, num_kv_blocks=64, store=arena)
    prompt = np.random.default_rng(5).integers(0, 100, 16).tolist()
    eng.add_request("a", prompt, 2)
    assert _exact(eng.run()["a"])
    eng.store.flush()

    def snapshot() -> dict[str, int]:
        names = ("store_reads", "store_hits", "store_misses")
        return {**{n: COUNTS.value(n, "arena") for n in names},
                "recomputed": COUNTS.value("recomputed_prefix_tokens")}  # fmt: skip

    before = snapshot()
    eng.add_request("hit", prompt + [1, 2, 3], 3)  # the 4 prompt blocks hit; their rows are read back
    assert _exact(eng.run()["hit"])
    after = snapshot()
    assert after["store_reads"] - before["store_reads"] == 4
    assert after["store_hits"] - before["store_hits"] == 4
    assert after["store_misses"] == before["store_misses"]

    eng.store.flush()
    keys = arena.stored_keys
    arena.put([], retain=(), release=())
    for k in keys:
        arena._index.lru.pop(k)  # noqa: SLF001 - an eviction the worker never reported
    before, recomputed = snapshot(), eng.scheduler.recomputed_tokens
    eng.add_request("miss", prompt + [4, 5, 6], 3)
    assert _exact(eng.run()["miss"])
    after = snapshot()
    assert after["store_misses"] - before["store_misses"] >= 1
    assert after["store_reads"] - before["store_reads"] == (after["store_hits"] - before["store_hits"]) + (
        after["store_misses"] - before["store_misses"]
    )
    assert after["recomputed"] - before["recomputed"] == eng.scheduler.recomputed_tokens - recomputed > 0


@given(st.integers(1, 6), st.lists(st.integers(0, 20), min_size=1, max_size=40))
def test_evictions_are_counted_per_backend(capacity: int, writes: list[int]) -> None:
    """Every object the store's own LRU drops to make room is counted once, under its backend;
    a key written again while it is still stored is no new object (first write wins) but recent."""
    from auxout.stores import SharedMemoryStore

    nbytes = 8
    for backend, store in (("arena", ArenaStore(capacity * nbytes, nbytes)),
                           ("shm", SharedMemoryStore(capacity * nbytes, nbytes))):  # fmt: skip
        try:
            before = COUNTS.value("store_evictions", backend)
            held: list[str] = []  # the model: stored keys, least recently used first
            evicted = 0
            for w in writes:
                key = f"k{w}"
                store.put([(key, bytes([w]) * nbytes)])
                if key in held:  # already stored: first write wins, and it is used again
                    held.remove(key)
                    held.append(key)
                    continue
                held.append(key)
                if len(held) > capacity:
                    held.pop(0)
                    evicted += 1
            assert COUNTS.value("store_evictions", backend) - before == evicted
            assert COUNTS.value("store_evictions", "redis") == 0  # (server-side evictions are not auxout's)
        finally:
            store.close()
