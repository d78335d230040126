"""Engine throughput with auxout routes on vs a plain vLLM engine: same workload, same process.

Both engines stay alive (an idle vLLM engine sleeps) and runs alternate, on/off then off/on, so
background load on the machine and a drift within a pair hit both alike; the reported ratio is
the median of per-pair ratios (on throughput / off throughput; target >= 0.97).

    python benchmarks/engine_overhead.py [--arch qwen3_moe] [--size realistic] [--pairs 5] [--profile]
    python benchmarks/engine_overhead.py --separate 8 --pairs 3   # one engine per process

Two live engines in one machine interact (both bind their worker to the same core): on a 2-core
machine one engine's throughput has drifted by 20% over a run while the other held steady.
``--separate N`` runs each engine alone in a process of its own instead (N batches, the median
counted), the processes alternating on/off then off/on; the machine's speed then moves between
processes instead, so use several pairs.

``--size realistic`` runs a 16-layer, 64-expert, hidden-1024 Qwen3-MoE (``auxout.testing.models.SIZES``),
whose step takes tens of ms, instead of the tiny model (target there: >= 0.99). For where the
time goes, run it under a sampling profiler, e.g.
``py-spy record --subprocesses -o out.svg -- python benchmarks/engine_overhead.py --pairs 2``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np


def make_engine(path: str, routes: bool, args: argparse.Namespace) -> Any:
    from vllm import LLM

    from auxout.vllm import engine_kwargs

    extra = engine_kwargs() if routes else {"enable_prefix_caching": True}
    return LLM(
        model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
        max_model_len=2048, seed=0, max_num_seqs=args.batch, disable_log_stats=True,
        async_scheduling=getattr(args, "async_scheduling", False), **extra,
    )  # fmt: skip


def workload(args: argparse.Namespace, rep: int) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(1000 + rep)  # fresh prompts each rep: no cross-rep prefix hits
    return [{"prompt_token_ids": rng.integers(3, 1000, size=args.prompt).tolist()} for _ in range(args.batch)]


def run_once(llm: Any, args: argparse.Namespace, rep: int) -> float:
    """Tokens (prompt + generated) per second for one batch."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = workload(args, rep)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(p["prompt_token_ids"]) + len(o.outputs[0].token_ids) for p, o in zip(prompts, outs)) / dt


def model_path(args: argparse.Namespace) -> str:
    from auxout.testing.models import build_sized_moe, build_tiny_moe

    return build_tiny_moe(args.arch) if args.size == "tiny" else build_sized_moe(args.size)


def child(args: argparse.Namespace) -> None:
    """One engine alone in this process: prints the median of ``args.separate`` batches."""
    llm = make_engine(model_path(args), args.child == "on", args)
    run_once(llm, args, -1)  # warm-up
    rates = [run_once(llm, args, rep) for rep in range(args.separate)]
    print(f"THROUGHPUT {statistics.median(rates):.1f}")


def separate(args: argparse.Namespace) -> int:
    """Alternate one-engine processes (on/off, then off/on) and report the median pair ratio."""
    import subprocess
    import sys

    def one(side: str) -> float:
        cmd = [sys.executable, __file__, "--child", side, "--separate", str(args.separate)] + [
            f"--{k}={v}" for k in ("arch", "size", "batch", "prompt", "gen") for v in [getattr(args, k)]
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("THROUGHPUT ")]
        if done.returncode or not lines:
            raise RuntimeError(f"the routes-{side} process failed:\n{done.stderr[-3000:]}")
        return float(lines[-1].split()[1])

    ratios = []
    for rep in range(args.pairs):
        if rep % 2:
            b, a = one("off"), one("on")
        else:
            a, b = one("on"), one("off")
        ratios.append(a / b)
        print(f"pair {rep}: on {a:.0f} tok/s, off {b:.0f} tok/s, ratio {a / b:.3f}", flush=True)
    target = 0.97 if args.size == "tiny" else 0.99
    print(f"throughput ratio (on/off, median of pairs, one engine per process): {statistics.median(ratios):.3f}  (target >= {target})")
    return 0


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The model and batch every engine benchmark here runs (the same defaults everywhere)."""
    p.add_argument("--arch", default="qwen3_moe")
    p.add_argument("--size", default="tiny", help="tiny, or a preset of auxout.testing.models.SIZES (qwen3_moe)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument(
        "--async-scheduling", action="store_true",
        help="ask for vLLM's async scheduler (vLLM-CPU's platform hook turns it off again: no effect on CPU)",
    )  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="cProfile the routes-on runs (in-process engine)")
    p.add_argument("--separate", type=int, default=0, metavar="N", help="one engine per process, N batches each")
    p.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.child:
        child(args)
        return 0
    if args.separate:
        return separate(args)
    if args.profile:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    path = model_path(args)
    on = make_engine(path, True, args)
    off = make_engine(path, False, args)
    run_once(on, args, -1)  # warm-up both
    run_once(off, args, -1)
    ratios, t_on, t_off = [], [], []
    for rep in range(args.pairs):
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            a = run_once(on, args, rep)
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats("auxout", 25)
            b = run_once(off, args, rep)
        elif rep % 2:  # (odd pairs run the plain engine first: a drift within a pair cancels out)
            b = run_once(off, args, rep)
            a = run_once(on, args, rep)
        else:
            a = run_once(on, args, rep)
            b = run_once(off, args, rep)
        t_on.append(a)
        t_off.append(b)
        ratios.append(a / b)
        print(f"pair {rep}: on {a:.0f} tok/s, off {b:.0f} tok/s, ratio {a / b:.3f}")
    print(f"median throughput on {statistics.median(t_on):.0f} tok/s, off {statistics.median(t_off):.0f} tok/s")
    target = 0.97 if args.size == "tiny" else 0.99
    print(f"throughput ratio (on/off, median of pairs): {statistics.median(ratios):.3f}  (target >= {target})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
