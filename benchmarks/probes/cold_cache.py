"""What does a per-step hook cost when the caches are cold, as they are right after a forward?

``engine_hooks.py`` times auxout's hooks inside a vLLM engine at several times what the same
calls cost in a loop (``process_output`` of a 16-request decode step: ~130-200 us in the engine,
~30-60 us in a loop). The forward streams the model's weights and activations through the
caches, so the code and data of whatever runs next have to be fetched again. This script
reproduces that without an engine: before each timed call it writes one byte per cache line of
a 96 MiB array (untimed), then times the call. It compares, warm and cold:

- ``capture``: 16 MoE layers' top-k ids copied into the step buffer one layer at a time inside
  the forward (the copy runs cold at every layer), against keeping each layer's ids tensor and
  copying all of them at the snapshot (``RouteCapture``'s host path);
- ``decode``: ``WorkerConnector.process_output`` of a 16-request decode step, warm and cold
  (how much of a hook's in-engine time is refetching code and data, not its work).

    .venv/bin/python benchmarks/probes/cold_cache.py            # ~1 min

Ratios are within one run (these machines are noisy); the absolute times depend on the cache
sizes and the memory of the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from auxout.connector.scheduler import SchedulerConnector
from auxout.connector.worker import WorkerConnector
from auxout.keys import KeySpace
from auxout.profile import RouteProfile
from auxout.stores import make_store

_EVICT = np.ones(96 << 20, dtype=np.uint8)


def evict() -> None:
    _EVICT[::64] += 1  # one write per cache line: the caches now hold this array


def median_us(fn: Callable[[], object], n: int, cold: bool, between: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(n):
        if between is not None:
            between()
        if cold:
            evict()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def capture_costs(n: int, cold: bool, layers: int = 16, tokens: int = 16, weights: bool = False) -> tuple[float, float]:
    """(copy in the forward, hold and copy at the snapshot) per step, microseconds; with
    ``weights`` each layer also copies its float32 routing weights (``routing_weights`` on)."""
    host = np.zeros((8192, layers, 8), dtype=np.uint8)
    host_w = np.zeros((8192, layers, 8), dtype=np.float32)
    ids = [torch.randint(0, 64, (tokens, 8), dtype=torch.int32) for _ in range(layers)]
    ws = [torch.rand(tokens, 8) for _ in range(layers)]
    held: list[torch.Tensor | None] = [None] * layers
    held_w: list[torch.Tensor | None] = [None] * layers

    def in_forward() -> float:  # a layer's forward runs between two captures
        total = 0.0
        for layer, t in enumerate(ids):
            if cold:
                evict()
            t0 = time.perf_counter()
            host[:tokens, layer] = t.numpy()
            if weights:
                host_w[:tokens, layer] = ws[layer].float().numpy()
            total += time.perf_counter() - t0
        return total

    def at_snapshot() -> float:
        total = 0.0
        for layer, t in enumerate(ids):
            if cold:
                evict()
            t0 = time.perf_counter()
            held[layer] = t  # what the router's capture_fn does now (a C-level setitem)
            if weights:
                held_w[layer] = ws[layer]
            total += time.perf_counter() - t0
        if cold:
            evict()
        t0 = time.perf_counter()
        for layer, t in enumerate(held):
            if t is not None:
                host[: t.shape[0], layer] = t.numpy()
                held[layer] = None
                w = held_w[layer]
                if w is not None:
                    host_w[: w.shape[0], layer] = w.float().numpy()
                    held_w[layer] = None
        return total + time.perf_counter() - t0

    a = statistics.median(in_forward() for _ in range(n)) * 1e6
    b = statistics.median(at_snapshot() for _ in range(n)) * 1e6
    return a, b


class _Req:
    def __init__(self, rid: str, n: int) -> None:
        self.request_id, self.num_prompt_tokens, self.num_tokens, self.num_output_tokens = rid, n, n, 0
        self.block_hashes: list[bytes] = []
        self.sampling_params = None

    def is_finished(self) -> bool:
        return False


def decode_cost(n: int, cold: bool, requests: int = 16, block: int = 32) -> float:
    """Median ``process_output`` of a decode step of ``requests`` requests, microseconds."""
    prof = RouteProfile(2, 4, 16)  # the tiny qwen3_moe's routes
    store = make_store("arena", max_bytes=8192 * prof.block_nbytes(block), object_nbytes=prof.block_nbytes(block))
    sched = SchedulerConnector()
    w = WorkerConnector(prof, block_size=block, store=store, max_num_seqs=requests, max_num_batched_tokens=4096,
                        keyspace=KeySpace("cold"))  # fmt: skip
    prompt = 8 * block
    reqs = {f"r{i}": _Req(f"r{i}", prompt) for i in range(requests)}
    ids = list(reqs)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 16, size=(requests * prompt, 2, 4), dtype=np.uint8)
    for rid, r in reqs.items():
        sched.add_request(rid, prompt, 0)
        r.block_hashes = [rng.bytes(32) for _ in range(prompt // block)]
    w.begin_step(sched.build_metadata(ids, reqs))
    pend = w.prepare_output(ids, np.zeros(requests, dtype=np.int64), np.arange(requests + 1) * prompt, rows)
    assert pend is not None
    w.process_output(pend, np.ones(requests, dtype=np.int64))
    qsl = np.arange(requests + 1)
    state: dict[str, object] = {}

    def next_step() -> None:  # untimed: the scheduler side and the forward of the next step
        for r in reqs.values():
            r.num_tokens += 1
            if r.num_tokens % block == 0:
                r.block_hashes.append(rng.bytes(32))
        w.begin_step(sched.build_metadata(ids, reqs))
        starts = np.array([r.num_tokens - 1 for r in reqs.values()], dtype=np.int64)
        state["p"] = w.prepare_output(ids, starts, qsl, rows[:requests].copy())

    ones = np.ones(requests, dtype=np.int64)
    us = median_us(lambda: w.process_output(state["p"], ones), n, cold, between=next_step)  # type: ignore[arg-type]
    w.close()
    return us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print(f"median microseconds per engine step ({args.steps} steps); cold = caches evicted before the call")
    for weights in (False, True):
        for cold in (False, True):
            tag = ("cold" if cold else "warm") + (", ids + weights" if weights else "")
            fwd, snap = capture_costs(args.steps // 4, cold, weights=weights)
            print(f"  capture, 16 layers x 16 tokens, {tag}: copy in the forward {fwd:7.1f}   hold, copy at "
                  f"snapshot {snap:7.1f}   ratio {snap / fwd:.2f}")
    warm, cold = decode_cost(args.steps, False), decode_cost(args.steps, True)
    print(f"  process_output, 16-request decode: warm {warm:7.1f}   cold {cold:7.1f}   ratio {cold / warm:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
