"""A fleet: two ``auxout serve`` replicas sharing one real Redis (routes and route sessions) behind
vLLM's router (``vllm-router --policy round_robin``), scraped on ``/metrics``.

One pair of real server subprocesses for the module (Qwen3-MoE tiny model with its tokenizer).
Every route array is checked against transformers' full forward of the exact tokens the server
reports; every counter is checked against what the responses carried.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from routes_oracle import Oracle, random_prompt
from serve_proc import auxout_servers

from auxout.testing.servers import redis_server
from auxout.vllm.server.sessions import common_prefix_len
from auxout.wire import decode_routes

pytestmark = pytest.mark.vllm

httpx = pytest.importorskip("httpx")

MODEL = "tiny"
ROUTE_NS = "fleet"  # the Redis store namespace of route objects (keys "fleet/...")


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

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
            "--auxout-session-store", "redis",
        ]  # fmt: skip
        env = {"VLLM_SERVER_DEV_MODE": "1"}  # (POST /auxout/update_weights, as vLLM's own RL endpoints)
        specs = [(args, logs / f"replica{i}.log", {**env, "VLLM_CPU_OMP_THREADS_BIND": str(i)}) for i in range(2)]
        with auxout_servers(model_path, specs) as started:
            (a, _), (b, _) = started
            with router([a, b], "round_robin", logs / "router.log") as url:
                yield SimpleNamespace(a=a, b=b, router=url, redis=redis, logs=logs)


@contextmanager
def router(workers: list[str], policy: str, log: Path) -> Iterator[str]:
    """``vllm-router`` in front of ``workers``; yields its URL once it answers."""
    from serve_proc import free_port, vllm_router

    args = ["--worker-urls", *workers, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # (its own metrics port each)
    with vllm_router(args, log) as url:
        yield url


def check(oracle: Oracle, tokens: list[int], rows: np.ndarray, start: int) -> None:
    oracle.check_rows(tokens, rows, start)


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


def chat(base: str, messages: list[dict[str, str]], session: str, headers: dict[str, str] | None = None,
         **kw: Any) -> httpx.Response:  # fmt: skip
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "routed_experts_session": session, **kw}  # fmt: skip
    return post(base, "/v1/chat/completions", body, headers)


def served_by(before: tuple[dict, dict], after: tuple[dict, dict]) -> list[int]:
    """Which replicas recorded a session turn between two scrapes of (a, b)."""
    return [i for i in (0, 1) if counter(after[i], "session_turns") > counter(before[i], "session_turns")]


class Client:
    """An agent loop's side of one session: the rows it holds and the tokens they are of."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.held = np.zeros((0, 2, 4), np.uint8)
        self.tokens: list[int] = []

    def take(self, response: httpx.Response, *, restarted: bool = False) -> int:
        """Stitch a response's rows (keep ``[0, start)``, append); returns its start. The rows must
        start where the client's rows stop being valid for the new prompt (``restarted``: at 0, the
        turn runs other weights than the rows held), and the stitched rows must equal the full
        forward of the whole conversation."""
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        prompt = list(data["prompt_token_ids"])
        start = choice["routed_experts_start"]
        expected = 0 if restarted else min(common_prefix_len(np.array(self.tokens), np.array(prompt)), len(self.held))
        assert start == expected, (start, expected)
        self.tokens = prompt + list(choice["token_ids"])
        self.held = np.concatenate([self.held[:start], decode_routes(choice)])
        check(self.oracle, self.tokens, self.held, 0)
        return int(start)


def test_a_chat_alternating_replicas_gets_exact_deltas(fleet, oracle):
    """Through vLLM's router (round robin): every turn lands on the other replica, yet each sends only
    the rows the client lacks, and the stitched rows equal the full forward; an earlier turn
    rewritten (a re-rendered history) restarts at the first differing token, on whichever replica."""
    client = Client(oracle)
    messages = [{"role": "user", "content": "Plan a three-day trip to the coast."}]
    replicas: list[int] = []
    for turn in range(3):
        before = (scrape(fleet.a), scrape(fleet.b))
        r = chat(fleet.router, messages, "trip", headers={"X-Session-Id": "trip"})
        replicas += served_by(before, (scrape(fleet.a), scrape(fleet.b)))
        start = client.take(r)
        if turn:
            assert start > 0, "a turn on the other replica must not start over"
        assert r.headers.get("x-session-id") == "trip"  # (echoed through the router)
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"And on day {turn + 2}?"}]  # fmt: skip
    assert len(replicas) == 3 and replicas[0] != replicas[1] != replicas[2], replicas
    held = len(client.held)
    messages[0]["content"] = "Plan a three-day trip to the mountains."  # the history changes early on
    start = client.take(chat(fleet.router, messages, "trip"))
    assert 0 < start < held // 2


