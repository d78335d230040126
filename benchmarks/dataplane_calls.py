"""Time each connector and store call of ``dataplane.py``'s replays (where its cost per step goes).

Wraps auxout's per-step methods with ``time.perf_counter`` and runs ``dataplane.main`` with the
same arguments, then prints each method's total, calls and time per call. The timers add their own
cost (a few hundred ns a call) and nest (``process_output`` includes ``_commit``, which includes ``StoreWriter.publish``); a method run on
the store's writer thread counts its wall time there, GIL waits included.

    .venv/bin/python benchmarks/dataplane_calls.py --only prefill --no-vllm --repeats 7
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dataplane  # noqa: E402
from engine_hooks import TIMES, timed  # noqa: E402

from auxout.connector.scheduler import SchedulerConnector  # noqa: E402
from auxout.connector.slot_table import SlotTable  # noqa: E402
from auxout.connector.store_io import StoreWriter  # noqa: E402
from auxout.connector.worker import WorkerConnector  # noqa: E402
from auxout.keys import ChainKeys, KeySpace  # noqa: E402
from auxout.stores.arena import ArenaStore  # noqa: E402
from auxout.stores.background import BackgroundStore  # noqa: E402

TIMED: tuple[tuple[type, tuple[str, ...]], ...] = (
    (WorkerConnector, ("begin_step", "prepare_output", "process_output", "_commit", "_teardown", "_remember_chain",
                       "commit_lane_step")),
    (SlotTable, ("sync_pins",)),
    (StoreWriter, ("put", "publish", "events")),
    (SchedulerConnector, ("build_metadata", "take_output_parts", "take_step", "request_finished", "add_request")),
    (ChainKeys, ("keys_batch",)),
    (KeySpace, ("keys_batch",)),
    (BackgroundStore, ("put", "_apply")),
    (ArenaStore, ("put",)),
)  # fmt: skip


def main(argv: list[str]) -> int:
    for cls, names in TIMED:
        for name in names:
            timed(cls, name, f"{cls.__name__}.{name}")  # (engine_hooks' wrapper: each call into TIMES)
    rc = dataplane.main(argv)
    print(f"\n{'call':<42} {'total':>10} {'calls':>9} {'per call':>10}")
    for label, ts in sorted(TIMES.items(), key=lambda kv: -sum(kv[1])):
        print(f"{label:<42} {sum(ts) * 1e3:8.1f} ms {len(ts):9d} {sum(ts) / len(ts) * 1e6:7.1f} us")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
