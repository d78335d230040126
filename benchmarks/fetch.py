"""Keys-only fetch beside the store's own pipelined read of the same objects, same run.

    .venv/bin/python benchmarks/fetch.py [--rounds 15] [--stores redis,mooncake]

The workload: a 6-turn conversation reaching 8,192 tokens at the Qwen3-30B-A3B shape (48 MoE
layers, top-8 of 128, uint8 ids, 16-token blocks: 6 KiB objects), laid out as the engine lays it
out: full blocks under block keys, each turn's rows past the last full block published as
boundary objects (``publish_manifest``). Two reads of it:

- ``trajectory``: one manifest of all 8,191 rows (512 objects, 3.1 MB);
- ``6 turns``: the six per-turn manifests one after another (each starts mid-block, 87-88 objects).

Arms, interleaved in ABBA order round by round against real servers on 127.0.0.1:

- ``fetch(manifest)``: what a trainer calls, with no store given (a client per call unless the
  process already holds one for that address);
- ``fetch(manifest, store)``: with a reading client the caller keeps open;
- ``raw``: the store's own pipelined read of the manifest's objects on an open client (redis-py
  pipeline of ``GET``; Mooncake ``get_batch``), joined into one buffer.

The readers are not the writer: for Mooncake the objects sit in the writer's segment and every
reader (auxout's, as ``fetch`` opens it, and the raw client, set up alike) moves them over TCP.

Printed: median time per read, and the throughput ratio raw time / auxout time (1.0 = as fast as
the raw read; the target is >= 0.8) as the median of the per-round ratios with its 10th-90th
percentile spread.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from auxout.manifest import RouteManifest, close_readers, fetch, publish_manifest
from auxout.stores.base import BlockStore
from auxout.testing.servers import mooncake_master, redis_server

BLOCK, LAYERS, TOPK, EXPERTS = 16, 48, 8, 128
TOKENS, TURNS = 8192, 6
ONB = BLOCK * LAYERS * TOPK


def conversation(store: BlockStore, address: str, rng: np.random.Generator) -> tuple[np.ndarray, list[RouteManifest]]:
    """Publish an 8k-token conversation's routes as the engine would; return the rows and the
    manifests: the whole trajectory first, then one per turn."""
    rows = rng.integers(0, EXPERTS, size=(TOKENS - 1, LAYERS, TOPK), dtype=np.uint8)
    tag = uuid.uuid4().hex
    block_keys = [f"auxout/r3/bench/g0/{tag}{i:05d}" for i in range(len(rows) // BLOCK)]
    blocks = rows[: len(block_keys) * BLOCK].reshape(len(block_keys), ONB)
    store.put(list(zip(block_keys, blocks)))
    # a turn's response covers rows up to its last token; the next turn starts where it ended
    ends = [round(TOKENS * (t + 1) / TURNS) - 1 for t in range(TURNS)]
    manifests = []
    for start, end in [(0, ends[-1]), *zip([0, *ends[:-1]], ends)]:
        full = end // BLOCK
        manifests.append(publish_manifest(
            store, address=address, block_keys=block_keys[:full], tail_rows=rows[full * BLOCK : end],
            token_start=start, token_end=end, block_size=BLOCK, namespace="bench",
        ))  # fmt: skip
    return rows, manifests


def measure(arms: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each arm, the arms in ABBA order (reversed every other round)."""
    names = list(arms)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 warms up
        order = names + names[::-1] if r % 2 else names[::-1] + names
        per: dict[str, list[float]] = {n: [] for n in names}
        for n in order:
            t0 = time.perf_counter()
            arms[n]()
            per[n].append(time.perf_counter() - t0)
        if r:
            for n in names:
                times[n].append(statistics.mean(per[n]))
    return times


def report(label: str, times: dict[str, list[float]], nbytes: int) -> None:
    raw = times["raw"]
    print(f"\n## {label}: {nbytes / 1e6:.2f} MB per read, {len(raw)} ABBA rounds")
    print(f"{'arm':<24} {'ms':>8} {'MB/s':>8} {'raw/arm (median)':>17} {'p10-p90':>14}")
    for arm, ts in times.items():
        ratios = sorted(r / t for r, t in zip(raw, ts, strict=True))
        k = len(ratios) // 10
        med = statistics.median(ts)
        print(f"{arm:<24} {med * 1e3:8.2f} {nbytes / med / 1e6:8.0f} {statistics.median(ratios):17.3f} "
              f"{ratios[k]:6.3f}-{ratios[-1 - k]:6.3f}")


def run(name: str, writer: BlockStore, store: BlockStore, raw_read: Callable[[list[str]], bytes], rounds: int,
        rng: np.random.Generator) -> None:
    rows, manifests = conversation(writer, writer.address, rng)  # type: ignore[attr-defined]
    whole, turns = manifests[0], manifests[1:]
    assert np.array_equal(fetch(whole), rows) and np.array_equal(fetch(whole, store), rows)
    got = np.frombuffer(raw_read(list(whole.keys)), np.uint8).reshape(-1, LAYERS, TOPK)[: whole.num_rows]
    assert np.array_equal(got, rows)
    for label, ms in (("trajectory (8,191 rows, 512 objects)", [whole]),
                      (f"6 turns ({', '.join(str(len(m.keys)) for m in turns)} objects)", turns)):
        arms: dict[str, Callable[[], Any]] = {
            "fetch(manifest)": lambda ms=ms: [fetch(m) for m in ms],
            "fetch(manifest, store)": lambda ms=ms: [fetch(m, store) for m in ms],
            "raw": lambda ms=ms: [raw_read(list(m.keys)) for m in ms],
        }
        report(f"{name}, {label}", measure(arms, rounds), sum(m.num_rows for m in ms) * LAYERS * TOPK)


@contextlib.contextmanager
def redis_pair() -> Iterator[tuple[BlockStore, BlockStore, Callable[[list[str]], bytes]]]:
    import redis

    from auxout.stores.redis import RedisStore

    with redis_server() as srv:
        writer = RedisStore(srv.url, namespace="bench", object_nbytes=ONB)
        store = RedisStore.from_address(writer.address, object_nbytes=ONB)
        client = redis.Redis.from_url(srv.url)

        def raw_read(keys: list[str]) -> bytes:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(f"bench/{k}")
            return b"".join(pipe.execute())

        try:
            yield writer, store, raw_read
        finally:
            store.close()
            writer.close()
            client.close()


@contextlib.contextmanager
def mooncake_pair() -> Iterator[tuple[BlockStore, BlockStore, Callable[[list[str]], bytes]]]:
    from mooncake.store import MooncakeDistributedStore

    from auxout.stores.mooncake import MooncakeStore

    with mooncake_master() as m:
        writer = MooncakeStore(m.master_addr, object_nbytes=ONB, global_segment_size=256 * 2**20)
        store = MooncakeStore.from_address(writer.address, object_nbytes=ONB)  # as fetch opens it
        client = MooncakeDistributedStore()
        assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 128 * 2**20, "tcp", "", m.master_addr) == 0

        def raw_read(keys: list[str]) -> bytes:
            return b"".join(client.get_batch(keys))

        try:
            yield writer, store, raw_read
        finally:
            client.close()
            store.close()
            writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--stores", default="redis,mooncake")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    pairs = {"redis": redis_pair, "mooncake": mooncake_pair}
    for name in args.stores.split(","):
        with pairs[name]() as (writer, store, raw_read):
            run(name, writer, store, raw_read, args.rounds, rng)
            close_readers()


if __name__ == "__main__":
    main()