def test_a_concurrent_turn_of_one_session_gets_409(fleet, oracle):
    """While one replica streams a session's turn, the same session's next turn on the other replica
    is refused with 409 saying why; once the first finished, that turn continues from its rows."""
    client = Client(oracle)
    messages = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    client.take(chat(fleet.a, messages, "story"))
    first = chat(fleet.b, messages, "story")
    assert first.status_code == 200  # (a repeated prompt: nothing new, a start at the rows held)
    client.take(first)
    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Go on."}]  # fmt: skip
    body = {"model": MODEL, "messages": messages, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "routed_experts_session": "story", "stream": True}  # fmt: skip
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", fleet.a + "/v1/chat/completions", json=body, timeout=300) as stream:
        lines = stream.iter_lines()
        for line in lines:  # the first chunk: the turn holds its session now
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                break
        busy = chat(fleet.b, messages, "story")
        assert busy.status_code == 409, busy.text
        assert "has another turn in flight" in busy.json()["error"]["message"]
        streamed = post(fleet.b, "/v1/chat/completions", {**body, "max_tokens": 4})  # (streamed: an error event)
        errors = [json.loads(x[6:]) for x in streamed.text.splitlines() if x.startswith("data: {")]
        assert [e["error"]["code"] for e in errors] == [409] and streamed.text.rstrip().endswith("data: [DONE]")
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    rows = [decode_routes(c) for e in events for c in e["choices"] if c.get("routed_experts") is not None]
    starts = [c["routed_experts_start"] for e in events for c in e["choices"] if c.get("routed_experts") is not None]
    prompt = next(e["prompt_token_ids"] for e in events if e.get("prompt_token_ids"))
    output = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert starts[0] == min(common_prefix_len(np.array(client.tokens), np.array(prompt)), len(client.held))
    client.held = np.concatenate([client.held[: starts[0]], *rows])
    client.tokens = prompt + output
    check(oracle, client.tokens, client.held, 0)
    # the streamed turn is over and recorded: the same prompt on the other replica starts after it
    # (unrecorded, the session would hold only the first turn, which ends before this prompt does)
    after = chat(fleet.b, messages, "story")
    assert after.json()["choices"][0]["routed_experts_start"] == len(prompt)
    client.take(after)


