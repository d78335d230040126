"""From how many MoE layers is one ``torch.stack`` cheaper than a copy per layer in ``RouteCapture.snapshot``?

The worker snapshots the routers' ids once per step. Per layer the loop costs a ``.numpy()`` and
a strided, narrowing numpy copy; from some layer count one ``torch.stack`` plus one cast is
cheaper. This prints, per layer count and rows per step, both paths' median time and their
ratio, measured in the same run (``capture._STACK_FROM`` is the threshold the ratios pick):

    python benchmarks/probes/capture_snapshot.py
    python benchmarks/probes/capture_snapshot.py --layers 2 4 16 48 --rows 16 256 --top-k 8

Warm-cache numbers: in an engine the snapshot runs after the forward and sampling, several
times slower (docs/performance.md); the ratio is what this script is for.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from auxout.profile import RouteProfile
from auxout.vllm.workers import capture as capture_mod
from auxout.vllm.workers.capture import RouteCapture


class _Router:
    fn: Any = None

    def set_capture_fn(self, fn: Any) -> None:
        self.fn = fn


def _median_us(cap: RouteCapture, routers: list[_Router], ids: list[torch.Tensor], rows: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        for r, t in zip(routers, ids):
            r.fn(t)
        t0 = time.perf_counter()
        cap.snapshot(rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 3, 4, 8, 16, 48])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    threshold = capture_mod._STACK_FROM
    print(f"snapshot median per call, warm; auxout stacks from {threshold} layers")
    print(f"{'layers':>6} {'rows':>5} {'per layer':>10} {'stacked':>9} {'stacked/per layer':>18}")
    for layers in args.layers:
        for rows in args.rows:
            profile = RouteProfile(num_layers=layers, top_k=args.top_k, num_experts=args.experts)
            cap = RouteCapture(profile, max_tokens=max(args.rows))
            routers = [_Router() for _ in range(layers)]
            cap.bind(routers)  # type: ignore[arg-type]
            ids = [torch.from_numpy(rng.integers(0, args.experts, (rows, args.top_k), dtype=np.int32)) for _ in routers]
            res = {}
            for mode, stack_from in (("loop", 1 << 30), ("stack", 1)):  # interleaved: same machine state
                capture_mod._STACK_FROM = stack_from
                res[mode] = _median_us(cap, routers, ids, rows, args.reps)
            capture_mod._STACK_FROM = threshold
            print(f"{layers:>6} {rows:>5} {res['loop']:>8.2f}us {res['stack']:>7.2f}us {res['stack'] / res['loop']:>18.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
