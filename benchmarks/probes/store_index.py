"""What does the in-process store cost per prefill-sized batch, beside the bare copy of the same bytes?

    .venv/bin/python benchmarks/probes/store_index.py [--reps 5] [--against ../other-checkout] [--pinned]

One batch = what a full prefill step publishes at the data-plane benchmark's shape: 512 new route
blocks of 6 KiB (16 tokens x 48 layers x top-8 uint8) handed over as the worker's ``BlockObjects``,
512 retains (their pins) and 512 releases (the previous step's requests finished), into an
``ArenaStore`` of 16,384 objects that is full, so every batch also evicts 512 objects. Timed with
the thread's CPU time (``time.thread_time``, less disturbed by other load on a shared machine),
median over ``--reps`` runs of 80 batches after 40 untimed ones.

Printed beside it, measured in the same run: the bare copy of the batch's bytes into the same
slots (``arena[idx] = blocks``), so ``put / copy`` is the store's bookkeeping as a multiple of the
copy it cannot avoid. ``--against DIR`` runs the same measurement from another checkout (e.g. a
``git worktree`` of an older commit) in alternating subprocesses and prints the ratio of each pair.

``--pinned`` times a 16-block put into a full 200,000-key index whose oldest 0 / 10,000 / 100,000
keys are pinned by live requests (median and mean of 400 puts; the mean includes the first put,
which moves the pins out of the eviction scan's way), with the ratio to the unpinned case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

NBYTES = 16 * 48 * 8  # one hash block of routes
PER_BATCH = 512
SLOTS = 16_384
WARM, TIMED = 40, 80


def _batch(keys: list[str], blocks: np.ndarray) -> Any:
    from auxout.stores import base

    objs = base.BlockObjects(nbytes=NBYTES)
    if hasattr(objs, "add"):  # keys + arrays (this checkout)
        objs.add(keys, blocks)
    else:  # a checkout from before BlockObjects carried arrays: one flat view per block
        flat = memoryview(blocks.reshape(-1).data)
        objs.extend((k, flat[i * NBYTES : (i + 1) * NBYTES]) for i, k in enumerate(keys))
    return objs


def measure() -> dict[str, float]:
    """Microseconds per batch: ``put`` (the store) and ``copy`` (the bare scatter of its bytes)."""
    from auxout.stores import ArenaStore

    store = ArenaStore(SLOTS * NBYTES, NBYTES)
    store._arena.fill(0)  # type: ignore[union-attr]  # fault the arena in, as a warm engine has
    scratch = np.zeros((SLOTS, NBYTES), dtype=np.uint8)
    blocks = np.random.default_rng(0).integers(0, 128, (PER_BATCH, NBYTES), dtype=np.uint8)
    idx = np.random.default_rng(1).permutation(SLOTS)[:PER_BATCH]
    prev: list[str] = []
    put = copy = 0.0
    for step in range(WARM + TIMED):
        keys = [f"auxout/r3/bench/g0/{step:08d}{i:056d}" for i in range(PER_BATCH)]
        objs = _batch(keys, blocks)
        t0 = time.thread_time()
        store.put(objs, retain=keys, release=prev[::-1])
        t1 = time.thread_time()
        scratch[idx] = blocks
        t2 = time.thread_time()
        if step >= WARM:
            put += t1 - t0
            copy += t2 - t1
        prev = keys
    store.close()
    return {"put": put / TIMED * 1e6, "copy": copy / TIMED * 1e6}


def pinned(counts: tuple[int, ...] = (0, 10_000, 100_000), total: int = 200_000, puts: int = 400) -> dict[str, float]:
    """Median and mean microseconds per 16-block put into a full index whose oldest keys are pinned.

    Long-running requests pin the oldest keys; each put must evict 16 unreferenced ones. Runs on
    ``SlotIndex`` alone (no payload bytes), so what is timed is the bookkeeping.
    """
    from auxout.stores.slots import SlotIndex

    out: dict[str, float] = {}
    for n in counts:
        index = SlotIndex(total, "bench")
        keys = [f"k{i:09d}" for i in range(total)]
        index.plan_put([(k, b"x") for k in keys], keys[:n], [], 1)
        times = []
        for r in range(puts):
            new = [f"n{r:05d}-{i:02d}" for i in range(16)]
            batch = [(k, b"x") for k in new]
            t0 = time.perf_counter()
            index.plan_put(batch, new, [], 1)
            times.append(time.perf_counter() - t0)
        out[f"median_{n}"] = statistics.median(times) * 1e6
        out[f"mean_{n}"] = statistics.fmean(times) * 1e6
    return out


def _median_run(reps: int) -> dict[str, float]:
    runs = [measure() for _ in range(reps)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _in_checkout(root: Path, reps: int, pinned: bool = False) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, __file__, "--reps", str(reps), "--json"] + (["--pinned"] if pinned else []), env=env,
        cwd=root, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--against", type=Path, help="another checkout to compare with (alternating subprocesses)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations with --against")
    ap.add_argument("--pinned", action="store_true", help="put cost behind pinned keys at the LRU's old end")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(pinned() if args.pinned else _median_run(args.reps)))
        return 0
    here = Path(__file__).resolve().parents[2]  # the checkout this file is in
    if args.pinned:
        runs = {"this": pinned() if args.against is None else _in_checkout(here, 0, pinned=True)}
        if args.against is not None:
            runs["against"] = _in_checkout(args.against.resolve(), 0, pinned=True)
        for name, r in runs.items():
            base = r["median_0"]
            cells = "  ".join(
                f"{n:>7} pinned: median {r[f'median_{n}']:9.1f} us ({r[f'median_{n}'] / base:7.1f}x), mean {r[f'mean_{n}']:9.1f} us"
                for n in (0, 10_000, 100_000)
            )
            print(f"{name:<8} 16-block put into a full 200k index  {cells}")
        return 0
    if args.against is None:
        r = _median_run(args.reps)
        print(f"put {r['put']:.0f} us/batch, bare copy {r['copy']:.0f} us/batch, put / copy {r['put'] / r['copy']:.2f}")
        return 0
    print(f"{'round':<6}{'this us':>10}{'against us':>12}{'this/against':>14}{'this put/copy':>15}")
    ratios = []
    for k in range(args.rounds):
        other = _in_checkout(args.against.resolve(), args.reps)
        mine = _in_checkout(here, args.reps)
        ratios.append(mine["put"] / other["put"])
        print(f"{k:<6}{mine['put']:>10.0f}{other['put']:>12.0f}{ratios[-1]:>14.2f}{mine['put'] / mine['copy']:>15.2f}")
    print(f"median this/against: {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
