"""Routes on vs off inside ONE engine: auxout switched off and on between batches, same processes.

``engine_overhead.py`` compares two engines (two sets of processes), and on a shared 2-core
machine two processes differ in speed by more than the few percent being measured (its pairs
moved 0.84-0.99 within an hour). Here one routes-on engine runs every batch; before a batch the
parent flips one byte in a shared file, and every engine process reads it at the start of each
step. Off means plain vLLM: the scheduler's ``aux_output_connector`` is None (vLLM then builds no
metadata and takes no routes), auxout's scheduler and worker overrides call straight through to
vLLM's, and the routers' capture functions are unset. Requests, prompts and memory are the same
in both modes; the flag is only flipped while the engine is idle, so no request sees both.

Each cycle runs on, off, off, on (two on/off pairs, the order alternating) and also yields an
off/off and an on/on pair: their spread is this instrument's own noise, printed beside the
ratio. What "off" still runs: one extra Python call per overridden hook (the switch) and the
frontend's per-request option check (per request, not per step).

``--phases`` also times vLLM's four phases (and auxout's overrides around them) in the engine
processes, per mode: the same phase of the same engine with routes on and off, which shows
where the throughput goes, including what auxout's work does to vLLM's own code (the forward
runs slower with routes on although nothing in it changed). ``--off-mode capture`` keeps the
routers' capture bound while off, so on/off is the connectors' cost alone.

    python benchmarks/toggle_overhead.py                  # tiny qwen3_moe, mp executor, 12 cycles
    python benchmarks/toggle_overhead.py --cycles 30 --executor uni
    python benchmarks/toggle_overhead.py --size realistic --gen 64 --cycles 10   # 20 on/off pairs, bootstrap CI
    python benchmarks/toggle_overhead.py --cycles 10 --phases [--off-mode capture]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
_FLAG_ENV = "AUXOUT_TOGGLE_FLAG"  # the one-byte file: b"1" routes on, b"0" off
_SITE = """import os, sys
if os.environ.get({env!r}):
    sys.path.insert(0, {here!r})
    import toggle_overhead
    toggle_overhead.install_switch()
