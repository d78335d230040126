"""The row check alone, per call, against the connector's own step cost (same run).

``dataplane.py`` prints the check's share of auxout's connector cost as timed inside its calls:
on a shared machine that share moves with the load, and a step's rows arrive there with caches
as the connector leaves them. This script times ``RowCheck`` on warm rows, call by call, at the
data plane's step shapes (48 layers x top-8 of 128: a decode step of 256 tokens, prefill steps of
2,048 and 8,192 tokens) and at other common router shapes, beside a bare ``rows.max()`` (one read
of every byte: no check that reads the rows costs less), then replays the data plane's decode and
prefill workloads through auxout's connector WITHOUT the check, timing the step thread's CPU time
(``time.thread_time``: time spent waiting on a loaded machine is left out), and prints the warm
check at each workload's step shape as a fraction of that step. Rows are ones a router can
produce (distinct ids per (token, layer)): the check's common path.

    .venv/bin/python benchmarks/row_check.py            # ~1 min
    .venv/bin/python benchmarks/row_check.py --quick    # ~15 s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dataplane as dp  # noqa: E402

from auxout.profile import RouteProfile  # noqa: E402
from auxout.row_check import RowCheck  # noqa: E402

SHAPES = [  # (label, layers, top_k, experts, weights)
    ("48 x top-8 of 128 (the data plane's)", 48, 8, 128, False),
    ("48 x top-8 of 128, with weights", 48, 8, 128, True),
    ("48 x top-8 of 256", 48, 8, 256, False),
    ("48 x top-8 of 512 (two-byte ids)", 48, 8, 512, False),
    ("32 x top-2 of 8", 32, 2, 8, False),
    ("24 x top-4 of 60", 24, 4, 60, False),
    ("26 x top-6 of 64", 26, 6, 64, False),
]


def router_rows(profile: RouteProfile, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` token rows a router can produce: ``top_k`` distinct experts per (token, layer)."""
    keys = rng.random((n * profile.num_layers, profile.num_experts), dtype=np.float32)
    ids = np.argpartition(keys, profile.top_k - 1, axis=1)[:, : profile.top_k].astype(profile.id_dtype)
    rows = profile.empty(n)
    if profile.weights:
        rows["id"], rows["w"] = ids.reshape(n, profile.num_layers, profile.top_k), 0.5
    else:
        rows[:] = ids.reshape(n, profile.num_layers, profile.top_k)
    return rows


def per_call_us(fns: dict[str, object], reps: int) -> dict[str, float]:
    """Median time per call of each function, the functions interleaved call by call."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    clock = time.perf_counter
    for _ in range(reps):
        for name, fn in fns.items():
            t = clock()
            fn()  # type: ignore[operator]
            times[name].append(clock() - t)
    return {name: statistics.median(v) * 1e6 for name, v in times.items()}


def connector_step_us(name: str, repeats: int, quick: bool) -> float:
    """Median over repeats of auxout's connector cost per timed step, step-thread CPU time, no check."""
    dp.CLOCK[0] = time.thread_time
    saved = dp.TimedRowCheck
    dp.TimedRowCheck = lambda profile: None  # type: ignore[assignment,misc]
    try:
        wl = dp.build_workload(name, np.random.default_rng(20261129), quick=quick)
        totals = [dp.replay(wl, dp.AuxoutDriver, verify=False).seconds for _ in range(repeats)]
    finally:
        dp.TimedRowCheck, dp.CLOCK[0] = saved, time.perf_counter
    return statistics.median(totals) / len(wl.timed_steps) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None, help="replays per workload (median)")
    args = ap.parse_args()
    reps = 60 if args.quick else 300
    repeats = args.repeats or (3 if args.quick else 7)
    rng = np.random.default_rng(0)
    t_all = time.perf_counter()
    print("RowCheck per call on warm rows (median), beside one numpy max over the same bytes")
    print(f"  {'profile':<38} {'tokens':>6} {'MB':>6} {'check us':>9} {'max us':>8} {'check/max':>9}")
    warm: dict[int, float] = {}
    for label, layers, top_k, experts, weights in SHAPES:
        profile = RouteProfile(layers, top_k, experts, weights=weights)
        t = time.perf_counter()
        check = RowCheck(profile)
        built = time.perf_counter() - t
        for n in (256, 2048, 8192) if label.endswith("(the data plane's)") else (256, 8192):
            rows = router_rows(profile, n, rng)
            if check(rows) is not None:
                raise AssertionError(f"{label}: rows a router can produce were flagged")
            ids = rows["id"] if weights else rows
            run_check = lambda check=check, rows=rows: check(rows)  # noqa: E731
            us = per_call_us({"check": run_check, "max": ids.max}, reps if n < 8192 else reps // 5)
            if label.endswith("(the data plane's)"):
                warm[n] = us["check"]
            print(
                f"  {label:<38} {n:>6} {rows.nbytes / 1e6:>6.2f} {us['check']:>9.1f} {us['max']:>8.1f} "
                f"{us['check'] / us['max']:>9.2f}"
            )
        print(f"  {'':<38} (RowCheck built in {built:.2f} s: numba's build, or its cache)")
    print(
        "\nauxout's connector per timed step, without the check (step-thread CPU time, median of "
        f"{repeats} replays), against the warm check at the step's shape"
    )
    for name, n in (("decode", 256), ("prefill", 8192)):
        step = connector_step_us(name, repeats, args.quick)
        print(f"  {name:<8} {step:9.1f} us/step; check of {n:,} tokens {warm[n]:7.1f} us = {100 * warm[n] / step:5.2f}%")
    print(f"total wall time {time.perf_counter() - t_all:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
