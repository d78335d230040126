"""Time each connector and store call of ``dataplane.py``'s replays (where its cost per step goes).

Wraps auxout's per-step methods with ``time.perf_counter`` and runs ``dataplane.main`` with the
same arguments, then prints each method's total, calls and time per call. The timers add their own
cost (a few hundred ns a call) and nest (``process_output`` includes ``_commit``); a method run on
the store's writer thread counts its wall time there, GIL waits included.

    .venv/bin/python benchmarks/dataplane_calls.py --only prefill --no-vllm --repeats 7
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dataplane  # noqa: E402

from auxout.keys import ChainKeys, KeySpace  # noqa: E402
from auxout.scheduler_connector import SchedulerConnector  # noqa: E402
from auxout.stores.arena import ArenaStore  # noqa: E402
from auxout.stores.background import BackgroundStore  # noqa: E402
from auxout.worker_connector import WorkerConnector  # noqa: E402

TIMED: tuple[tuple[type, tuple[str, ...]], ...] = (
    (WorkerConnector, ("begin_step", "prepare_output", "process_output", "_commit", "_put", "_publish",
                       "_sync_pins", "_teardown", "_remember_chain", "_route_events")),
    (SchedulerConnector, ("build_metadata", "take_output_parts", "take_step", "request_finished", "add_request")),
    (ChainKeys, ("keys_batch",)),
    (KeySpace, ("keys_batch",)),
    (BackgroundStore, ("put", "_apply")),
    (ArenaStore, ("put",)),
)  # fmt: skip


def main(argv: list[str]) -> int:
    total: collections.defaultdict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()

    def wrap(cls: type, name: str) -> None:
        func = getattr(cls, name)
        label = f"{cls.__name__}.{name}"

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                total[label] += time.perf_counter() - t0
                calls[label] += 1

        setattr(cls, name, timed)

    for cls, names in TIMED:
        for name in names:
            wrap(cls, name)
    rc = dataplane.main(argv)
    print(f"\n{'call':<42} {'total':>10} {'calls':>9} {'per call':>10}")
    for label, t in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"{label:<42} {t * 1e3:8.1f} ms {calls[label]:9d} {t / calls[label] * 1e6:7.1f} us")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
