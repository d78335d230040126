"""How far could a faster store index take the data plane? The same replay with an index that does no work.

``dataplane.py`` replays a workload through auxout and through vLLM's in-tree connectors. This
script adds a third auxout run whose store keeps the arena and its two copies (the scatter of
published blocks, the gather of a read) but none of the bookkeeping: no reference counts, no LRU
order, no eviction (the arena is sized to hold every key of the workload), one dict from key to
slot. That is a lower bound for any store index behind the same worker and scheduler connectors;
the gap between it and vLLM is the worker's, the scheduler's and the copies' share. Outputs are
still checked bit for bit against the rows fed in (first repeat).

    .venv/bin/python benchmarks/probes/store_floor.py                    # multi-turn, ~1 min + vLLM import
    .venv/bin/python benchmarks/probes/store_floor.py --only prefill --repeats 11
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # dataplane.py

import dataplane as dp  # noqa: E402

from auxout.stores.base import BlockObjects, StoreObject  # noqa: E402
from auxout.stores.slots import write_slots  # noqa: E402


class FloorStore:
    """An arena with a key -> slot dict and nothing else (benchmark only: never evicts, ignores pins)."""

    def __init__(self, num_slots: int, object_nbytes: int) -> None:
        self.object_nbytes = object_nbytes
        self._arena = np.empty((num_slots, object_nbytes), dtype=np.uint8)
        self._arena.fill(0)  # steady state: faulted in (untimed), as dataplane.py does for both stores
        self._slot: dict[str, int] = {}

    def put(self, objects: Sequence[StoreObject], *, retain: Iterable[str] = (), release: Iterable[str] = ()) -> None:
        if not objects:
            return
        assert isinstance(objects, BlockObjects) and objects.nbytes == self.object_nbytes, "worker batches only"
        keys = objects.keys
        assert self._slot.keys().isdisjoint(keys), "the floor store expects each block published once"
        slots = range(len(self._slot), len(self._slot) + len(keys))
        self._slot.update(zip(keys, slots))
        write_slots(self._arena, slots, None, objects)

    def read_into(self, keys: Sequence[str], out: memoryview) -> None:
        idx = np.fromiter(map(self._slot.__getitem__, keys), dtype=np.int64, count=len(keys))
        dst = np.frombuffer(out, dtype=np.uint8).reshape(len(idx), self.object_nbytes)
        np.take(self._arena, idx, axis=0, out=dst, mode="clip")

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        return self._arena[[self._slot[k] for k in keys]].tobytes()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return [k in self._slot for k in keys]

    def drain_lost(self) -> list[str]:
        return []

    def close(self) -> None:
        self._slot.clear()


def floor_driver(num_slots: int) -> type[dp.AuxoutSyncDriver]:
    class FloorDriver(dp.AuxoutSyncDriver):
        name = "floor"

        def __init__(self) -> None:
            super().__init__()
            self.store.close()
            store = FloorStore(num_slots, dp.PROFILE.block_nbytes(dp.BLOCK))
            self.store = store  # type: ignore[assignment]
            self.worker.store = store  # type: ignore[assignment]

    return FloorDriver


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--only", choices=dp.WORKLOADS, default="multi-turn")
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args(argv)
    wl = dp.build_workload(args.only, np.random.default_rng(20261129))
    blocks = len({h for sp in wl.specs for h in sp.hashes})  # distinct keys: the floor store never evicts
    mods = dp.load_vllm()
    drivers: list[tuple[str, Callable[[], Any]]] = [
        ("auxout", dp.AuxoutDriver), ("auxout-sync", dp.AuxoutSyncDriver), ("floor", floor_driver(blocks)),
    ]  # fmt: skip
    if mods is not None:
        drivers.append(("vLLM", lambda: dp.VllmDriver(mods)))
    res = dp.measure(wl, drivers, args.repeats)
    base = res.get("vLLM")
    print(f"\n== {wl.name}: {args.repeats} interleaved repeats, medians")
    for name, m in res.items():
        ok = "outputs OK" if not m.mismatches else f"MISMATCH {m.mismatches[:2]}"
        paired = f"   / vLLM {dp._paired(m, base)}" if base is not None and m is not base else ""
        print(f"  {name:<12} {m.median * 1e3:8.1f} ms [{min(m.times) * 1e3:.1f}..{max(m.times) * 1e3:.1f}]  {ok}{paired}")
    a, f = res["auxout-sync"], res["floor"]
    print(f"  store bookkeeping in the bare store's replay: {1 - f.median / a.median:.0%} "
          f"(paired floor / auxout-sync {dp._paired(f, a)})")
    return 1 if any(m.mismatches for m in res.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
