"""What does sending one step's messages between processes cost (vLLM's mp executor pickles both)?

Every engine step sends a ``StepMetadata`` to the worker and gets a ``StepOutput`` back. This
times pickle dumps + loads of both for a decode step and a prefill step, against a baseline
measured in the same run: the same fields pickled the plain way (a tuple of numpy arrays, as
a plain pickling of ``StepOutput``). Prints microseconds and the ratio.

    python benchmarks/probes/step_messages.py [--requests 16] [--layers 48] [--top-k 8] [--cold]

``--cold`` evicts the caches (writes one byte per cache line of 96 MiB, untimed) before every
dumps and every loads, as a step's messages meet them in an engine: the worker pickles its
output right after sampling, the engine core unpickles it after waiting for the worker; medians.
"""

from __future__ import annotations

import argparse
import pickle
import timeit
from dataclasses import dataclass

import numpy as np

from auxout.connector.messages import StepMetadata, StepOutput
from auxout.profile import RouteProfile


def best_us(fn: object, number: int = 2000, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6  # type: ignore[arg-type]


def cold_us(obj: object, n: int = 300) -> float:
    """Median dumps + median loads of ``obj``, each after the caches were evicted (microseconds)."""
    from cold_cache import median_us  # (cold_cache.py beside this file: the eviction, 96 MiB)

    data = pickle.dumps(obj, protocol=5)
    return median_us(lambda: pickle.dumps(obj, protocol=5), n, True) + median_us(lambda: pickle.loads(data), n, True)


@dataclass(frozen=True, slots=True)
class PlainMetadata:
    """``StepMetadata``'s fields in a dataclass that pickles the default way (the baseline)."""

    generation: int
    requests: dict[str, int]
    block_hashes: dict
    finished: tuple[str, ...]
    final_hashes: dict


def plain_state(out: StepOutput) -> tuple:
    """``StepOutput``'s fields as numpy pickles them by default (the baseline)."""
    return (out.req_ids, out.token_starts, out.lo, out.hi, out.rows, out.errors, out.published, out.lost, out.heads)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--cold", action="store_true", help="caches evicted before each dumps and loads")
    args = ap.parse_args()
    n = args.requests
    prof = RouteProfile(num_layers=args.layers, top_k=args.top_k, num_experts=128)
    ids = [f"cmpl-{i:08x}-0" for i in range(n)]
    rng = np.random.default_rng(0)
    meta = StepMetadata(0, {r: 300 + i for i, r in enumerate(ids)})
    print(f"{n} requests, rows [*, {args.layers}, {args.top_k}] {prof.dtype}")
    print(f"  {'message':<22} {'auxout us':>10} {'plain us':>9} {'ratio':>6}")
    for name, rows_per in (("decode lane StepOutput", 0), ("decode StepOutput", 1), ("prefill StepOutput", 256)):
        lane, rows_per = rows_per == 0, max(rows_per, 1)  # (a lane step: one row each, starts listed)
        total = n * rows_per
        rows = rng.integers(0, 128, (total, args.layers, args.top_k)).astype(prof.dtype)
        q = np.arange(0, total + 1, rows_per, dtype=np.int64)
        out = StepOutput(ids, np.arange(300, 300 + n, dtype=np.int64), q[:n], q[1:], rows)
        if lane:
            out.one_row_starts = out.token_starts.tolist()
        ours = pickle.dumps(out, protocol=5)
        back = pickle.loads(ours)
        assert back.rows.tobytes() == rows.tobytes() and back.span_map() == out.span_map()
        assert back.one_row_starts == out.one_row_starts
        plain = pickle.dumps(plain_state(out), protocol=5)
        if args.cold:
            a, b = cold_us(out), cold_us(plain_state(out))
        else:
            a = best_us(lambda: pickle.loads(pickle.dumps(out, protocol=5)))  # noqa: B023
            b = best_us(lambda: pickle.loads(pickle.dumps(plain_state(out), protocol=5)))  # noqa: B023
        print(f"  {name:<22} {a:10.1f} {b:9.1f} {a / b:6.2f}   ({len(ours)} vs {len(plain)} bytes)")
    plain_meta = PlainMetadata(meta.generation, meta.requests, meta.block_hashes, meta.finished, meta.final_hashes)
    if args.cold:
        a, b = cold_us(meta), cold_us(plain_meta)
    else:
        a = best_us(lambda: pickle.loads(pickle.dumps(meta, protocol=5)))
        b = best_us(lambda: pickle.loads(pickle.dumps(plain_meta, protocol=5)))
    print(f"  {'StepMetadata':<22} {a:10.1f} {b:9.1f} {a / b:6.2f}   (baseline: a default-pickled dataclass)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
