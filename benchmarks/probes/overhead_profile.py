"""Where does routes-on time go? auxout's share of a sampling profile of the engine processes.

Record ``benchmarks/engine_overhead.py`` under py-spy (it samples every process, native frames
off, idle threads excluded), then read the collapsed stacks::

    py-spy record --subprocesses --rate 250 --format raw -o /tmp/overhead.txt -- \\
        python benchmarks/engine_overhead.py --pairs 3
    python benchmarks/probes/overhead_profile.py /tmp/overhead.txt

For each process it prints the busy samples, the samples with an auxout frame on the stack,
the samples spent in auxout's own code (the deepest auxout frame on the stack is not a wrapper
calling back into vLLM: auxout's Python plus the numpy/torch calls it makes), and the auxout
functions that own them, with the leaf where the time went. ``--steps-only`` keeps the steady
state (stacks inside ``EngineCore.step`` or a worker's ``execute_model``/``sample_tokens``). The routes-on and routes-off engine-core
processes run the same workload, so their busy-sample difference is the whole overhead,
and the auxout share says how much of it is auxout's own code.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

_STEP = re.compile(r"^(EngineCore\.step|\w*Worker\w*\.(execute_model|sample_tokens)) \(")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+?)(?::(?P<line>\d+))?\)$")


def short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    for anchor in ("auxout/", "vllm/", "torch/", "numpy/", "site-packages/"):
        if anchor in path:
            path = path[path.index(anchor) :]
            break
    return f"{m.group('func')} ({path})"


def is_auxout(frame: str) -> bool:
    return "auxout/" in frame and "site-packages" not in frame and "benchmarks/" not in frame


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", help="py-spy --format raw output")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--steps-only", action="store_true", help="only stacks inside EngineCore.step or the worker busy loop (steady state)")
    args = p.parse_args()
    busy: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    outer: dict[str, Counter[str]] = defaultdict(Counter)
    leaf: dict[str, Counter[str]] = defaultdict(Counter)
    with open(args.raw) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            procs = [f for f in frames if f.startswith("process ")]  # parent;child;...: the last is the sampled one
            proc = procs[-1] if procs else "?"
            frames = [f for f in frames if not f.startswith("process ")]
            if args.steps_only and not any(_STEP.search(f) for f in frames):
                continue
            n = int(count)
            busy[proc] += n
            deepest = max((i for i, f in enumerate(frames) if is_auxout(f)), default=None)
            if deepest is None:
                continue
            if any("vllm/" in f for f in frames[deepest + 1 :]):  # a wrapper calling back into vLLM: vLLM's time
                continue
            ours[proc] += n
            outer[proc][short(frames[deepest])] += n
            leaf[proc][short(frames[-1])] += n
    for proc, total in busy.most_common():
        if total < 50:
            continue
        share = ours[proc] / total
        print(f"\n{proc[:110]}\n  busy samples {total}, in auxout's own code {ours[proc]} ({share * 100:.2f}%)")
        if ours[proc]:
            print("  auxout function (deepest auxout frame):")
            for name, n in outer[proc].most_common(args.top):
                print(f"    {n / total * 100:6.2f}%  {name}")
            print("  leaf (where the time went):")
            for name, n in leaf[proc].most_common(args.top):
                print(f"    {n / total * 100:6.2f}%  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
