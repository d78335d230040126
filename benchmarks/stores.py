"""Store throughput: auxout's backends beside the raw clients moving the same bytes.

    .venv/bin/python benchmarks/stores.py [--reps 7]

Workloads: 1,000 route blocks of 6 KiB (16 tokens x 48 layers x top-8 uint8), and one 32k-token
trajectory (2,048 such blocks = 12 MiB). Every backend runs in this one process against a
real redis-server and mooncake_master started on loopback. For Redis and Mooncake the raw
client does the same work (redis-py pipelined SET / MGET; Mooncake put_batch / get_batch) and
the table prints auxout's time over the raw client's (the overhead target is <= 10%). Each
cell is the median of ``--reps`` runs after one warm-up (raw and auxout runs alternate, and the
overhead is also shown for the best runs, since a shared 2-core machine is noisy); puts use
fresh keys every run (first write wins).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np

from auxout.manifest import RouteManifest, fetch
from auxout.stores.arena import ArenaStore
from auxout.stores.background import BackgroundStore
from auxout.stores.base import BlockStore
from auxout.stores.mooncake import MooncakeStore
from auxout.stores.redis import RedisStore
from auxout.stores.shm import SharedMemoryStore
from auxout.testing.servers import mooncake_master, redis_server

BLOCK, LAYERS, TOPK = 16, 48, 8
ONB = BLOCK * LAYERS * TOPK
WORKLOADS = {"1000 x 6KiB": 1000, "32k-token traj": 32768 // BLOCK}
SEG = 1536 * 2**20


def _median_s(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None) -> float:
    times = []
    for i in range(reps + 1):  # run 0 is a warm-up
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _objects(n: int, rng: np.random.Generator) -> tuple[list[str], np.ndarray]:
    prefix = f"auxout/r3/bench/g0/{uuid.uuid4().hex}/"
    return [f"{prefix}{i:05d}" for i in range(n)], rng.integers(0, 128, size=(n, ONB), dtype=np.uint8)


class Row:
    def __init__(self, backend: str, workload: str, op: str, seconds: float, nbytes: int, best: float = 0.0) -> None:
        self.backend, self.workload, self.op, self.seconds, self.nbytes = backend, workload, op, seconds, nbytes
        self.best = best or seconds
        self.cpu = 0.0  # client-process CPU seconds (median), paired runs only

    @property
    def mbps(self) -> float:
        return self.nbytes / self.seconds / 1e6


def bench_store(name: str, make: Callable[[], BlockStore], reps: int, rng: np.random.Generator,
                reader: Callable[[BlockStore], BlockStore] | None = None) -> list[Row]:
    rows: list[Row] = []
    store = make()
    try:
        for wl, n in WORKLOADS.items():
            batches: Iterator[tuple[list[str], np.ndarray]] = iter([_objects(n, rng) for _ in range(reps + 2)])
            current: dict[str, Any] = {}

            def nxt(batches: Iterator[tuple[list[str], np.ndarray]] = batches, current: dict[str, Any] = current) -> None:
                current["keys"], current["data"] = next(batches)
                current["objs"] = list(zip(current["keys"], current["data"]))

            def put(store: BlockStore = store, current: dict[str, Any] = current) -> None:
                store.put(current["objs"])
                flush = getattr(store, "flush", None)
                if callable(flush):
                    flush()

            t_put = _median_s(put, reps, setup=nxt)
            keys, data = current["keys"], current["data"]
            target = reader(store) if reader is not None else store
            assert target.get_concatenated(keys) == data.tobytes()
            t_get = _median_s(functools.partial(target.get_concatenated, keys), reps)
            m = RouteManifest(tuple(keys), 0, n * BLOCK, 0, BLOCK, BLOCK, (LAYERS, TOPK), "|u1", "shm://auxout-0-x")
            t_fetch = _median_s(functools.partial(fetch, m, target), reps)
            if target is not store:
                target.close()
            if reader is None:  # a reader cannot put: its rows are get/fetch only
                rows.append(Row(name, wl, "put", t_put, data.nbytes))
            rows += [Row(name, wl, "get", t_get, data.nbytes), Row(name, wl, "fetch", t_fetch, data.nbytes)]
    finally:
        with contextlib.suppress(Exception):
            store.close()
    return rows


class RawClient:
    """The plain client doing what the store does, for the overhead ratio."""

    name = "raw"

    def put(self, keys: list[str], data: np.ndarray) -> None:
        raise NotImplementedError

    def get(self, keys: list[str]) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        return None


class RawRedis(RawClient):
    name = "redis raw"

    def __init__(self, url: str) -> None:
        import redis

        self.r = redis.Redis.from_url(url)

    def put(self, keys: list[str], data: np.ndarray) -> None:  # pipelined SET
        pipe = self.r.pipeline(transaction=False)
        for k, v in zip(keys, data):
            pipe.set(k, v.tobytes())
        pipe.execute()

    def get(self, keys: list[str]) -> bytes:  # MGET
        return b"".join(cast(list[bytes], self.r.mget(keys)))

    def close(self) -> None:
        self.r.close()


class RawMooncake(RawClient):
    name = "mooncake raw"

    def __init__(self, addr: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.s = MooncakeDistributedStore()
        assert self.s.setup("127.0.0.1", "P2PHANDSHAKE", SEG, 256 * 2**20, "tcp", "", addr) == 0

    def put(self, keys: list[str], data: np.ndarray) -> None:
        assert self.s.put_batch(keys, [v.tobytes() for v in data]) == 0

    def get(self, keys: list[str]) -> bytes:
        return b"".join(self.s.get_batch(keys))

    def close(self) -> None:
        self.s.close()


def bench_pair(name: str, store: BlockStore, raw: RawClient, reps: int, rng: np.random.Generator) -> list[Row]:
    """auxout store and raw client interleaved run by run, so server-side drift hits both alike."""
    rows: list[Row] = []
    for wl, n in WORKLOADS.items():
        times: dict[tuple[str, str], list[float]] = {}
        ops: dict[str, tuple[Callable[[list[str], np.ndarray], None], Callable[[list[str]], bytes]]] = {
            "aux": (lambda keys, data: store.put(list(zip(keys, data))), store.get_concatenated),
            "raw": (raw.put, raw.get),
        }
        cpu: dict[tuple[str, str], list[float]] = {}

        def timed(
            key: tuple[str, str], fn: Callable[[], Any], count: bool, times: dict[tuple[str, str], list[float]] = times,
            cpu: dict[tuple[str, str], list[float]] = cpu,
        ) -> Any:
            t, c = time.perf_counter(), time.process_time()
            out = fn()
            if count:
                times.setdefault(key, []).append(time.perf_counter() - t)
                cpu.setdefault(key, []).append(time.process_time() - c)
            return out

        for rep in range(reps + 1):  # run 0 warms both up and is not counted
            order = ["aux", "raw"] if rep % 2 else ["raw", "aux"]
            sets = {who: _objects(n, rng) for who in order}
            for who in order:
                keys, data = sets[who]
                timed((who, "put"), functools.partial(ops[who][0], keys, data), rep > 0)
            for who in order:
                keys, data = sets[who]
                got = timed((who, "get"), functools.partial(ops[who][1], keys), rep > 0)
                assert got == data.tobytes()
            keys, data = sets["aux"]
            m = RouteManifest(tuple(keys), 0, n * BLOCK, 0, BLOCK, BLOCK, (LAYERS, TOPK), "|u1", "shm://auxout-0-x")
            timed(("aux", "fetch"), functools.partial(fetch, m, store), rep > 0)
        nbytes = n * ONB
        for (who, op), ts in times.items():
            row = Row(raw.name if who == "raw" else name, wl, op, statistics.median(ts), nbytes, min(ts))
            row.cpu = statistics.median(cpu[(who, op)])
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    reps = args.reps
    cap = ONB * (reps + 3) * sum(WORKLOADS.values())
    rows: list[Row] = []
    bench_store("warm-up", lambda: ArenaStore(cap, ONB), 3, rng)  # the process's first pass pays page faults
    rows += bench_store("arena", lambda: ArenaStore(cap, ONB), reps, rng)
    rows += bench_store("background(arena)", lambda: BackgroundStore(ArenaStore(cap, ONB), max_pending=64), reps, rng)
    rows += bench_store("shm owner", lambda: SharedMemoryStore(cap, ONB), reps, rng)
    rows += bench_store("shm reader", lambda: SharedMemoryStore(cap, ONB), reps, rng,
                        reader=lambda s: SharedMemoryStore.open(s.name))  # type: ignore[attr-defined]
    with redis_server() as srv:
        rstore, rraw = RedisStore(srv.url, namespace="bench", object_nbytes=ONB), RawRedis(srv.url)
        rows += bench_pair("redis", rstore, rraw, reps, rng)
        rstore.close()
        rraw.close()
    with mooncake_master() as m:
        mstore = MooncakeStore(m.master_addr, object_nbytes=ONB, global_segment_size=SEG,
                               local_buffer_size=256 * 2**20)
        mraw = RawMooncake(m.master_addr)
        rows += bench_pair("mooncake", mstore, mraw, reps, rng)
        mstore.close()
        mraw.close()

    print(f"\nmedian of {reps} runs; MB = 1e6 bytes; object = {ONB} B route block\n")
    print(f"{'backend':<18} {'workload':<15} {'op':<6} {'ms':>8} {'MB/s':>8} {'vs raw':>8}")
    raw = {(r.backend.split()[0], r.workload, r.op): r for r in rows if r.backend.endswith(" raw")}
    for r in rows:
        base = raw.get((r.backend, r.workload, r.op))
        ratio = f"{r.seconds / base.seconds:7.2f}x" if base is not None else ""
        print(f"{r.backend:<18} {r.workload:<15} {r.op:<6} {r.seconds * 1e3:8.2f} {r.mbps:8.0f} {ratio:>8}")
    print("\nauxout overhead over the raw client (time ratio - 1; target <= +10%), wall time (median, best run) and client-process CPU time (median):")
    for r in rows:
        base = raw.get((r.backend, r.workload, r.op))
        if base is not None:
            med = 100 * (r.seconds / base.seconds - 1)
            best = 100 * (r.best / base.best - 1)
            cpu = 100 * (r.cpu / base.cpu - 1) if base.cpu > 0 else float("nan")
            print(f"  {r.backend:<9} {r.workload:<15} {r.op:<4} wall median {med:+6.1f}%  best {best:+6.1f}%"
                  f"  client CPU {cpu:+6.1f}%")


if __name__ == "__main__":
    main()
