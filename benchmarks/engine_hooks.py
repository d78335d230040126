"""Per-step time inside each auxout hook of a routes-on vLLM engine, beside vLLM's own phases.

``engine_overhead.py`` measures the throughput ratio, which on a shared 2-core machine moves by
±10% between pairs; a sampling profile attributes it only statistically. This script times the
hooks themselves: it wraps auxout's connector and bridge calls and vLLM's scheduler and worker
phases with ``time.perf_counter`` and runs the engine in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the ``uni`` executor), so every hook runs where it is timed. Prints microseconds per engine step
(a run's steps: one prefill, then decode) and the median and worst single call of the hot hooks,
then one summary line: auxout's hooks against vLLM's four phases, each as median call × calls per
step (the steady decode step, without the rare slow calls; the line compares two versions).

    python benchmarks/engine_hooks.py              # tiny qwen3_moe, routes on, then a routes-off engine
    python benchmarks/engine_hooks.py --only on
    python benchmarks/engine_hooks.py --size realistic --gen 64 --runs 3   # 16 layers, 64 experts
    python benchmarks/engine_hooks.py --executor mp    # vLLM-CPU's default: engine core + worker process

``--executor mp`` runs the engine as ``auxout serve`` and ``engine_overhead.py`` do: the engine
core and the worker in processes of their own, every step's ``StepMetadata`` and ``StepOutput``
pickled between them (their ``__reduce__``/``__getstate__``/``__setstate__`` are timed too). The
hooks are installed in those processes by a ``sitecustomize`` module this script writes to a
temporary directory on their ``PYTHONPATH``; each process appends its timings to a file.

The routes-off engine runs in a fresh process (one engine per process keeps each step's memory
and threads as in a real server); its forward time varies by ±20% between runs on a shared
machine, so read auxout's cost from the hook rows, not from the difference of the two totals.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from typing import Any

TIMES: dict[str, list[float]] = {}
STARTS: dict[str, list[float]] = {}  # (mp: each call's start, to drop the warm-up's calls)
ON_CALL: list[Any] = []  # (mp: what each outermost timed call runs after it, in that process)
_DEPTH = [0]  # timed calls in progress (they nest: auxout's hooks run inside vLLM's phases)
_CONTEXT = [""]  # appended to the labels of calls nested in a timed call that names a context
AFTER_SEND = " [after the send]"  # the worker's calls run once a step's output was sent: off the clock
_OUT_ENV = "AUXOUT_ENGINE_HOOKS_OUT"  # mp: where each process writes its timings
_SITE = """import os, sys
if os.environ.get({env!r}):
    sys.path.insert(0, {here!r})
    import engine_hooks
    engine_hooks.install_in_process()
"""


def timed(cls: Any, name: str, label: str, context: str = "") -> None:
    """Wrap ``cls.name`` so every call's wall time lands in ``TIMES[label]`` (``label`` plus the
    enclosing timed call's ``context``, if any: the same hook, where it runs off the clock)."""
    func = getattr(cls, name)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _DEPTH[0] += 1
        outer = _CONTEXT[0]
        where = label + outer
        if context:
            _CONTEXT[0] = context
        t0 = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            TIMES.setdefault(where, []).append(time.perf_counter() - t0)
            STARTS.setdefault(where, []).append(t0)
            _CONTEXT[0] = outer
            _DEPTH[0] -= 1
            if ON_CALL and not _DEPTH[0]:  # (outside every timed call: a dump is nobody's time)
                ON_CALL[0]()

    setattr(cls, name, wrapper)


def install_in_process() -> None:
    """mp: time the hooks of this (engine core or worker) process; its timings go to a file
    every 500 timed calls and at exit (perf_counter is the system's monotonic clock on Linux,
    so the parent can drop the warm-up's calls by their start)."""
    import atexit
    import json

    out = f"{os.environ[_OUT_ENV]}.{os.getpid()}.json"
    instrument(True)
    from auxout.connector.messages import StepMetadata, StepOutput

    timed(StepOutput, "__getstate__", "auxout StepOutput.__getstate__ (worker: pickle)")
    timed(StepOutput, "__setstate__", "auxout StepOutput.__setstate__ (engine core: unpickle)")
    timed(StepMetadata, "__reduce__", "auxout StepMetadata.__reduce__ (engine core: pickle)")
    calls = [0]
    written: dict[str, int] = {}

    def dump() -> None:  # (appends only the calls not written yet: a line of JSON per dump)
        new = {k: (v[written.get(k, 0) :], STARTS[k][written.get(k, 0) :]) for k, v in TIMES.items()}
        written.update((k, len(v)) for k, v in TIMES.items())
        with open(out, "a") as f:
            f.write(json.dumps(new) + "\n")

    def every_call() -> None:
        calls[0] += 1
        if calls[0] % 500 == 0:
            dump()

    ON_CALL.append(every_call)
    atexit.register(dump)


