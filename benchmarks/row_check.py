"""The row check alone, per call, and inside the connector beside a bare read of the rows (same run).

``dataplane.py`` prints the check's share of auxout's connector cost as timed inside its calls,
on the wall clock: on a shared machine that share moves with the load. This script measures the
same check two ways that move less:

1. ``RowCheck`` on warm rows, call by call, at the data plane's step shapes (48 layers x top-8 of
   128: a decode step of 256 tokens, prefill steps of 2,048 and 8,192 tokens) and at other common
   router shapes, beside a bare ``rows.max()`` (one read of every byte: no check that reads the
   rows costs less);
2. the data plane's workloads replayed through auxout's connector with the check, with a bare
   numpy ``max`` in its place (the floor) and without any (``--against REV`` adds the check as it
   was at a git revision), interleaved, timing the step thread's CPU time (``time.thread_time``:
   time spent waiting on a loaded machine is left out).

Rows are ones a router can produce (distinct ids per (token, layer)): the check's common path.

    .venv/bin/python benchmarks/row_check.py                      # ~2 min
    .venv/bin/python benchmarks/row_check.py --against 3de2612    # + the check at that revision
    .venv/bin/python benchmarks/row_check.py --quick              # ~30 s
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dataplane as dp  # noqa: E402

from auxout.connector.row_check import RowCheck  # noqa: E402
from auxout.profile import RouteProfile  # noqa: E402

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


def per_call_us(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median time per call of each function, the functions interleaved call by call."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    clock = time.perf_counter
    for _ in range(reps):
        for name, fn in fns.items():
            t = clock()
            fn()
            times[name].append(clock() - t)
    return {name: statistics.median(v) * 1e6 for name, v in times.items()}


def timed(check_class: Any) -> Any:
    """``check_class`` timing its calls into the data plane's check clock, as ``dp.TimedRowCheck``."""

    class Timed(check_class):  # type: ignore[misc,valid-type]
        def __call__(self, rows: np.ndarray) -> np.ndarray | None:
            clock = dp.CLOCK[0]
            t = clock()
            try:
                return super().__call__(rows)  # type: ignore[no-any-return]
            finally:
                dp.CHECK_SECONDS[0] += clock() - t

    return Timed


class BareMax(RowCheck):
    """One numpy ``max`` over the rows in the check's place: what any check that reads them costs."""

    def __call__(self, rows: np.ndarray) -> np.ndarray | None:
        rows.max()
        return None


def previous_check(rev: str) -> Any:
    """``RowCheck`` as ``auxout/connector/row_check.py`` was at git revision ``rev`` (loaded as a module of its own)."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:auxout/connector/row_check.py"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    where = Path(tempfile.mkdtemp(prefix="row_check_"))
    (where / "previous_row_check.py").write_text(source)
    sys.path.insert(0, str(where))
    return importlib.import_module("previous_row_check").RowCheck


def in_connector(name: str, checks: dict[str, Any], repeats: int, quick: bool) -> dict[str, tuple[list[float], list[float]]]:
    """Per variant: step-thread CPU seconds per timed step of each replay, and the check's part of them."""
    wl = dp.build_workload(name, np.random.default_rng(20261129), quick=quick)
    steps = len(wl.timed_steps)
    out: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in checks}
    saved, dp.CLOCK[0] = dp.TimedRowCheck, time.thread_time  # (the class AuxoutDriver builds, swapped)
    order = list(checks)
    try:
        for rep in range(repeats):
            for v in order[rep % len(order) :] + order[: rep % len(order)]:  # (interleaved, rotating)
                setattr(dp, "TimedRowCheck", checks[v])  # noqa: B010
                res = dp.replay(wl, dp.AuxoutDriver, verify=rep == 0)
                if res.mismatches:
                    raise AssertionError(f"{name} with {v}: {res.mismatches[:3]}")
                out[v][0].append(res.seconds / steps)
                out[v][1].append(res.check_seconds / steps)
    finally:
        setattr(dp, "TimedRowCheck", saved)  # noqa: B010
        dp.CLOCK[0] = time.perf_counter
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None, help="replays per workload and variant (median)")
    ap.add_argument("--against", metavar="REV", help="also the check as auxout/connector/row_check.py was at git revision REV")
    args = ap.parse_args()
    reps = 60 if args.quick else 300
    repeats = args.repeats or (3 if args.quick else 9)
    rng = np.random.default_rng(0)
    t_all = time.perf_counter()
    previous = previous_check(args.against) if args.against else None
    print("RowCheck per call on warm rows (median), beside one numpy max over the same bytes")
    print(
        f"  {'profile':<38} {'tokens':>6} {'MB':>6} {'check us':>9} {'max us':>8} {'check/max':>9}"
        + (f" {'at ' + args.against:>12}" if previous is not None else "")
    )
    warm: dict[int, float] = {}
    for label, layers, top_k, experts, weights in SHAPES:
        profile = RouteProfile(layers, top_k, experts, weights=weights)
        t = time.perf_counter()
        check = RowCheck(profile)
        built = time.perf_counter() - t
        before = previous(profile) if previous is not None else None
        for n in (256, 2048, 8192) if label.endswith("(the data plane's)") else (256, 8192):
            rows = router_rows(profile, n, rng)
            if check(rows) is not None:
                raise AssertionError(f"{label}: rows a router can produce were flagged")
            ids = rows["id"] if weights else rows
            fns: dict[str, Callable[[], object]] = {"check": partial(check, rows), "max": ids.max}
            if before is not None:
                fns["before"] = partial(before, rows)
            us = per_call_us(fns, reps if n < 8192 else reps // 5)
            if label.endswith("(the data plane's)"):
                warm[n] = us["check"]
            print(
                f"  {label:<38} {n:>6} {rows.nbytes / 1e6:>6.2f} {us['check']:>9.1f} {us['max']:>8.1f} "
                f"{us['check'] / us['max']:>9.2f}" + (f" {us['before']:>12.1f}" if before is not None else "")
            )
        print(f"  {'':<38} (RowCheck built in {built:.2f} s: numba's build, or its cache)")

    checks: dict[str, Any] = {"check": timed(RowCheck)}
    if previous is not None:
        checks[f"check at {args.against}"] = timed(previous)
    checks["bare max"] = timed(BareMax)
    checks["none"] = lambda profile: None
    print(
        f"\nInside auxout's connector calls: step-thread CPU time per step, median of {repeats} replays "
        "(variants interleaved); the check's share of its step: median [range]"
    )
    for name, n in (("decode", 256), ("prefill", 8192), ("multi-turn", 0)):
        res = in_connector(name, checks, repeats, args.quick)
        for v, (steps, own) in res.items():
            line = f"  {name:<10} {v:<20} step {statistics.median(steps) * 1e6:8.1f} us"
            if v != "none":
                shares = sorted(c / t for c, t in zip(own, steps))
                line += (
                    f"  check {statistics.median(own) * 1e6:7.1f} us = {100 * statistics.median(shares):5.2f}% "
                    f"[{100 * shares[0]:.2f}..{100 * shares[-1]:.2f}]"
                )
            print(line)
        if n:
            none = statistics.median(res["none"][0]) * 1e6
            print(f"  {name:<10} the warm check of {n:,} tokens ({warm[n]:.1f} us) is {100 * warm[n] / none:.2f}% of the step without it")
    print(f"total wall time {time.perf_counter() - t_all:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
