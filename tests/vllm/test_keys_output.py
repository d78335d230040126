"""Keys-only output from a real vLLM engine: the final output carries a manifest, the routes live in Redis.

A trainer process would only see ``RequestOutput.kv_transfer_params["auxout_routes_manifest"]``;
``auxout.fetch`` opens the store from the manifest's address and must return exactly the routes of
a transformers full forward (prefix hit and prompt_start included), and the same array as a
request that asked for inline rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from routes_oracle import Oracle, close_llm, greedy, make_llm, random_prompt

from auxout.manifest import RouteManifest, fetch
from auxout.testing.servers import redis_server

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def redis():  # type: ignore[no-untyped-def]
    with redis_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def redis_url(redis) -> str:  # type: ignore[no-untyped-def]
    return str(redis.url)


@pytest.fixture(scope="module")
def llm(model_path: str, redis_url: str):  # type: ignore[no-untyped-def]
    from auxout.vllm import engine_kwargs

    kw = engine_kwargs(
        store="redis", output="keys", namespace="vk", store_options={"url": redis_url, "namespace": "vllm-keys"}
    )
    engine = make_llm(model_path, max_model_len=512, additional_config=kw["additional_config"])
    yield engine
    close_llm(engine)


def manifest_of(completion_output_owner) -> RouteManifest:  # type: ignore[no-untyped-def]
    params = completion_output_owner.kv_transfer_params or {}
    assert "auxout_routes_manifest" in params, f"no manifest in {params!r}"
    return RouteManifest.from_dict(params["auxout_routes_manifest"])


def test_manifests_fetch_the_oracle_routes(llm, model_path):  # type: ignore[no-untyped-def]
    oracle = Oracle(model_path)
    rng = np.random.default_rng(50)
    first = random_prompt(rng, 70)
    (a,) = llm.generate([{"prompt_token_ids": first}], greedy(12), use_tqdm=False)
    assert a.outputs[0].routed_experts is None  # keys-only: no rows on the response path
    m = manifest_of(a)
    assert m.store.startswith("redis://")
    got = fetch(m)  # opens its own client from the address, as a trainer would
    tokens = first + list(a.outputs[0].token_ids)
    expected = oracle.routes(tokens)[: len(tokens) - 1]
    assert got.shape == expected.shape
    assert (np.sort(got, axis=-1) == np.sort(expected, axis=-1)).all()

    # next turn: prefix hit, and only the rows the caller does not hold yet
    second = tokens + random_prompt(rng, 9)
    start = len(tokens) - 1
    (b,) = llm.generate(
        [{"prompt_token_ids": second}], greedy(6, routed_experts_prompt_start=start), use_tqdm=False
    )
    assert b.num_cached_tokens > 0
    got_b = fetch(manifest_of(b))
    tokens_b = second + list(b.outputs[0].token_ids)
    expected_b = oracle.routes(tokens_b)[start : len(tokens_b) - 1]
    assert got_b.shape == expected_b.shape
    assert (np.sort(got_b, axis=-1) == np.sort(expected_b, axis=-1)).all()

    # the same request asking for inline rows gets the identical array
    (c,) = llm.generate(
        [{"prompt_token_ids": second}],
        greedy(6, routed_experts_prompt_start=start, extra_args={"routed_experts_output": "inline"}),
        use_tqdm=False,
    )
    assert c.outputs[0].routed_experts is not None
    assert np.array_equal(c.outputs[0].routed_experts, got_b)


def test_each_of_n_completions_fetches_its_own_routes(llm, model_path):  # type: ignore[no-untyped-def]
    """n > 1: vLLM keeps one ``kv_transfer_params`` per request (the last child's); each
    completion carries its own manifest, and the request-level one, which would name one
    completion only, is gone."""
    from vllm import SamplingParams

    oracle = Oracle(model_path)
    prompt = random_prompt(np.random.default_rng(51), 40)
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=3, detokenize=False, routed_experts_prompt_start=20)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert "auxout_routes_manifest" not in (out.kv_transfer_params or {})
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # sampled apart: a shared manifest would show
    keys = set()
    for c in out.outputs:
        assert c.routed_experts is None
        m = RouteManifest.from_dict(c.auxout_routes_manifest)
        keys.add(tuple(m.keys))
        tokens = prompt + list(c.token_ids)
        expected = oracle.routes(tokens)[20 : len(tokens) - 1]
        got = fetch(m)
        assert got.shape == expected.shape, f"completion {c.index}"
        assert (np.sort(got, axis=-1) == np.sort(expected, axis=-1)).all(), f"completion {c.index}"
    assert len(keys) == len({tuple(c.token_ids) for c in out.outputs})
    (one,) = llm.generate([{"prompt_token_ids": prompt}], greedy(4), use_tqdm=False)  # n=1: both places
    assert one.outputs[0].auxout_routes_manifest == manifest_of(one).to_dict()


def test_store_down_each_completion_gets_exact_rows_inline_and_says_why(llm, model_path, redis):  # type: ignore[no-untyped-def]
    """(Last in this module: it kills the store.) A manifest that cannot be published comes back
    as the exact rows inline, with the reason on each completion (n > 1 included); once the store
    is back, manifests again."""
    from vllm import SamplingParams

    oracle = Oracle(model_path)
    prompt = random_prompt(np.random.default_rng(52), 45)
    redis.kill()
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=4, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    for c in out.outputs:
        assert getattr(c, "auxout_routes_manifest", None) is None
        assert "auxout_routes_inline_reason" in vars(c) and c.auxout_routes_inline_reason, vars(c).keys()
        oracle.check(prompt, c)
    redis.restart()
    (back,) = llm.generate([{"prompt_token_ids": prompt}], greedy(3), use_tqdm=False)
    tokens = prompt + list(back.outputs[0].token_ids)
    got = fetch(manifest_of(back))
    assert (np.sort(got, axis=-1) == np.sort(oracle.routes(tokens)[: len(tokens) - 1], axis=-1)).all()