def instrument(routes: bool) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_worker import CPUWorker

    timed(Scheduler, "schedule", "vLLM Scheduler.schedule")
    timed(Scheduler, "update_from_output", "vLLM Scheduler.update_from_output")
    timed(CPUWorker, "execute_model", "vLLM CPUWorker.execute_model (forward)")
    timed(CPUWorker, "sample_tokens", "vLLM CPUWorker.sample_tokens")
    if not routes:
        return
    from auxout.connector.worker import WorkerConnector
    from auxout.vllm.engine_core import scheduler
    from auxout.vllm.workers import capture, worker

    timed(worker.AuxoutWorkerMixin, "execute_model", "auxout execute_model wrapper (total)")
    timed(worker.AuxoutWorkerMixin, "sample_tokens", "auxout sample_tokens wrapper (total)")
    timed(worker.AuxoutWorkerMixin, "_auxout_commit", "auxout _auxout_commit")
    # a steady decode step sent ahead: the prediction runs before the send, the connector after
    timed(worker.AuxoutWorkerMixin, "_auxout_send_first", "auxout _auxout_send_first (total)")
    timed(worker.AuxoutWorkerMixin, "_auxout_settle_sent", "auxout _auxout_settle_sent (total)", AFTER_SEND)
    for name in ("begin_step", "prepare_output", "process_output", "peek_lane_step", "commit_lane_step"):
        timed(WorkerConnector, name, f"auxout WorkerConnector.{name}")
    timed(capture.RouteCapture, "_capture", "auxout RouteCapture._capture (device path: per MoE layer, in the forward)")
    timed(capture.RouteCapture, "_copy_held", "auxout RouteCapture._copy_held (host path: every layer, in snapshot)")
    timed(capture.RouteCapture, "snapshot", "auxout RouteCapture.snapshot")
    for name in ("build_connector_meta", "take_output", "end_step_output", "collects", "settle_collected"):
        timed(scheduler.SchedulerBridge, name, f"auxout SchedulerBridge.{name}")


