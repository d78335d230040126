"""P/D, replicas and restarts with real parts: a KV hit never fails for missing routes.

A prefill engine and a decode engine (two vLLM engine-core processes) move KV through vLLM's
own ``ExampleConnector`` (saved to a directory by the producer, loaded by the consumer: the
scheduler path NIXL, Mooncake and LMCache take on GPUs) and share routes through a real
redis-server. The decode side returns the whole sequence's routes (or from ``prompt_start``)
equal to transformers' full forward, for block-aligned and unaligned prompts, with prefix hits
on both sides. With an in-process store the decode side recomputes the prompt instead (correct,
no error) and auxout warns at startup. Two engines sharing a Redis namespace publish a common
prefix once, and an engine restarted against the same store and connector directory serves old
prefixes' routes without recomputing them. The Redis-backed engines capture routing weights too:
the decode side returns the prefill side's weights of the prompt it never ran.
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
    negate_embeddings,
    negate_oracle_embeddings,
    random_prompt,
)

from auxout.testing.servers import redis_server

pytestmark = pytest.mark.vllm

BLOCK = 32


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


@pytest.fixture(scope="module")
def redis_url():  # type: ignore[no-untyped-def]
    with redis_server() as srv:
        yield srv.url


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    return str(tmp_path_factory.mktemp("kv"))


def pd_engine(model_path: str, kv_dir: str, role: str, engine: dict | None = None, **auxout: object):  # type: ignore[no-untyped-def]
    from vllm.config import KVTransferConfig

    from auxout.vllm import engine_kwargs

    kw = engine_kwargs(**auxout)  # type: ignore[arg-type]
    ktc = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role=role, kv_connector_extra_config={"shared_storage_path": kv_dir}
    )
    return make_llm(
        model_path, max_model_len=1024, kv_transfer_config=ktc, additional_config=kw["additional_config"],
        **(engine or {}),
    )  # fmt: skip


def redis_opts(url: str) -> dict:
    return {
        "store": "redis", "namespace": "pd", "store_options": {"url": url, "namespace": "pdtest"},
        "routing_weights": True,
    }  # fmt: skip


@pytest.fixture(scope="module")
def prefill(model_path, kv_dir, redis_url):  # type: ignore[no-untyped-def]
    # the weight-sync test sends a function to the workers (``collective_rpc``): the engine
    # processes of this module must accept it (they read the variable when they start)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    engine = pd_engine(model_path, kv_dir, "kv_producer", **redis_opts(redis_url))
    yield engine
    close_llm(engine)
    os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)


@pytest.fixture(scope="module")
def decode(model_path, kv_dir, redis_url, prefill):  # type: ignore[no-untyped-def]
    # chunked prefill (64-token chunks): a load covers only the blocks allocated so far
    engine = pd_engine(model_path, kv_dir, "kv_consumer", {"max_num_batched_tokens": 64}, **redis_opts(redis_url))
    yield engine
    close_llm(engine)


def gen(llm, prompt: list[int], n: int, **kw):  # type: ignore[no-untyped-def]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy(n, **kw), use_tqdm=False)
    return out


def redis_keys(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return sum(1 for _ in client.scan_iter(match="pdtest*"))
    finally:
        client.close()


@pytest.mark.parametrize("length", [100, 4 * BLOCK])  # unaligned and block-aligned prompts
def test_decode_side_returns_whole_sequence_routes(prefill, decode, oracle, length):
    prompt = random_prompt(np.random.default_rng(length), length)
    p = gen(prefill, prompt, 1)
    oracle.check(prompt, p.outputs[0])
    d = gen(decode, prompt, 12)
    full = (length - 2) // BLOCK * BLOCK  # what ExampleConnector saves and loads (whole blocks)
    assert d.num_cached_tokens == full, "the decode side must load the prompt's KV through the connector"
    assert "auxout_recomputed_tokens" not in (d.kv_transfer_params or {}), "routes were in Redis: no recompute"
    oracle.check(prompt, d.outputs[0])
    # the decode side never ran those prompt tokens: their routes came from Redis, exact
    assert np.array_equal(d.outputs[0].routed_experts[: full - 1], p.outputs[0].routed_experts[: full - 1])


def test_decode_side_returns_the_prefill_sides_routing_weights(prefill, decode, oracle):
    prompt = random_prompt(np.random.default_rng(99), 100)
    weights = {"extra_args": {"return_routing_weights": True}}
    p = gen(prefill, prompt, 1, **weights)
    d = gen(decode, prompt, 10, **weights)
    full = (len(prompt) - 2) // BLOCK * BLOCK
    assert d.num_cached_tokens == full and "auxout_recomputed_tokens" not in (d.kv_transfer_params or {})
    oracle.check(prompt, d.outputs[0])
    w = oracle.check_weights(prompt, d.outputs[0])
    # the decode side never ran those prompt tokens: their weights came from Redis with the ids, exact
    assert np.array_equal(w[: full - 1], p.outputs[0].routing_weights[: full - 1])


def test_prompt_start_and_prefix_hits_on_both_sides(prefill, decode, oracle):
    rng = np.random.default_rng(7)
    base = random_prompt(rng, 3 * BLOCK)
    first = base + random_prompt(rng, 20)
    gen(prefill, first, 1)
    gen(decode, first, 8)
    second = base + random_prompt(rng, 45)  # shares 3 blocks with `first` on both engines
    p = gen(prefill, second, 1)
    assert p.num_cached_tokens >= 3 * BLOCK, "prefill side: local prefix hit"
    d = gen(decode, second, 10, routed_experts_prompt_start=50)
    assert d.num_cached_tokens >= 3 * BLOCK
    oracle.check(second, d.outputs[0], prompt_start=50)


def test_replicas_sharing_a_namespace_publish_a_common_prefix_once(prefill, decode, oracle, redis_url):
    rng = np.random.default_rng(11)
    common = random_prompt(rng, 3 * BLOCK)
    a = common + random_prompt(rng, 40)
    gen(prefill, a, 1)
    before = redis_keys(redis_url)
    # ExampleConnector matches whole saved prompts, so b's KV is not found: the decode engine
    # computes b, including the 3 blocks it shares with a
    b = common + random_prompt(rng, 40)
    d = gen(decode, b, 6)
    assert d.num_cached_tokens == 0
    oracle.check(b, d.outputs[0])
    # b has 4 full blocks of routes: the 3 common ones were already stored (first write wins)
    assert redis_keys(redis_url) == before + 1, "a common prefix must be stored once across replicas"


def test_a_route_block_missing_inside_a_connector_hit_recomputes_the_hit_whole(prefill, decode, oracle, redis_url):
    """One route block inside the KV the decode side would load is gone (evicted, deleted).
    Connectors load the whole hit they matched whatever shorter count the scheduler allocates
    for: a clipped hit made ExampleConnector write 288 tokens of KV into the 7 blocks of a
    chunked prefill, and the engine died. The hit is recomputed whole instead; the engine stays
    up and the routes are exact."""
    import redis

    from auxout.manifest import RouteManifest

    prompt = random_prompt(np.random.default_rng(51), 300)
    p = gen(prefill, prompt, 1, extra_args={"routed_experts_output": "keys"})
    manifest = RouteManifest.from_dict(p.outputs[0].auxout_routes_manifest)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.delete(f"pdtest/{manifest.keys[5]}") == 1  # the sixth of the hit's nine blocks
    finally:
        client.close()
    d = gen(decode, prompt, 8)
    assert d.outputs[0].finish_reason == "length", d.outputs[0].stop_reason
    saved = (len(prompt) - 1) // BLOCK * BLOCK  # what ExampleConnector saved and would load
    assert d.num_cached_tokens == 0, "a hit with a block of unreadable routes must not be loaded in part"
    assert (d.kv_transfer_params or {}).get("auxout_recomputed_tokens") == saved, d.kv_transfer_params
    oracle.check(prompt, d.outputs[0])
    again = gen(decode, prompt, 4)  # the decode side's own prefix cache now holds it, routes included
    assert again.num_cached_tokens >= saved and "auxout_recomputed_tokens" not in (again.kv_transfer_params or {})
    oracle.check(prompt, again.outputs[0])


def test_in_process_store_recomputes_external_kv_and_warns(model_path, kv_dir, prefill, oracle, capfd):
    prompt = random_prompt(np.random.default_rng(21), 90)  # ExampleConnector saves 64 tokens of it
    gen(prefill, prompt, 1)  # KV saved to the directory; routes only in Redis
    engine = pd_engine(model_path, kv_dir, "kv_consumer")  # default in-process store
    try:
        captured = capfd.readouterr()
        assert "cannot bring its routes" in captured.out + captured.err, "auxout must warn at startup"
        d = gen(engine, prompt, 8)
        assert d.outputs[0].finish_reason == "length", d.outputs[0].stop_reason
        assert d.num_cached_tokens == 0, "the external hit must be clipped: its routes are not readable"
        assert (d.kv_transfer_params or {}).get("auxout_recomputed_tokens") == 64, d.kv_transfer_params
        oracle.check(prompt, d.outputs[0])
    finally:
        close_llm(engine)


@pytest.mark.slow  # (a third engine start, restarted on the same store; P/D between two engines stays in the default tier)
def test_restarted_engine_serves_old_prefixes_without_recompute(model_path, kv_dir, redis_url, oracle, decode):
    rng = np.random.default_rng(31)
    prompt = random_prompt(rng, 3 * BLOCK + 5)
    first = pd_engine(model_path, kv_dir, "kv_both", **redis_opts(redis_url))
    try:
        gen(first, prompt, 1)  # computes, saves KV to the directory and routes to Redis
    finally:
        close_llm(first)
    restarted = pd_engine(model_path, kv_dir, "kv_both", **redis_opts(redis_url))
    try:
        d = gen(restarted, prompt, 6)
        assert d.num_cached_tokens == 3 * BLOCK, "the restarted engine must reuse the saved KV (no recompute)"
        assert "auxout_recomputed_tokens" not in (d.kv_transfer_params or {})
        oracle.check(prompt, d.outputs[0])
    finally:
        close_llm(restarted)


def _sync_weights(oracle: Oracle, *engines) -> None:  # type: ignore[no-untyped-def]
    for llm in engines:
        assert llm.collective_rpc(negate_embeddings) == [1]
        assert llm.reset_prefix_cache(), "the prefix cache must reset after a weight update"
    negate_oracle_embeddings(oracle)


def test_pd_after_an_in_place_weight_sync_shares_the_new_weights_routes(prefill, decode, oracle):
    """An RL weight sync updates both sides in place and resets their prefix caches. Each side
    names the new generation by a digest of the weights it runs, so the decode side reads the
    prefill side's routes of the KV it loads (nothing recomputed, from the first request on),
    and they are the new weights' routes. (Runs last in the module: the engines' weights are
    restored at the end.)"""
    _sync_weights(oracle, prefill, decode)
    try:
        for seed in (41, 42):
            prompt = random_prompt(np.random.default_rng(seed), 100)
            p = gen(prefill, prompt, 1)
            oracle.check(prompt, p.outputs[0])  # the new weights' routes
            d = gen(decode, prompt, 12)
            full = (len(prompt) - 2) // BLOCK * BLOCK
            assert d.num_cached_tokens == full, "the decode side must load the prompt's KV through the connector"
            assert "auxout_recomputed_tokens" not in (d.kv_transfer_params or {}), d.kv_transfer_params
            oracle.check(prompt, d.outputs[0])
            assert np.array_equal(d.outputs[0].routed_experts[: full - 1], p.outputs[0].routed_experts[: full - 1])
    finally:
        _sync_weights(oracle, prefill, decode)  # the checkpoint's weights again
