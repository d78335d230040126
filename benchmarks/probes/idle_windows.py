"""Where in a plain vLLM step is per-step work free? The same synthetic work placed in each window.

auxout's remaining cost on the tiny model is per-step Python work on the critical path of a
synchronous engine step (docs/performance.md). A redesign would move it into a window where a
process is otherwise idle: the engine core waits while the worker runs the forward and sampling,
and the worker waits while the engine core updates and schedules. Whether those windows really
absorb work (one core each? the GIL of a worker whose main thread spins on vLLM's message queue?)
is measured here before anything is built: ONE engine without routes, the same fixed amount of
work (a calibrated loop of small numpy and dict operations, about auxout's per-step cost) placed
by a flag byte, switched between batches like ``toggle_overhead.py``:

- ``none``: nothing (the baseline of every ratio);
- ``worker``: at the end of the worker's ``sample_tokens`` (where auxout's worker work runs now);
- ``worker-thread``: handed to a thread of the worker at the end of ``sample_tokens``, so it runs
  while the worker waits for the next step (the engine core's update and schedule);
- ``core``: at the end of the engine core's ``update_from_output`` (where auxout's runs now);
- ``core-window``: in the engine core's ``get_grammar_bitmask``, which vLLM calls after sending
  the step to the worker and before waiting for it (the forward's window).

    python benchmarks/probes/idle_windows.py --cycles 6 --work-us 150
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
_FLAG_ENV = "AUXOUT_IDLE_FLAG"
_ITERS_ENV = "AUXOUT_IDLE_ITERS"
MODES = {"none": "0", "worker": "w", "worker-thread": "t", "core": "c", "core-window": "g"}
_SITE = """import os, sys
if os.environ.get({env!r}):
    sys.path.insert(0, {here!r})
    import idle_windows
    idle_windows.install()
"""


def work(iters: int) -> int:
    """A fixed amount of the kind of work auxout does per step: small numpy calls and dict updates."""
    import numpy as np

    a = np.arange(64, dtype=np.int64)
    d: dict[int, int] = {}
    s = 0
    for i in range(iters):
        b = a[i % 32 : i % 32 + 16] + i
        d[i & 63] = int(b.sum())
        s += len(d)
    return s


def calibrate(us: float) -> int:
    """Iterations of ``work`` that take about ``us`` microseconds here (warm, alone)."""
    n = 200
    work(n)
    t = time.perf_counter()
    for _ in range(20):
        work(n)
    per = (time.perf_counter() - t) / (20 * n)
    return max(1, round(us * 1e-6 / per))


def install() -> None:
    """In each engine process (from sitecustomize): the work, where the flag puts it."""
    import queue
    import threading

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_worker import CPUWorker

    with open(os.environ[_FLAG_ENV], "r+b") as f:
        flag = mmap.mmap(f.fileno(), 1)
    iters = int(os.environ[_ITERS_ENV])
    jobs: queue.SimpleQueue[int] = queue.SimpleQueue()

    def worker_thread() -> None:
        while True:
            jobs.get()
            work(iters)

    started: list[threading.Thread] = []
    sample = CPUWorker.sample_tokens

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = sample(self, *args, **kwargs)
        mode = chr(flag[0])
        if mode == "w":
            work(iters)
        elif mode == "t":
            if not started:  # (created here: it inherits the worker's CPU binding)
                started.append(threading.Thread(target=worker_thread, daemon=True, name="idle-work"))
                started[0].start()
            jobs.put(1)
        return out

    CPUWorker.sample_tokens = sample_tokens  # type: ignore[method-assign]
    update, grammar = Scheduler.update_from_output, Scheduler.get_grammar_bitmask

    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = update(self, *args, **kwargs)
        if chr(flag[0]) == "c":
            work(iters)
        return out

    def get_grammar_bitmask(self: Any, *args: Any, **kwargs: Any) -> Any:
        if chr(flag[0]) == "g":
            work(iters)
        return grammar(self, *args, **kwargs)

    Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]
    Scheduler.get_grammar_bitmask = get_grammar_bitmask  # type: ignore[method-assign]


def measure(args: argparse.Namespace) -> int:
    from engine_overhead import make_engine, model_path, run_once

    with open(os.environ[_FLAG_ENV], "r+b") as f:
        flag = mmap.mmap(f.fileno(), 1)
    llm = make_engine(model_path(args), False, args)
    names = list(MODES)

    def batch(name: str, rep: int) -> float:
        flag[0] = ord(MODES[name])
        return run_once(llm, args, rep)

    for name in names:  # warm-up, every mode
        batch(name, -1 - names.index(name))
    ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    controls: list[float] = []
    for c in range(args.cycles):
        order = names[1:] if c % 2 == 0 else names[:0:-1]
        base = batch("none", 100 * c)
        row = []
        for i, name in enumerate(order):
            r = batch(name, 100 * c + 1 + i)
            ratios[name].append(r / base)
            row.append(f"{name} {r / base:.3f}")
        end = batch("none", 100 * c + 99)
        controls.append(end / base)
        print(f"cycle {c}: none {base:.0f} tok/s; " + ", ".join(row) + f"; none again {end / base:.3f}")
    print(f"work per step: {args.work_us:.0f} us alone (calibrated), {int(os.environ[_ITERS_ENV])} iterations")
    print(f"control none/none: median {statistics.median(controls):.3f}")
    for name, xs in ratios.items():
        qs = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        print(f"  {name:<14} throughput / none: median {statistics.median(xs):.3f} [{qs[0]:.3f}..{qs[2]:.3f}]")
    return 0


def main() -> int:
    sys.path.insert(0, os.path.dirname(HERE))  # engine_overhead.py, one folder up
    from engine_overhead import add_workload_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--cycles", type=int, default=6)
    p.add_argument("--work-us", type=float, default=150.0, help="the work per step, timed alone")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if _FLAG_ENV in os.environ:
        sys.path.insert(0, HERE)
        return measure(args)
    iters = calibrate(args.work_us)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(_SITE.format(env=_FLAG_ENV, here=HERE))
        with open(os.path.join(tmp, "flag"), "wb") as f:
            f.write(b"0")
        path = os.pathsep.join(x for x in (tmp, os.environ.get("PYTHONPATH")) if x)
        env = {**os.environ, _FLAG_ENV: os.path.join(tmp, "flag"), _ITERS_ENV: str(iters), "PYTHONPATH": path}
        return subprocess.run([sys.executable, *sys.argv], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