def test_header_policies(fleet, tmp_path):
    """``consistent_hash`` pins a session to one replica by its ``X-Session-Id`` header; a header that
    names another session than the body is refused (400) before any routing; the header alone asks
    for no session (full rows)."""
    with router([fleet.a, fleet.b], "consistent_hash", tmp_path / "router.log") as url:
        rng = np.random.default_rng(7)
        prompt = random_prompt(rng, 20)
        before = (scrape(fleet.a), scrape(fleet.b))
        for i in range(4):
            completion_headers = {"X-Session-Id": "pinned"}
            body = {"model": MODEL, "prompt": prompt + [i], "max_tokens": 2, "temperature": 0,
                    "return_token_ids": True, "routed_experts_session": "pinned"}  # fmt: skip
            r = post(url, "/v1/completions", body, completion_headers)
            assert r.status_code == 200, r.text
        after = (scrape(fleet.a), scrape(fleet.b))
        turns = [counter(after[i], "session_turns") - counter(before[i], "session_turns") for i in (0, 1)]
        assert sorted(turns) == [0, 4], turns
        wrong = post(url, "/v1/completions", {**body, "routed_experts_session": "other"}, {"X-Session-Id": "pinned"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "routed_experts_session", wrong.text
        plain = post(url, "/v1/completions", {k: v for k, v in body.items() if k != "routed_experts_session"},
                     {"X-Session-Id": "pinned"})  # fmt: skip
        assert plain.status_code == 200 and plain.json()["choices"][0]["routed_experts_start"] == 0
        assert plain.headers.get("x-session-id") == "pinned"


def version_of(base: str) -> str:
    r = httpx.get(base + "/auxout/weights_version", timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["weights_version"])


def test_a_rolling_weight_sync_over_http(fleet, oracle, model_path, tmp_path):
    """``POST /auxout/update_weights`` to one replica, later to the other, on one shared store: each
    replica's routes equal the full forward of the weights it runs, never the other's; a session turn
    in flight finishes on the weights it began with; a session restarts at 0 whenever its turn runs
    other weights than its rows, and goes on with deltas once both replicas run the same weights.
    (Last in the module: the replicas keep the new weights.)"""
    from concurrent.futures import ThreadPoolExecutor

    from weight_sync_helpers import Trainer

    trainer = Trainer(model_path)
    trainer.step(3)
    new = Oracle(trainer.save(tmp_path / "new"))
    old_version = version_of(fleet.a)
    assert old_version and version_of(fleet.b) == old_version  # (same weights: the same version)
    for body, field in (({"weights_path": str(tmp_path / "missing")}, "weights_path"), ({"weights_path": 3}, "weights_path"),
                        ({"weights_path": str(tmp_path / "new"), "drain_timeout": -1}, "drain_timeout"),
                        ({"weights": "x"}, "weights")):  # fmt: skip
        r = post(fleet.a, "/auxout/update_weights", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    assert version_of(fleet.a) == old_version  # (refused: nothing loaded)

    client = Client(oracle)
    messages = [{"role": "user", "content": "Describe the tides."}]
    client.take(chat(fleet.a, messages, "rolling"))
    # a streamed session turn in flight on replica a while a is synced
    rng = np.random.default_rng(5)
    prompt = random_prompt(rng, 40)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "routed_experts_session": "in-flight", "stream": True}  # fmt: skip
    rows, output = [], []
    with ThreadPoolExecutor(1) as pool, httpx.stream("POST", fleet.a + "/v1/completions", json=body, timeout=300) as s:
        sync = None
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            output += choice.get("token_ids") or []
            if choice.get("routed_experts") is not None:
                rows.append(decode_routes(choice))
            if sync is None:  # (the turn holds its session now)
                sync = pool.submit(post, fleet.a, "/auxout/update_weights", {"weights_path": str(tmp_path / "new")})
        assert sync is not None
        synced = sync.result()
    assert synced.status_code == 200, synced.text
    check(oracle, prompt + output, np.concatenate(rows), 0)  # all of it on the weights it began with
    new_version = synced.json()["weights_version"]
    assert new_version != old_version and version_of(fleet.a) == new_version and version_of(fleet.b) == old_version
    assert httpx.get(fleet.a + "/weight_info", timeout=30).json()["weight_version"] == new_version  # (vLLM's own)

    # mid-sync: the same prompts on both replicas, each its own weights' routes, through one store
    changed = 0
    for n in (30, 70):
        p = random_prompt(rng, n)
        on_new, on_old = completion(fleet.a, p), completion(fleet.b, p)
        a_rows, b_rows = decode_routes(on_new), decode_routes(on_old)
        new.check_rows(p + on_new["token_ids"], a_rows, 0, "replica a (synced)")
        oracle.check_rows(p + on_old["token_ids"], b_rows, 0, "replica b (not yet synced)")
        changed += int((np.sort(a_rows[: n - 1], -1) != np.sort(b_rows[: n - 1], -1)).any(-1).sum())
    assert changed > 0, "the new weights route some prompt token differently (else the test proves nothing)"

    def turn(base: str, forward: Oracle, restarted: bool) -> int:
        client.oracle = forward
        r = chat(base, messages, "rolling")
        start = client.take(r, restarted=restarted)
        messages.extend([{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And then?"}])  # fmt: skip
        return start

    messages.extend([{"role": "assistant", "content": "Tides follow the moon."}, {"role": "user", "content": "Why?"}])
    turn(fleet.a, new, restarted=True)  # rows held are of the old weights: all rows again
    assert turn(fleet.a, new, restarted=False) > 0  # same weights: a delta
    turn(fleet.b, oracle, restarted=True)  # back on old weights
    r = post(fleet.b, "/auxout/update_weights", {"weights_path": str(tmp_path / "new" / "model.safetensors")})
    assert r.status_code == 200 and r.json()["weights_version"] == new_version, r.text  # (the same weights)
    turn(fleet.b, new, restarted=True)  # its rows were of the old weights
    assert turn(fleet.a, new, restarted=False) > 0  # both on the new weights: deltas across replicas
