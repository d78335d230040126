"""Where routes-on time goes: auxout's share of a sampling profile of the engine processes.

Record ``benchmarks/engine_overhead.py`` under py-spy (it samples every process, native frames
off, idle threads excluded), then read the collapsed stacks::

    py-spy record --subprocesses --rate 250 --format raw -o /tmp/overhead.txt -- \\
        python benchmarks/engine_overhead.py --pairs 3
    python benchmarks/overhead_profile.py /tmp/overhead.txt

For each process it prints the busy samples, the samples with an auxout frame on the stack,
and the auxout functions that own them (outermost auxout frame, and the leaf where the time
was spent, auxout's or the library it called). The routes-on and routes-off engine-core
processes run the same workload, so their busy-sample difference is the whole overhead,
and the auxout share says how much of it is auxout's own code.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

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
            proc = frames[0] if frames[0].startswith("process ") else "?"
            n = int(count)
            busy[proc] += n
            mine = [f for f in frames if is_auxout(f)]
            if mine:
                ours[proc] += n
                outer[proc][short(mine[0])] += n
                leaf[proc][short(frames[-1])] += n
    for proc, total in busy.most_common():
        if total < 50:
            continue
        share = ours[proc] / total
        print(f"\n{proc[:110]}\n  busy samples {total}, with an auxout frame {ours[proc]} ({share * 100:.2f}%)")
        if ours[proc]:
            print("  outermost auxout frame:")
            for name, n in outer[proc].most_common(args.top):
                print(f"    {n / total * 100:6.2f}%  {name}")
            print("  leaf (where the time went):")
            for name, n in leaf[proc].most_common(args.top):
                print(f"    {n / total * 100:6.2f}%  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
