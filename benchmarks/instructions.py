"""Data-plane cost in CPU instructions: auxout vs vLLM's in-tree connectors, without machine noise.

``benchmarks/dataplane.py`` times the connectors with the wall clock, and on a shared 2-core
machine its ratios move by about ±10% between runs. This script replays the same workloads once
per driver under ``valgrind --tool=callgrind`` and counts the instructions executed from the first
timed step to the end of the replay (all threads, so a writer thread's work counts too), then
subtracts a run of a driver that does nothing (the harness's own per-step work). The counts repeat
to about 0.1% run to run, so they A/B small changes that the wall clock cannot resolve.

Instructions are not time: a copy of a megabyte is a few thousand instructions, which the wall
clock sees and this count does not. Read the ratio beside ``dataplane.py``'s, not instead of it.

    .venv/bin/python benchmarks/instructions.py                  # ~8 min (vLLM's import under valgrind)
    .venv/bin/python benchmarks/instructions.py --no-vllm --only decode
    .venv/bin/python benchmarks/instructions.py --no-vllm --unchecked   # + auxout without the row check
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKLOADS = ("decode", "prefill", "multi-turn")
DRIVERS = ("null", "auxout", "auxout-sync", "vLLM", "auxout-unchecked")


def _build(dp: Any, name: str, quick: bool) -> Any:
    import numpy as np

    rng = np.random.default_rng(20261129)
    if name == "decode":
        return dp.decode_workload(rng, 48 if quick else 96)
    if name == "prefill":
        return dp.prefill_workload(rng, 16 if quick else 32)
    return dp.multiturn_workload(rng, n_conv=16 if quick else 32)


def child(workload: str, driver: str, quick: bool) -> int:
    """Runs under callgrind with instrumentation off; turns it on at the first timed step."""
    sys.path.insert(0, str(HERE))
    import dataplane as dp

    pid = str(os.getpid())

    def instrument(on: bool) -> None:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", pid], check=True, capture_output=True)

    base: Any = {
        "auxout": dp.AuxoutDriver, "auxout-sync": dp.AuxoutSyncDriver, "null": dp.AuxoutSyncDriver,
        "auxout-unchecked": dp.AuxoutUncheckedDriver,
    }  # fmt: skip
    if driver == "vLLM":
        mods = dp.load_vllm()
        if mods is None:
            return 2
        parent: Any = type("V", (dp.VllmDriver,), {"__init__": lambda self: dp.VllmDriver.__init__(self, mods)})
    else:
        parent = base[driver]

    class Counted(parent):  # type: ignore[misc,valid-type]
        flushes = 0

        def flush(self) -> None:  # replay flushes once right before its first timed step
            super().flush()
            Counted.flushes += 1
            if Counted.flushes == 1:
                instrument(True)

        if driver == "null":

            def step(self, st: Any, rows: Any, live: Any, admitted: Any) -> None:
                return None

            def emit(self, out: Any, emitters: Any, finished: Any, chunked: Any) -> None:
                return None

            def drain(self, live: Any) -> None:
                self.flush()

    wl = _build(dp, workload, quick)
    res = dp.replay(wl, Counted, verify=False)
    instrument(False)
    print(f"STEPS {len(wl.timed_steps)} NOTE {res.note}")
    return 0


def count(workload: str, driver: str, quick: bool) -> tuple[int, int]:
    """(instructions, timed steps) of one replay under callgrind."""
    cmd = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null",
        sys.executable, __file__, "--child", workload, driver,
    ] + (["--quick"] if quick else [])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    text = out.stdout + out.stderr
    collected = re.search(r"Collected : (\d+)", text)
    steps = re.search(r"STEPS (\d+)", text)
    if out.returncode != 0 or collected is None or steps is None:
        raise RuntimeError(f"{driver} on {workload} failed (exit {out.returncode}):\n{text[-2000:]}")
    return int(collected.group(1)), int(steps.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--only", choices=WORKLOADS, action="append")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smaller workloads")
    ap.add_argument("--unchecked", action="store_true", help="also count auxout without the row check")
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "DRIVER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.quick)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (with callgrind_control) is needed: apt-get install valgrind")
        return 2
    drivers = [d for d in DRIVERS if not (args.no_vllm and d == "vLLM") and (args.unchecked or d != "auxout-unchecked")]
    print("instructions per timed step, connectors only (each driver minus the do-nothing driver)")
    for wl in args.only or WORKLOADS:
        t = time.perf_counter()
        counts = {d: count(wl, d, args.quick) for d in drivers}
        null, steps = counts["null"]
        per = {d: (n - null) / steps for d, (n, _) in counts.items() if d != "null"}
        line = "  ".join(f"{d} {v / 1e6:7.3f} M" for d, v in per.items())
        print(f"{wl:<11} {steps:4d} steps  {line}  (harness {null / steps / 1e6:.3f} M)  [{time.perf_counter() - t:.0f} s]")
        if "auxout-unchecked" in per:
            check = per["auxout"] - per["auxout-unchecked"]
            print(f"{'':<11} row check {check / 1e3:.1f} k = {100 * check / per['auxout-unchecked']:.2f}% of auxout-unchecked")
        if "vLLM" in per:
            print(
                f"{'':<11} auxout / vLLM {per['auxout'] / per['vLLM']:.3f}   "
                f"auxout-sync / vLLM {per['auxout-sync'] / per['vLLM']:.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