def run(args: argparse.Namespace, routes: bool) -> None:
    mp = args.executor == "mp"
    if mp and _OUT_ENV not in os.environ:  # (the engine's processes must start with the hooks)
        import tempfile

        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:  # (late exits may still write)
            with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
                f.write(_SITE.format(env=_OUT_ENV, here=os.path.dirname(os.path.abspath(__file__))))
            path = os.pathsep.join(p for p in (tmp, os.environ.get("PYTHONPATH")) if p)
            env = {**os.environ, _OUT_ENV: os.path.join(tmp, "times"), "PYTHONPATH": path}
            subprocess.run([sys.executable, *sys.argv], env=env, check=True)
        return
    if not mp:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import numpy as np
    from vllm import LLM, SamplingParams

    from auxout.testing.models import build_sized_moe, build_tiny_moe
    from auxout.vllm import engine_kwargs

    if not mp:
        instrument(routes)
    extra = engine_kwargs() if routes else {"enable_prefix_caching": True}
    model = build_tiny_moe(args.arch) if args.size == "tiny" else build_sized_moe(args.size)
    llm = LLM(
        model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        block_size=32, max_model_len=2048, seed=0, max_num_seqs=args.batch, disable_log_stats=True,
        distributed_executor_backend="mp" if mp else "uni", **extra,
    )  # fmt: skip
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True, detokenize=False)

    def one(rep: int) -> float:
        rng = np.random.default_rng(1000 + rep)  # fresh prompts: no prefix hits across runs
        prompts = [{"prompt_token_ids": rng.integers(3, 1000, size=args.prompt).tolist()} for _ in range(args.batch)]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    one(-1)  # warm-up
    TIMES.clear()
    t_warm = time.perf_counter()
    walls = [one(rep) for rep in range(args.runs)]
    if mp:
        llm.llm_engine.engine_core.shutdown()  # (the engine's processes write their timings at exit)
        _collect(os.environ[_OUT_ENV], t_warm)
    steps = len(TIMES["vLLM Scheduler.schedule"])
    print(
        f"\n== routes {'on' if routes else 'off'}: {args.runs} runs of {args.batch} requests x "
        f"{args.prompt} prompt + {args.gen} generated tokens; {steps // args.runs} steps per run, "
        f"run median {statistics.median(walls) * 1e3:.0f} ms ({statistics.median(walls) / (steps / args.runs) * 1e6:.0f} us/step)"
    )
    print(f"  {'us/step':>9} {'calls/step':>10} {'median call':>12} {'worst call':>11}  hook")
    for label, ts in sorted(TIMES.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"  {sum(ts) / steps * 1e6:9.1f} {len(ts) / steps:10.2f} {statistics.median(ts) * 1e6:10.1f}us "
            f"{max(ts) * 1e6:9.0f}us  {label}"
        )
    if args.worst and STARTS:
        worst(args.worst, steps // args.runs)
    if routes:
        hooks, phases = summary()
        print(f"auxout's hooks, median call x calls per step: {hooks:.1f} us = {100 * hooks / phases:.2f}% of vLLM's phases ({phases:.0f} us)")


def worst(n: int, steps_per_run: int) -> None:
    """The ``n`` slowest calls of each auxout hook, with the step of its run they fell in (0: the
    prefill), found by their start against the scheduler's (one clock for every process on Linux)."""
    import bisect

    sched = sorted(STARTS["vLLM Scheduler.schedule"])
    print(f"  slowest calls (step of the run: 0 is the prefill, {steps_per_run - 1} the last)")
    for label, ts in sorted(TIMES.items(), key=lambda kv: -sum(kv[1])):
        if not label.startswith("auxout") or "(total)" in label:
            continue
        calls = sorted(zip(ts, STARTS[label]), reverse=True)[:n]
        where = [(t, (bisect.bisect_right(sched, t0) - 1) % steps_per_run) for t, t0 in calls]
        print(f"    {label}: " + ", ".join(f"{t * 1e6:.0f}us@{step}" for t, step in where))


_NESTED = ("(total)", "process_output", "_copy_held", AFTER_SEND)
"""Wrappers, hooks timed inside another auxout hook, and calls run after the step's output was sent."""


def summary() -> tuple[float, float]:
    """(auxout's hooks, vLLM's four phases) per step, each as median call x calls per step: the
    steady decode step's cost, without the few slow calls (a block's store write, the prefill).
    The connector's calls for a step whose output was sent ahead are left out: they run while the
    engine core works, not on the step's critical path."""
    steps = len(TIMES["vLLM Scheduler.schedule"])

    def typical(ts: list[float]) -> float:
        return statistics.median(ts) * len(ts) / steps * 1e6

    hooks = sum(typical(ts) for label, ts in TIMES.items() if label.startswith("auxout") and not any(
        n in label for n in _NESTED))
    phases = sum(typical(ts) for label, ts in TIMES.items() if label.startswith("vLLM"))
    return hooks, phases


def _collect(prefix: str, since: float) -> None:
    """mp: the timings the engine's processes wrote, without the calls made before ``since``."""
    import glob
    import json

    TIMES.clear()
    STARTS.clear()
    for path in glob.glob(prefix + ".*.json"):
        with open(path) as f:
            for line in f:
                for label, (times, starts) in json.loads(line).items():
                    kept = [(t, t0) for t, t0 in zip(times, starts) if t0 >= since]
                    if kept:
                        TIMES.setdefault(label, []).extend(t for t, _ in kept)
                        STARTS.setdefault(label, []).extend(t0 for _, t0 in kept)


def main() -> int:
    from engine_overhead import add_workload_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_workload_args(ap)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", choices=("on", "off"))
    ap.add_argument("--executor", choices=("uni", "mp"), default="uni", help="uni: one process; mp: vLLM-CPU's default")
    ap.add_argument("--worst", type=int, default=0, help="also print each hook's N slowest calls and their steps")
    args = ap.parse_args()
    if args.only:
        run(args, args.only == "on")
        return 0
    for side in ("on", "off"):  # one engine per process
        cmd = [sys.executable, __file__, "--only", side] + [
            f"--{k}={v}" for k, v in vars(args).items() if k != "only"
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        report = done.stdout[done.stdout.find("\n== routes") :] if "\n== routes" in done.stdout else done.stdout
        print(report.rstrip() if done.returncode == 0 else f"routes {side} failed:\n{done.stderr[-3000:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
