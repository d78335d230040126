"""How much of auxout's data-plane time is payload copies, and how much is everything else?

Replays ``dataplane.py``'s workloads through auxout with the bare in-process store (``auxout-sync``:
every store call on the step's thread, so each copy is timed where it happens) and times, inside
the same replays, the two store copies: the gather of stored blocks into a request's output
(``ArenaStore.read_into``'s ``np.take``) and the scatter of published blocks into the arena
(``write_slots``). The rest is bookkeeping: keys, reference counts, LRU order, cursors, the
scheduler side (and one more copy: a request's own rows placed after its history, inside the
worker, which this script does not separate). The script prints each part's share of the replay (a ratio inside one run, so
machine noise cancels) and the copy bandwidth it saw.

    .venv/bin/python benchmarks/probes/copy_share.py                 # ~1 min
    .venv/bin/python benchmarks/probes/copy_share.py --only multi-turn --repeats 21
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # dataplane.py

import dataplane as dp  # noqa: E402

from auxout.stores import arena as arena_mod  # noqa: E402
from auxout.stores import slots as slots_mod  # noqa: E402

_COPY = {"read": 0.0, "write": 0.0}
_BYTES = {"read": 0, "write": 0}


def _timed_read_into(self: Any, keys: Any, out: memoryview) -> None:
    """``ArenaStore.read_into`` for full-size objects, with the gather timed on its own."""
    idx = np.asarray(self._index.lookup(keys), dtype=np.int64)
    dst = np.frombuffer(out, dtype=np.uint8).reshape(len(idx), -1)
    assert self._short == 0 and dst.shape[1] == self.object_nbytes, "benchmark stores hold full objects only"
    t0 = time.perf_counter()
    np.take(self._arena, idx, axis=0, out=dst, mode="clip")
    _COPY["read"] += time.perf_counter() - t0
    _BYTES["read"] += dst.nbytes


_write_slots = slots_mod.write_slots


def _timed_write_slots(data: np.ndarray, slots: Any, payloads: Any, objects: Any) -> np.ndarray:
    t0 = time.perf_counter()
    sizes = _write_slots(data, slots, payloads, objects)
    _COPY["write"] += time.perf_counter() - t0
    _BYTES["write"] += int(sizes.sum())
    return sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=dp.WORKLOADS, action="append")
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args()
    arena_mod.ArenaStore.read_into = _timed_read_into  # type: ignore[method-assign]
    arena_mod.write_slots = _timed_write_slots  # type: ignore[assignment]
    rng = np.random.default_rng(20261129)
    print("auxout-sync replays; medians over repeats (the first, cold, run dropped)")
    for name in args.only or dp.WORKLOADS:
        wl = dp.build_workload(name, rng)
        total, reads, writes = [], [], []
        nbytes = (0, 0)
        for rep in range(args.repeats + 1):
            _COPY.update(read=0.0, write=0.0)
            _BYTES.update(read=0, write=0)
            res = dp.replay(wl, dp.AuxoutSyncDriver, verify=rep == 0)
            if res.mismatches:
                raise SystemExit(f"{name}: wrong rows: {res.mismatches[:3]}")
            if rep:
                total.append(res.seconds)
                reads.append(_COPY["read"])
                writes.append(_COPY["write"])
                nbytes = (_BYTES["read"], _BYTES["write"])
        share = [(r + w) / t for r, w, t in zip(reads, writes, total)]
        t, r, w = (statistics.median(x) for x in (total, reads, writes))
        print(
            f"{name:<11} replay {t * 1e3:7.1f} ms | store reads {r * 1e3:6.1f} ms ({nbytes[0] / 1e6:5.1f} MB, "
            f"{nbytes[0] / max(r, 1e-9) / 1e9:4.1f} GB/s) | store writes {w * 1e3:6.1f} ms ({nbytes[1] / 1e6:5.1f} MB, "
            f"{nbytes[1] / max(w, 1e-9) / 1e9:4.1f} GB/s) | copies {statistics.median(share):.2f} of the replay "
            f"[{min(share):.2f}..{max(share):.2f}], the rest {1 - statistics.median(share):.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
