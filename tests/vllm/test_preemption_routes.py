"""Routes stay bit-exact when the KV cache is too small and vLLM preempts and recomputes requests.

Second architecture (Mixtral), default multiprocess engine core, so scheduler metadata and
worker step outputs cross process boundaries as in production. The engine captures routing
weights (``routing_weights=True``); requests that do not ask for them get the ids alone.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from routes_oracle import (
    Oracle,
    close_llm,
    greedy,
    make_llm,
    metric,
    negate_embeddings,
    negate_oracle_embeddings,
    random_prompt,
)

pytestmark = pytest.mark.vllm

KV_BLOCKS = 12  # x 32 tokens: far less than the batch below needs


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("mixtral")


@pytest.fixture(scope="module")
def llm(model_path: str):
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # (collective_rpc with a function: a weight update)
    engine = make_llm(
        model_path, auxout={"routing_weights": True}, max_model_len=320, num_gpu_blocks_override=KV_BLOCKS,
        max_num_seqs=8,
    )  # fmt: skip
    yield engine
    close_llm(engine)
    os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


def test_preemption_keeps_routes_exact(llm, oracle):
    rng = np.random.default_rng(20)
    prompts = [random_prompt(rng, 50 + 7 * i) for i in range(5)]
    before = metric(llm, "vllm:num_preemptions")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(110), use_tqdm=False)
    assert metric(llm, "vllm:num_preemptions") > before, "the KV cache was large enough: no preemption"
    for p, o in zip(prompts, outs, strict=True):
        oracle.check(p, o.outputs[0])


def test_decode_steps_sent_before_the_connector_ran_are_exact(llm, oracle):
    """Steady decode steps go out before the worker's connector runs (``AUXOUT_SEND_AHEAD``): the
    connector's calls run after the send and must agree. Most of a long decode takes that path,
    block fills and a request finishing early included, and every row equals the full forward."""
    rng = np.random.default_rng(23)
    prompts = [random_prompt(rng, 20 + 3 * i) for i in range(3)]
    params = [greedy(n) for n in (70, 45, 70)]  # (the second one leaves a batch of two)
    (before,) = llm.collective_rpc("auxout_rank_state")
    assert before["send_ahead"] is True
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    (after,) = llm.collective_rpc("auxout_rank_state")
    sent = after["sent_ahead_steps"] - before["sent_ahead_steps"]
    assert sent >= 50, f"only {sent} of about 70 decode steps were sent ahead"
    for p, o in zip(prompts, outs, strict=True):
        oracle.check(p, o.outputs[0])


def test_multi_turn_after_preemption(llm, oracle):
    rng = np.random.default_rng(21)
    first = random_prompt(rng, 70)
    (o1,) = llm.generate([{"prompt_token_ids": first}], greedy(20), use_tqdm=False)
    oracle.check(first, o1.outputs[0])
    second = first + list(o1.outputs[0].token_ids) + random_prompt(rng, 12)
    (o2,) = llm.generate(
        [{"prompt_token_ids": second}], greedy(20, routed_experts_prompt_start=len(first) + 19), use_tqdm=False
    )
    assert o2.num_cached_tokens >= 64
    rows = oracle.check(second, o2.outputs[0], prompt_start=len(first) + 19)
    assert rows.shape == (len(second) + 20 - 1 - (len(first) + 19), 2, 2)


def test_preemption_keeps_routing_weights_exact(llm, oracle):
    rng = np.random.default_rng(22)
    prompts = [random_prompt(rng, 48 + 9 * i) for i in range(5)]
    asks = [i % 2 == 0 for i in range(5)]
    params = [greedy(100, extra_args={"return_routing_weights": True}) if a else greedy(100) for a in asks]
    before = metric(llm, "vllm:num_preemptions")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert metric(llm, "vllm:num_preemptions") > before, "the KV cache was large enough: no preemption"
    for p, o, a in zip(prompts, outs, asks, strict=True):
        oracle.check(p, o.outputs[0])
        if a:  # Mixtral's rule (softmax, top-2, renormalized) through preemption and recompute
            oracle.check_weights(p, o.outputs[0])
        else:
            assert getattr(o.outputs[0], "routing_weights", None) is None


def test_a_weight_sync_mid_request_says_where_the_new_weights_rows_begin(llm, oracle):
    """RL partial rollout: scheduling paused, the weights updated in place and the prefix cache
    reset with ``reset_running_requests=True`` while a request decodes; vLLM then recomputes it
    under the new weights. The rows it was already returned stay (each token's route as it was
    processed, as verl keeps a resumed partial rollout's old rows); the rest are the new weights'
    routes, and the completion says where they begin (``auxout_routes_reset_at``)."""
    rng = np.random.default_rng(24)
    prompt = random_prompt(rng, 60)
    other = random_prompt(rng, 30)  # a request that finishes before the sync: nothing to report
    eng = llm.llm_engine
    eng.add_request("sync-mid", {"prompt_token_ids": prompt}, greedy(24))
    eng.add_request("sync-before", {"prompt_token_ids": other}, greedy(2))
    outs, steps, synced = {}, 0, False
    try:
        while eng.has_unfinished_requests():
            for ro in eng.step():
                if ro.finished:
                    outs[ro.request_id] = ro
            steps += 1
            if steps == 6:
                assert "sync-before" in outs and "sync-mid" not in outs
                llm.sleep(level=0, mode="keep")  # (no step runs between the update and the reset)
                assert llm.collective_rpc(negate_embeddings) == [1]
                negate_oracle_embeddings(oracle)
                synced = True
                assert llm.reset_prefix_cache(reset_running_requests=True)
                llm.wake_up(tags=["scheduling"])
        c = outs["sync-mid"].outputs[0]
        (at,) = c.auxout_routes_reset_at
        assert outs["sync-mid"].kv_transfer_params["auxout_routes_reset_at"] == [at]
        assert getattr(outs["sync-before"].outputs[0], "auxout_routes_reset_at", None) is None
        tokens = prompt + list(c.token_ids)
        assert len(prompt) <= at < len(tokens) - 2, at  # the sync hit it while decoding
        new = oracle.routes(tokens)[: len(tokens) - 1]
        negate_oracle_embeddings(oracle)
        old = oracle.routes(tokens)[: len(tokens) - 1]
        synced = False
        got = np.sort(c.routed_experts, axis=-1)
        assert np.array_equal(got[:at], np.sort(old[:at], axis=-1)), "rows before the sync must be the old weights'"
        assert np.array_equal(got[at:], np.sort(new[at:], axis=-1)), "rows from the sync on must be the new weights'"
        assert not np.array_equal(np.sort(old[at:], -1), np.sort(new[at:], -1))  # (the update rerouted them)
    finally:
        assert llm.collective_rpc(negate_embeddings) == [1]  # the checkpoint's weights again
        assert llm.reset_prefix_cache()
        if synced:
            negate_oracle_embeddings(oracle)
