"""Routes from an engine whose worker runs in the engine core's own process (vLLM's ``uni`` executor).

That is vLLM's default for one GPU; vLLM-CPU uses the ``mp`` executor unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the other modules' engines pickle every step output. Here
nothing is pickled: a prefix hit's rows reach the scheduler bridge still in the worker's store
(``StoreRows``) and are gathered only when a request's rows are joined. The KV cache (and so the
route store sized from it) is small, so requests are preempted and evicted blocks are reused
while rows read from them may still be held.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from routes_oracle import Oracle, close_llm, greedy, make_llm, metric, random_prompt

from auxout.connector import held_rows
from auxout.stores.rows import StoreRows

pytestmark = pytest.mark.vllm

KV_BLOCKS = 16  # x 32 tokens


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def llm(model_path: str):
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # (read when the engine is built)
    try:
        engine = make_llm(
            model_path, max_model_len=480, num_gpu_blocks_override=KV_BLOCKS, max_num_seqs=6,
            max_num_batched_tokens=96, distributed_executor_backend="uni",
        )  # fmt: skip
    finally:
        if old is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
        # an in-process engine core freezes vLLM's environment variables in this process: thaw
        # them, or every later module's engine would be built in-process too
        import vllm.envs

        vllm.envs.disable_envs_cache()
    multiproc = vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING
    assert multiproc is (old != "0"), "vLLM's environment stayed frozen"
    yield engine
    close_llm(engine)


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


@pytest.fixture
def joins(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many ``StoreRows`` the bridge's held rows gathered (the engine runs in this process)."""
    seen: list[int] = []
    real = held_rows.join_rows

    def spy(parts):  # type: ignore[no-untyped-def]
        seen.append(sum(type(p) is StoreRows for p in parts))
        return real(parts)

    monkeypatch.setattr(held_rows, "join_rows", spy)
    return seen


def test_multi_turn_prefix_hits_are_gathered_from_the_store_in_process(llm, oracle, joins):
    rng = np.random.default_rng(40)
    prompt = random_prompt(rng, 100)
    for turn in range(3):
        (o,) = llm.generate([{"prompt_token_ids": prompt}], greedy(12), use_tqdm=False)
        oracle.check(prompt, o.outputs[0])
        if turn:
            assert o.num_cached_tokens >= 96, "the next turn did not hit the prefix cache"
        prompt = prompt + list(o.outputs[0].token_ids) + random_prompt(rng, 20)
    assert sum(joins) >= 2, "no prefix rows reached the bridge uncopied: the in-process path was not taken"


def test_preempted_requests_sharing_a_prefix_stay_exact(llm, oracle, joins):
    """Too little KV cache for the batch: requests are preempted while holding prefix rows read
    from the store, their pins go, and other requests' blocks evict and reuse store slots."""
    rng = np.random.default_rng(41)
    base = random_prompt(rng, 96)
    (o,) = llm.generate([{"prompt_token_ids": base}], greedy(4), use_tqdm=False)
    oracle.check(base, o.outputs[0])
    before = metric(llm, "vllm:num_preemptions")
    prompts = [base + random_prompt(rng, 10 + 9 * i) for i in range(6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(60), use_tqdm=False)
    assert metric(llm, "vllm:num_preemptions") > before, "the KV cache was large enough: no preemption"
    for p, out in zip(prompts, outs, strict=True):
        oracle.check(p, out.outputs[0])
    assert sum(joins) >= 1


def test_a_steady_decode_batch_takes_the_fast_paths_and_stays_exact(llm, oracle):
    """A batch decoding side by side runs the worker's lane: committed in one call for the
    connector's three (``commit_lane_step``), its emit starts checked as lists, its rows taken
    whole by the bridge; the oracle checks them."""
    core = llm.llm_engine.engine_core.engine_core  # (in-process: the engine core's own objects)
    worker = core.model_executor.driver_worker.worker._auxout_connector
    bridge = core.scheduler.auxout.connector
    before = (worker.lane_stats.begins, worker.lane_stats.fused, bridge.listed_steps)
    rng = np.random.default_rng(42)
    prompts = [random_prompt(rng, 20 + 7 * i) for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(70), use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        oracle.check(p, out.outputs[0])
    after = (worker.lane_stats.begins, worker.lane_stats.fused, bridge.listed_steps)
    assert all(a - b >= 30 for a, b in zip(after, before)), (before, after)


def test_requests_finishing_inside_a_collected_decode_step_get_their_last_rows(llm, oracle):
    """vLLM's per-request loop over a decode step runs with the bridge's collector (no auxout
    call per request); a request that finishes in such a step, on its length or on a stop token,
    gets its rows put on its final output after the loop, while the others go on decoding."""
    core = llm.llm_engine.engine_core.engine_core
    bridge = core.scheduler.auxout
    before = bridge.collected_steps
    rng = np.random.default_rng(44)
    prompts = [random_prompt(rng, 30 + 11 * i) for i in range(4)]
    params = [greedy(n) for n in (17, 29, 41)]
    (probe,) = llm.generate([{"prompt_token_ids": prompts[3]}], greedy(40), use_tqdm=False)
    stop_at = probe.outputs[0].token_ids[23]  # (it stops there or earlier, unless the batch changes its tokens)
    params.append(greedy(40, stop_token_ids=[stop_at]))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        oracle.check(p, out.outputs[0])
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths[:3] == [17, 29, 41], lengths
    last = outs[3].outputs[0]
    assert (last.finish_reason, last.token_ids[-1]) == ("stop", stop_at) or lengths[3] == 40, (last.finish_reason, lengths)
    assert bridge.collected_steps - before >= 30, (before, bridge.collected_steps)


@pytest.mark.parametrize("prompt_start", [0, 130])
def test_a_prefix_cache_reset_mid_chunked_prefill_returns_each_row_once(llm, oracle, prompt_start):
    """``reset_prefix_cache(reset_running_requests=True)`` (an RL weight sync) after two 96-token
    prefill chunks of a 300-token prompt: vLLM recomputes the request from its first token. The
    rows returned before the reset are kept and the recompute's rows follow them, each position
    once (the recompute used to emit rows ``[prompt_start, 192)`` a second time)."""
    rng = np.random.default_rng(43 + prompt_start)
    prompt = random_prompt(rng, 300)
    eng = llm.llm_engine
    rid = f"reset-mid-prefill-{prompt_start}"
    eng.add_request(rid, {"prompt_token_ids": prompt}, greedy(6, routed_experts_prompt_start=prompt_start))
    for _ in range(2):
        assert eng.step() == [], "the prompt was not chunked"  # (in-process: one engine step each)
    assert eng.reset_prefix_cache(reset_running_requests=True)
    done = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done = out
    assert done is not None
    oracle.check(prompt, done.outputs[0], prompt_start=prompt_start)
    at = getattr(done.outputs[0], "auxout_routes_reset_at", None)
    assert at == ([192] if prompt_start < 192 else None), at