"""


def bootstrap_median_ci(xs: list[float], rounds: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``xs`` (resampled with replacement)."""
    import numpy as np

    a = np.asarray(xs, dtype=np.float64)
    if a.size < 2:
        return float(a[0]), float(a[0])
    idx = np.random.default_rng(seed).integers(0, a.size, size=(rounds, a.size))
    medians = np.median(a[idx], axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def install_switch() -> None:
    """Make auxout's vLLM classes follow the flag file (in each engine process, from sitecustomize)."""
    from auxout.vllm.engine_core.scheduler import AuxoutScheduler
    from auxout.vllm.workers.worker import AuxoutWorkerMixin

    with open(os.environ[_FLAG_ENV], "r+b") as f:
        flag = mmap.mmap(f.fileno(), 1)

    def on() -> bool:
        return flag[0] == ord("1")

    def bound() -> bool:  # the routers' capture: on, or off with --off-mode capture (b"2")
        return flag[0] != ord("0")

    # -- worker: straight to vLLM's worker, and the routers' capture unset, while off ----------
    mixin = AuxoutWorkerMixin
    execute, sample = mixin.execute_model, mixin.sample_tokens

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        now, capture = on(), bound()
        cap = self._auxout_capture
        if capture != self.__dict__.get("_toggle_bound_now", True) and cap is not None:
            if capture:
                cap.bind(*self._toggle_bound)
            else:
                self._toggle_bound = (cap._routers, cap.columns)
                cap.unbind()
        self._toggle_bound_now = capture
        self._toggle_on = now
        if now:
            return execute(self, scheduler_output, *args, **kwargs)
        return super(mixin, self).execute_model(scheduler_output, *args, **kwargs)

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_toggle_on", True):
            return sample(self, *args, **kwargs)
        return super(mixin, self).sample_tokens(*args, **kwargs)

    mixin.execute_model, mixin.sample_tokens = execute_model, sample_tokens  # type: ignore[method-assign]

    # -- engine core: no aux_output_connector and vLLM's own methods, while off ----------------
    sched = AuxoutScheduler
    originals = {
        name: getattr(sched, name) for name in ("add_request", "update_from_output", "_get_local_prefix_cache_hit")
    }

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.aux_output_connector = self.auxout if on() else None
        return super(sched, self).schedule(*args, **kwargs)

    def switched(name: str) -> Any:
        original = originals[name]

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if on():
                return original(self, *args, **kwargs)
            return getattr(super(sched, self), name)(*args, **kwargs)

        return method

    sched.schedule = schedule  # type: ignore[method-assign]
    for name in originals:
        setattr(sched, name, switched(name))
    if os.environ.get(_PHASES_ENV):
        time_phases(on)


_PHASES_ENV = "AUXOUT_TOGGLE_PHASES"  # --phases: where each engine process writes its phase timings
_PHASES = (  # (class path, method, label): vLLM's own phases, and auxout's overrides around them
    ("vllm.v1.core.sched.scheduler:Scheduler", "schedule", "vLLM Scheduler.schedule"),
    ("vllm.v1.core.sched.scheduler:Scheduler", "update_from_output", "vLLM Scheduler.update_from_output"),
    ("vllm.v1.worker.cpu_worker:CPUWorker", "execute_model", "vLLM CPUWorker.execute_model (forward)"),
    ("vllm.v1.worker.cpu_worker:CPUWorker", "sample_tokens", "vLLM CPUWorker.sample_tokens"),
    ("auxout.vllm.engine_core.scheduler:AuxoutScheduler", "update_from_output", "auxout+vLLM update_from_output"),
    ("auxout.vllm.workers.worker:AuxoutWorkerMixin", "execute_model", "auxout+vLLM execute_model"),
    ("auxout.vllm.workers.worker:AuxoutWorkerMixin", "sample_tokens", "auxout+vLLM sample_tokens"),
)


def time_phases(on: Any) -> None:
    """--phases: time vLLM's phases (and the overrides around them) per mode, in this process.

    Shows whether auxout's cost is all in its own code or also makes vLLM's code slower (caches,
    allocator): the same phase, same engine, on against off."""
    import atexit
    import importlib
    import json
    import time

    times: dict[str, list[float]] = {}
    last = [""]
    inside = [0]  # timed phases running (a collection counts only inside one: start-up and exit are not steps)

    written: dict[str, int] = {}

    def dump() -> None:  # (appends only what came since the last dump: a line of JSON each)
        new = {k: v[written.get(k, 0) :] for k, v in times.items() if len(v) > written.get(k, 0)}
        if new:
            written.update((k, len(v)) for k, v in times.items())
            with open(f"{os.environ[_PHASES_ENV]}.{os.getpid()}.json", "a") as f:
                f.write(json.dumps(new) + "\n")

    def wrap(cls: Any, name: str, label: str) -> None:
        func = getattr(cls, name)

        split = "(forward)" in label  # (a step with a prefill chunk vs a decode-only step)

        def timed(*args: Any, **kwargs: Any) -> Any:
            mode = "on" if on() else "off"
            if mode != last[0]:  # (the flag flips only between batches: write what came so far, untimed)
                last[0] = mode
                dump()
            key = f"{mode}|{label}"
            if split:
                counts = getattr(args[1], "num_scheduled_tokens", None) or {}
                key += ", prefill steps" if max(counts.values(), default=0) > 1 else ", decode steps"
            t0 = time.perf_counter()
            inside[0] += 1
            try:
                return func(*args, **kwargs)
            finally:
                inside[0] -= 1
                times.setdefault(key, []).append(time.perf_counter() - t0)

        setattr(cls, name, timed)

    for where, name, label in _PHASES:
        module, cls = where.split(":")
        wrap(getattr(importlib.import_module(module), cls), name, label)

    import gc

    import setproctitle  # (vLLM names its engine processes with it, once they start)

    started = [0.0]

    def collection(phase: str, info: dict[str, int]) -> None:  # every garbage collection in a step, per mode
        if not inside[0]:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            title = setproctitle.getproctitle()
            proc = title.split("::", 1)[1] if "::" in title else "front-end (LLM)"
            key = f"{'on' if on() else 'off'}|gc gen{info['generation']} {proc}"
            times.setdefault(key, []).append(time.perf_counter() - started[0])
            times.setdefault(f"{key} collected", []).append(info["collected"])

    gc.callbacks.append(collection)
    atexit.register(dump)


def print_phases(prefix: str) -> None:
    """Per phase: the median call with routes on and off, and on - off in us per step."""
    import glob
    import json

    times: dict[str, list[float]] = {}
    for path in glob.glob(prefix + ".*.json"):
        with open(path) as f:
            for line in f:
                for key, ts in json.loads(line).items():
                    times.setdefault(key, []).extend(ts)
    if not times:
        print("no phase timings came back (did the engine processes exit?)")
        return
    print(
        f"  {'phase':<56} {'median on':>10} {'median off':>10} {'on-off':>8} {'mean on-off':>12} "
        f"{'p90 on-off':>11} {'p99 on-off':>11} {'calls on/off':>13}"
    )
    order = [p[2] for p in _PHASES]
    phases = {key.split("|", 1)[1] for key in times if "|gc " not in key}
    labels = sorted(phases, key=lambda k: order.index(k.split(",")[0]))
    for label in labels:
        on, off = times.get(f"on|{label}", []), times.get(f"off|{label}", [])
        if len(on) < 2 or len(off) < 2:
            continue
        m_on, m_off = statistics.median(on) * 1e6, statistics.median(off) * 1e6
        mean_diff = (statistics.fmean(on) - statistics.fmean(off)) * 1e6
        q_on, q_off = statistics.quantiles(on, n=100), statistics.quantiles(off, n=100)
        print(
            f"  {label:<56} {m_on:9.1f}us {m_off:9.1f}us {m_on - m_off:7.1f}us {mean_diff:11.1f}us "
            f"{(q_on[89] - q_off[89]) * 1e6:10.1f}us {(q_on[98] - q_off[98]) * 1e6:10.1f}us {len(on):6d}/{len(off)}"
        )
    steps = {m: len(times.get(f"{m}|{_PHASES[0][2]}", [])) or 1 for m in ("on", "off")}  # schedule calls
    collections = {key.split("|", 1)[1] for key in times if "|gc " in key and not key.endswith("collected")}
    for label in sorted(collections):
        on, off = times.get(f"on|{label}", []), times.get(f"off|{label}", [])
        got = [sum(times.get(f"{m}|{label} collected", [])) for m in ("on", "off")]
        print(  # garbage collections per process, per scheduled step of each mode
            f"  {label}: {len(on)} / {len(off)} collections on/off ({len(on) / steps['on']:.3f} / "
            f"{len(off) / steps['off']:.3f} per step), {sum(on) * 1e6 / steps['on']:.1f} / "
            f"{sum(off) * 1e6 / steps['off']:.1f} us per step, longest {max(on, default=0) * 1e3:.1f} / "
            f"{max(off, default=0) * 1e3:.1f} ms, {got[0]:.0f} / {got[1]:.0f} objects freed"
        )


def pin_front_end() -> None:
    """--pin: keep this process and the engine core off the CPUs vLLM bound its workers to.

    vLLM-CPU binds each worker to its cores and reserves the rest for the front end and the engine
    core, but leaves those two free to run on the worker's cores too."""
    import psutil

    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
    everything = set(os.sched_getaffinity(0))
    bound = {p.pid: set(p.cpu_affinity()) for p in procs}
    workers = set().union(*(cpus for cpus in bound.values() if cpus != everything))
    rest = everything - workers
    if not workers or not rest:
        raise SystemExit(f"--pin: no CPU left beside the workers' {sorted(workers)} of {sorted(everything)}")
    for p in procs:
        if bound[p.pid] == everything:
            for t in p.threads():  # (affinity is per thread: the ones already running keep theirs)
                os.sched_setaffinity(t.id, rest)
    print(f"pinned the front end and engine core to CPUs {sorted(rest)}; workers on {sorted(workers)}")


def measure(args: argparse.Namespace) -> int:
    """In the process with the switch installed: the cycles, then the ratios."""
    from engine_overhead import make_engine, model_path, run_once

    with open(os.environ[_FLAG_ENV], "r+b") as f:
        flag = mmap.mmap(f.fileno(), 1)

    off = ord("2" if args.off_mode == "capture" else "0")

    def batch(routes: bool, rep: int) -> float:
        flag[0] = ord("1") if routes else off
        return run_once(llm, args, rep)

    llm = make_engine(model_path(args), True, args)
    if args.pin:
        pin_front_end()
    batch(True, -1)  # warm-up, both modes
    batch(False, -2)
    for routes in (True, False, True):  # the switch works both ways: routes only while on
        from vllm import SamplingParams

        flag[0] = ord("1" if routes else "0")
        out = llm.generate([{"prompt_token_ids": [5, 6, 7] * 20}], SamplingParams(max_tokens=4), use_tqdm=False)
        got = getattr(out[0].outputs[0], "routed_experts", None)
        if (got is not None) != routes:
            raise SystemExit(f"the switch failed: routes {'missing' if routes else 'returned'} with routes {routes}")
    on_off: list[float] = []
    off_off: list[float] = []
    on_on: list[float] = []
    rates: dict[bool, list[float]] = {True: [], False: []}
    for c in range(args.cycles):
        a, b, d, e = batch(True, 4 * c), batch(False, 4 * c + 1), batch(False, 4 * c + 2), batch(True, 4 * c + 3)
        on_off += [a / b, e / d]
        off_off.append(b / d)
        on_on.append(a / e)
        rates[True] += [a, e]
        rates[False] += [b, d]
        print(f"cycle {c}: on {a:.0f}, off {b:.0f}, off {d:.0f}, on {e:.0f} tok/s; on/off {a / b:.3f} {e / d:.3f}")
    flag[0] = ord("1")

    def spread(xs: list[float]) -> str:
        qs = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        lo, hi = bootstrap_median_ci(xs)
        return (f"median {statistics.median(xs):.3f} [95% bootstrap CI {lo:.3f}..{hi:.3f}; quartiles "
                f"{qs[0]:.3f}..{qs[2]:.3f}] over {len(xs)}")

    print(f"median throughput on {statistics.median(rates[True]):.0f} tok/s, off {statistics.median(rates[False]):.0f}")
    print(f"control off/off: {spread(off_off)}; on/on: {spread(on_on)}")
    target = 0.97 if args.size == "tiny" else 0.99
    print(f"throughput ratio on/off (one engine, toggled): {spread(on_off)}  (target >= {target})")
    print(f"  ratio of summed rates: {sum(rates[True]) / sum(rates[False]):.4f}")
    if os.environ.get(_PHASES_ENV):
        llm.llm_engine.engine_core.shutdown()  # (the engine's processes write their timings at exit)
        print_phases(os.environ[_PHASES_ENV])
    return 0


def main() -> int:
    from engine_overhead import add_workload_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--cycles", type=int, default=12, help="on, off, off, on: two on/off pairs each")
    p.add_argument("--executor", choices=("mp", "uni"), default="mp", help="uni: the engine in this process")
    p.add_argument(
        "--off-mode", choices=("plain", "capture"), default="plain",
        help="capture: 'off' keeps the routers' capture bound (then on/off is the connectors' cost alone)",
    )  # fmt: skip
    p.add_argument("--pin", action="store_true", help="keep the front end and engine core off the workers' CPUs")
    p.add_argument("--phases", action="store_true", help="also time vLLM's phases per mode (timers add their own cost)")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.executor == "uni":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if _FLAG_ENV in os.environ:
        sys.path.insert(0, HERE)
        return measure(args)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:  # (the engine's processes start with it)
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(_SITE.format(env=_FLAG_ENV, here=HERE))
        with open(os.path.join(tmp, "flag"), "wb") as f:
            f.write(b"1")
        path = os.pathsep.join(x for x in (tmp, os.environ.get("PYTHONPATH")) if x)
        env = {**os.environ, _FLAG_ENV: os.path.join(tmp, "flag"), "PYTHONPATH": path}
        if args.phases:
            env[_PHASES_ENV] = os.path.join(tmp, "phases")
        return subprocess.run([sys.executable, *sys.argv], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
