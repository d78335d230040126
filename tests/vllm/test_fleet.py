"""A fleet: two ``auxout serve`` replicas sharing one real Redis (routes), scraped on ``/metrics``.

One pair of real server subprocesses for the module (Qwen3-MoE tiny model with its tokenizer).
Every route array is checked against transformers' full forward of the exact tokens the server
reports; every counter is checked against what the responses carried.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from routes_oracle import Oracle, random_prompt
from serve_proc import auxout_servers

from auxout.testing.servers import redis_server
from auxout.wire import decode_routes

pytestmark = pytest.mark.vllm

httpx = pytest.importorskip("httpx")

MODEL = "tiny"
ROUTE_NS = "fleet"  # the Redis store namespace of route objects (keys "fleet/...")


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


@pytest.fixture(scope="module")
def fleet(model_path: str, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("fleet")
    with redis_server() as redis:
        store = {"url": redis.url + "/0", "namespace": ROUTE_NS}
        args = [
            "--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "512",
            "--max-num-batched-tokens", "128", "--seed", "0", "--served-model-name", MODEL,
            "--auxout-store", "redis", "--auxout-store-options", json.dumps(store), "--auxout-namespace", "fleet",
        ]  # fmt: skip
        specs = [(args, logs / f"replica{i}.log", {"VLLM_CPU_OMP_THREADS_BIND": str(i)}) for i in range(2)]
        with auxout_servers(model_path, specs) as started:
            (a, _), (b, _) = started
            yield SimpleNamespace(a=a, b=b, redis=redis, logs=logs)


def check(oracle: Oracle, tokens: list[int], rows: np.ndarray, start: int) -> None:
    expected = oracle.routes(tokens)[start : len(tokens) - 1]
    assert rows.shape == expected.shape, (rows.shape, expected.shape)
    bad = np.argwhere(~(np.sort(rows, axis=-1) == np.sort(expected, axis=-1)).all(axis=-1))
    assert bad.size == 0, f"{len(bad)} route mismatches, first at {bad[:5].tolist()}"


def post(base: str, path: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(base + path, json=payload, headers=headers, timeout=300)


def completion(base: str, prompt: list[int], **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}  # fmt: skip
    r = post(base, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def counter(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return samples[(f"vllm:auxout_{name}_total", frozenset({"model_name": MODEL, **labels}.items()))]


def delete_routes(redis_url: str) -> int:
    """Remove every route object from the store (as Redis' own eviction would), sessions kept."""
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{ROUTE_NS}/*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
    return len(keys)


def test_metrics_count_what_the_responses_carried(fleet, oracle):
    """vLLM's /metrics on one replica: completions with routes by output, rows and bytes by format,
    session turns and the rows they saved, the Redis store's reads, hits and misses (route objects
    deleted behind the engine's back), and the prefix tokens that cost; the other replica's counters
    do not move."""
    before, before_b = scrape(fleet.a), scrape(fleet.b)
    rng = np.random.default_rng(47)
    rows_by_format = dict.fromkeys(("npy", "sglang", "packed"), 0)
    bytes_by_format = dict.fromkeys(("npy", "sglang", "packed"), 0)

    def took(choice: dict[str, Any], tokens: list[int]) -> None:
        fmt = choice["routed_experts_format"]
        rows = decode_routes(choice)
        check(oracle, tokens, rows, choice["routed_experts_start"])
        rows_by_format[fmt] += len(rows)
        bytes_by_format[fmt] += len(choice["routed_experts"])

    # a session of two turns: the second sends only what the client lacks
    first = random_prompt(rng, 40)
    c1 = completion(fleet.a, first, routed_experts_session="metrics-1", routed_experts_format="npy")
    took(c1, first + c1["token_ids"])
    second = first + c1["token_ids"] + random_prompt(rng, 20)
    c2 = completion(fleet.a, second, routed_experts_session="metrics-1", routed_experts_format="packed")
    took(c2, second + c2["token_ids"])
    saved = c2["routed_experts_start"]
    assert saved == len(first) + len(c1["token_ids"]) - 1
    # a prefix hit reads its two 32-token blocks back from Redis
    prompt = random_prompt(rng, 70)
    for _ in range(2):
        c = completion(fleet.a, prompt, routed_experts_format="sglang")
        took(c, prompt + c["token_ids"])
    # the objects vanish (the engine still holds the KV): a miss, then a recompute, exact routes
    assert delete_routes(fleet.redis.url) >= 2
    c = completion(fleet.a, prompt + [5, 6, 7], routed_experts_format="sglang")
    took(c, prompt + [5, 6, 7] + c["token_ids"])
    assert c.get("routed_experts_recomputed_tokens", 0) >= 64, c.get("routed_experts_recomputed_tokens")
    # keys-only
    keyed = completion(fleet.a, random_prompt(rng, 30), vllm_xargs={"routed_experts_output": "keys"})
    assert keyed.get("routed_experts_manifest") is not None

    after = scrape(fleet.a)

    def delta(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    assert delta("routed_completions", output="inline") == 5
    assert delta("routed_completions", output="keys") == 1
    for fmt in rows_by_format:
        assert delta("route_rows", format=fmt) == rows_by_format[fmt], fmt
        assert delta("route_bytes", format=fmt) == bytes_by_format[fmt], fmt
    assert delta("session_turns") == 2
    assert delta("session_rows_saved") == saved
    assert delta("store_reads", backend="redis") >= 2 + 1
    assert delta("store_hits", backend="redis") >= 2
    assert delta("store_misses", backend="redis") >= 1
    assert delta("store_reads", backend="redis") == delta("store_hits", backend="redis") + delta(
        "store_misses", backend="redis"
    )
    assert delta("recomputed_prefix_tokens") == c["routed_experts_recomputed_tokens"]
    assert delta("store_errors", backend="redis", op="read") == delta("store_errors", backend="redis", op="write") == 0
    assert delta("invalid_rows_refused") == 0
    assert delta("store_reads", backend="arena") == 0  # (the label is the backend serving the reads)
    after_b = scrape(fleet.b)
    assert all(after_b[k] == v for k, v in before_b.items() if k[0].startswith("vllm:auxout_"))
    assert ("vllm:num_requests_running", frozenset({"model_name": MODEL, "engine": "0"}.items())) in after  # vLLM's own
