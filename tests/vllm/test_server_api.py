"""``auxout serve`` as an agent loop uses it: chat, streaming, sessions, formats, n/echo/logprobs/stop, keys.

One real server subprocess for the module (Qwen3-MoE tiny model with its tokenizer, a
password-protected Redis store: the store comes from a flag, its options (a URL with the password)
from ``AUXOUT_VLLM_OPTIONS`` and the namespace from the user's ``--additional-config``; routing
weights captured, ``--auxout-routing-weights true``), driven by the official ``openai`` client and
plain HTTP. Every route array is checked against transformers' full forward of the exact tokens
the server reports; the password appears in no manifest and no line of the server's log.
"""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from routes_oracle import Oracle, random_prompt
from serve_proc import auxout_server

from auxout.errors import StoreAuthError
from auxout.manifest import RouteManifest
from auxout.manifest import fetch as fetch_with
from auxout.testing.servers import redis_server
from auxout.vllm.server.sessions import common_prefix_len
from auxout.wire import FORMATS, decode_routes

pytestmark = pytest.mark.vllm

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


SECRET = "r3-s3cret"  # the store's password: no manifest or log line may show it


def fetch(manifest: RouteManifest, **kw: Any) -> Any:
    """``auxout.fetch`` as a trainer calls it: the store's password from the caller."""
    return fetch_with(manifest, password=SECRET, **kw)


@pytest.fixture(scope="module")
def server(model_path: str, tmp_path_factory: pytest.TempPathFactory):
    with redis_server(password=SECRET) as redis:
        log = tmp_path_factory.mktemp("server") / "server.log"
        args = [
            "--dtype", "float32", "--enforce-eager",
            "--block-size", "32", "--max-model-len", "512", "--max-num-batched-tokens", "64",
            "--enable-prompt-tokens-details", "--seed", "0",
            "--auxout-store", "redis", "--additional-config", json.dumps({"auxout": {"namespace": "http"}}),
            "--auxout-routing-weights", "true",
            "--enable-scale-out",  # vLLM's token-in/token-out /inference/v1/generate too
        ]  # fmt: skip
        options = {"store_options": {"url": redis.auth_url + "/0", "namespace": "srv"}}
        env = {"AUXOUT_VLLM_OPTIONS": json.dumps(options), "VLLM_SERVER_DEV_MODE": "1"}  # (/pause, /reset_prefix_cache)
        with auxout_server(model_path, args, log, ready_s=480, env=env) as (base, _), httpx.Client(
            base_url=base, timeout=120
        ) as client:
            client.model_path = model_path  # type: ignore[attr-defined]
            client.log = log  # type: ignore[attr-defined]
            client.redis_url = redis.url  # type: ignore[attr-defined]
            client.openai = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=120)  # type: ignore[attr-defined]
            yield client


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


def check(oracle: Oracle, tokens: list[int], rows: np.ndarray, start: int) -> None:
    oracle.check_rows(tokens, rows, start)


def body(server, **kw: Any) -> dict[str, Any]:
    return {"model": server.model_path, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **kw}


def sse(server, path: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with server.stream("POST", path, json={**payload, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def check_weights(oracle: Oracle, tokens: list[int], ids: np.ndarray, weights: np.ndarray, start: int) -> None:
    """The weights against transformers' router weights (per expert id, fp32)."""
    oracle.check_weights([], SimpleNamespace(token_ids=tokens, routed_experts=ids, routing_weights=weights), start)


def stitched(
    events: list[dict[str, Any]], index: int = 0, name: str = "routed_experts"
) -> tuple[int, np.ndarray, list[int], list[int]]:
    """(first start, concatenated rows, prompt ids, output ids) of one streamed choice; checks contiguity."""
    parts, first, expect_next = [], None, None
    prompt: list[int] = []
    out: list[int] = []
    for ev in events:
        for c in ev.get("choices", []):
            if c["index"] != index:
                continue
            prompt = prompt or (c.get("prompt_token_ids") or [])
            out += c.get("token_ids") or []
            if c.get("routed_experts") is None:
                assert c.get("routing_weights") is None, "weights without their ids"
                continue
            start = c[f"{name}_start"]  # (routing_weights_start: where a session's weights resume)
            if first is None:
                first = start
            else:
                assert start == expect_next, "streamed rows are not contiguous"
            rows = decode_routes(c, name)
            assert rows is not None and rows.shape[1:] == (2, 4)
            parts.append(rows)
            expect_next = start + len(rows)
    assert first is not None, "no routes in the stream"
    return first, np.concatenate(parts), prompt, out


def test_chat_multi_turn_session_with_openai_client(server, oracle):
    client = server.openai
    messages = [{"role": "user", "content": "What is the weather like today?"}]
    held = np.zeros((0, 2, 4), np.uint8)
    previous: list[int] = []
    previous_prompt_len = 0
    for turn in range(3):
        resp = client.chat.completions.create(
            model=server.model_path, messages=messages, max_tokens=6, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True, "routed_experts_session": "chat-a"},
        )  # fmt: skip
        choice = resp.choices[0]
        extra = choice.model_extra or {}
        prompt = list(resp.model_extra["prompt_token_ids"])
        tokens = prompt + list(extra["token_ids"])
        rows = decode_routes(choice)
        start = extra["routed_experts_start"]
        assert extra["routed_experts_shape"] == list(rows.shape) and extra["routed_experts_dtype"] == "uint8"
        check(oracle, tokens, rows, start)
        # the session resumes at the first position the client lacks or that differs (re-tokenized
        # assistant text may differ from the generated ids): never later, never earlier
        expected = min(common_prefix_len(np.array(previous), np.array(prompt)), max(len(previous) - 1, 0))
        assert start == expected, (start, expected)
        if turn:
            assert start >= previous_prompt_len, "the history the client holds must not be sent again"
        previous_prompt_len = len(prompt)
        held = np.concatenate([held[:start], rows])
        check(oracle, tokens, held, 0)  # the client's stitched copy is the whole conversation
        previous = tokens
        messages += [{"role": "assistant", "content": choice.message.content},
                     {"role": "user", "content": f"Tell me more, turn {turn}."}]  # fmt: skip


def test_session_restarts_where_history_differs(server, oracle):
    rng = np.random.default_rng(80)
    first = random_prompt(rng, 50)
    r1 = server.post("/v1/completions", json=body(server, prompt=first, max_tokens=4, routed_experts_session="s-b")).json()
    c1 = r1["choices"][0]
    assert c1["routed_experts_start"] == 0
    edited = first[:20] + random_prompt(rng, 40)
    r2 = server.post("/v1/completions", json=body(server, prompt=edited, max_tokens=4, routed_experts_session="s-b")).json()
    c2 = r2["choices"][0]
    assert c2["routed_experts_start"] == 20
    check(oracle, edited + c2["token_ids"], decode_routes(c2), 20)


def test_a_session_turn_the_client_never_read_is_recovered_with_a_prompt_start(server, oracle):
    """A response the client lost still counts as delivered; the README's recovery (the turn again
    without the session, from the rows held) and the session's next turn give every row exactly."""
    rng = np.random.default_rng(89)
    sid = {"routed_experts_session": "s-lost"}
    p1 = random_prompt(rng, 40)
    c1 = server.post("/v1/completions", json=body(server, prompt=p1, max_tokens=3, **sid)).json()["choices"][0]
    held = decode_routes(c1)
    p2 = p1 + c1["token_ids"] + random_prompt(rng, 30)
    server.post("/v1/completions", json=body(server, prompt=p2, max_tokens=3, **sid))  # the answer is lost
    retry = server.post("/v1/completions", json=body(server, prompt=p2, max_tokens=3, **sid)).json()["choices"][0]
    assert retry["routed_experts_start"] > len(held)  # the session thinks the client holds turn 2
    again = server.post(
        "/v1/completions", json=body(server, prompt=p2, max_tokens=3, routed_experts_prompt_start=len(held))
    ).json()["choices"][0]
    assert again["routed_experts_start"] == len(held)
    held = np.concatenate([held, decode_routes(again)])
    p3 = p2 + again["token_ids"] + random_prompt(rng, 20)
    c3 = server.post("/v1/completions", json=body(server, prompt=p3, max_tokens=3, **sid)).json()["choices"][0]
    start = c3["routed_experts_start"]
    assert start <= len(held)
    check(oracle, p3 + c3["token_ids"], np.concatenate([held[:start], decode_routes(c3)]), 0)


@pytest.mark.parametrize("session", [None, "stream-s"])
def test_streamed_completion_rows_concatenate_to_the_full_array(server, oracle, session):
    rng = np.random.default_rng(81)
    prompt = random_prompt(rng, 70)  # longer than one 64-token prefill chunk
    extra = {"routed_experts_session": session} if session else {}
    events = sse(server, "/v1/completions", body(server, prompt=prompt, max_tokens=10, **extra))
    start, rows, _, out = stitched(events)
    assert start == 0 and len(out) == 10
    check(oracle, prompt + out, rows, 0)
    chunks_with_rows = sum(1 for e in events for c in e["choices"] if c.get("routed_experts"))
    assert chunks_with_rows >= 5, "rows must arrive with the tokens, not all at the end"
    plain = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=10)).json()["choices"][0]
    np.testing.assert_array_equal(decode_routes(plain), rows)
    if session:  # next turn streamed: only the new rows
        second = prompt + out + random_prompt(rng, 8)
        events2 = sse(server, "/v1/completions", body(server, prompt=second, max_tokens=5, routed_experts_session=session))
        start2, rows2, _, out2 = stitched(events2)
        assert start2 == len(prompt) + len(out) - 1
        check(oracle, second + out2, rows2, start2)


def test_streamed_chat_with_openai_client(server, oracle):
    stream = server.openai.chat.completions.create(
        model=server.model_path, messages=[{"role": "user", "content": "Stream me some routes."}],
        max_tokens=7, temperature=0, stream=True, extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    events = [chunk.model_dump() for chunk in stream]
    for ev in events:  # the openai client keeps unknown fields: flatten them for stitched()
        for c in ev["choices"]:
            c.update({k: v for k, v in (c.pop("model_extra", None) or {}).items()})
    prompt = next(e["prompt_token_ids"] for e in events if e.get("prompt_token_ids"))
    start, rows, _, out = stitched(events)
    assert start == 0 and len(out) == 7
    check(oracle, list(prompt) + out, rows, 0)


@pytest.mark.parametrize("case", ["inline", "n2", "keys"])
def test_a_weight_sync_mid_stream_is_reported_on_each_choices_last_chunk(server, oracle, case):
    """An RL weight sync over HTTP while a stream runs: /pause?mode=keep, /reset_prefix_cache with
    reset_running_requests, /resume. Each streamed choice's last chunk says where the recompute's
    rows begin (``routed_experts_reset_at``), with n > 1 too, and a keys-only choice answered
    inline says why; the rows (the weights did not change) are each position once, exact."""
    prompt = random_prompt(np.random.default_rng(90), 60)
    extra: dict[str, Any] = {"n": 2, "temperature": 1.0, "seed": 3} if case == "n2" else {}
    if case == "keys":
        extra["vllm_xargs"] = {"routed_experts_output": "keys"}
    events: list[dict[str, Any]] = []
    with server.stream("POST", "/v1/completions", json={**body(server, prompt=prompt, max_tokens=400, **extra),
                                                        "stream": True}) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 1:  # running: sync now
                # (vLLM's /pause resets the prefix cache itself unless told not to: one reset here)
                assert server.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
                assert server.post("/reset_prefix_cache", params={"reset_running_requests": "true"}).status_code == 200
                assert server.post("/resume").status_code == 200
    for index in range(2 if case == "n2" else 1):
        (last,) = [c for e in events for c in e["choices"] if c["index"] == index and c.get("finish_reason")]
        (at,) = last["routed_experts_reset_at"]
        out = [t for e in events for c in e["choices"] if c["index"] == index for t in (c.get("token_ids") or [])]
        assert len(prompt) <= at < len(prompt) + len(out) - 1, at
        if case == "keys":  # rows from two generations: inline, and why
            assert "two generations" in last["routed_experts_inline_reason"]
            assert last.get("routed_experts_manifest") is None
        start, rows, _, _ = stitched(events, index)
        assert start == 0
        check(oracle, prompt + out, rows, 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_round_trips(server, oracle, fmt):
    prompt = random_prompt(np.random.default_rng(82), 40)
    r = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=5, routed_experts_format=fmt))
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["routed_experts_format"] == fmt and c["routed_experts_start"] == 0
    assert c["routed_experts_shape"] == [44, 2, 4]
    check(oracle, prompt + c["token_ids"], decode_routes(c), 0)


def test_n_echo_logprobs_and_stop_strings(server, oracle):
    prompt = random_prompt(np.random.default_rng(83), 45)
    r = server.post("/v1/completions", json=body(
        server, prompt=prompt, max_tokens=6, n=2, temperature=1.0, echo=True, logprobs=2))
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1]
    for c in choices:
        check(oracle, prompt + c["token_ids"], decode_routes(c), 0)
    events = sse(server, "/v1/completions", body(server, prompt=prompt, max_tokens=6, n=2, temperature=1.0))
    for index in (0, 1):
        start, rows, _, out = stitched(events, index)
        assert start == 0 and len(out) == 6
        check(oracle, prompt + out, rows, 0)
    # a stop string cuts the output: the rows end with it
    free = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=12)).json()["choices"][0]
    words = [w for w in free["text"][len(free["text"]) // 2 :].split() if len(w) >= 2]
    assert words, f"no word to stop at in {free['text']!r}"
    stop_at = words[0][:2]
    r2 = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=12, stop=[stop_at])).json()
    c2 = r2["choices"][0]
    assert len(c2["token_ids"]) < 12 and c2["finish_reason"] == "stop"
    check(oracle, prompt + c2["token_ids"], decode_routes(c2), 0)
    events = sse(server, "/v1/completions", body(server, prompt=prompt, max_tokens=12, stop=[stop_at]))
    _, rows, _, out = stitched(events)
    assert out == c2["token_ids"]
    check(oracle, prompt + out, rows, 0)


def test_structured_outputs_and_truncated_prompts(server, oracle):
    """Grammar-constrained sampling changes which tokens come out, not how routes line up; a
    truncated prompt's positions (and prompt start) count in the prompt the response returns."""
    regex = {"structured_outputs": {"regex": "[a-z]{3,6}"}}
    for so in ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, regex):
        r = server.post("/v1/completions", json=body(server, prompt="alpha beta gamma", max_tokens=12, **so))
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        check(oracle, c["prompt_token_ids"] + c["token_ids"], decode_routes(c), 0)
    events = sse(server, "/v1/completions", body(server, prompt="alpha beta gamma", max_tokens=12, n=2,
                                                 temperature=1.0, seed=3, **regex))  # fmt: skip
    for index in (0, 1):
        start, rows, prompt_ids, out = stitched(events, index)
        check(oracle, prompt_ids + out, rows, start)
    prompt = random_prompt(np.random.default_rng(85), 120)
    for start in (0, 30):
        r = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=5, truncate_prompt_tokens=50,
                                                     routed_experts_prompt_start=start))  # fmt: skip
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["prompt_token_ids"] == prompt[-50:] and c["routed_experts_start"] == start
        check(oracle, prompt[-50:] + c["token_ids"], decode_routes(c), start)


def test_keys_only_over_http_returns_a_manifest(server, oracle):
    prompt = random_prompt(np.random.default_rng(84), 50)
    r = server.post("/v1/completions", json=body(
        server, prompt=prompt, max_tokens=5, vllm_xargs={"routed_experts_output": "keys"}))
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c.get("routed_experts") is None
    manifest = RouteManifest.from_dict(c["routed_experts_manifest"])
    # the store is named without its password; the trainer brings it (without: a clear error)
    assert manifest.store == f"{server.redis_url}/0?namespace=srv" and SECRET not in r.text
    with pytest.raises(StoreAuthError, match="no password was given"):
        fetch_with(manifest)
    check(oracle, prompt + c["token_ids"], fetch(manifest), 0)
    events = sse(server, "/v1/completions", body(
        server, prompt=prompt, max_tokens=5, vllm_xargs={"routed_experts_output": "keys"}))
    finals = [c for e in events for c in e["choices"] if c.get("finish_reason")]
    assert len(finals) == 1 and not any(c.get("routed_experts") for e in events for c in e["choices"])
    streamed = fetch(RouteManifest.from_dict(finals[0]["routed_experts_manifest"]))
    out = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
    check(oracle, prompt + out, streamed, 0)
    # n > 1: each choice fetches its own completion's routes (vLLM keeps one kv_transfer_params
    # per request, the last child's), streamed and not
    sampled = body(server, prompt=prompt, max_tokens=8, n=3, temperature=1.0, seed=7,
                   vllm_xargs={"routed_experts_output": "keys"})
    choices = server.post("/v1/completions", json=sampled).json()["choices"]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1  # sampled apart: a shared manifest would show
    for c in choices:
        assert c["routed_experts_start"] == 0  # every choice states where its routes start
        check(oracle, prompt + c["token_ids"], fetch(RouteManifest.from_dict(c["routed_experts_manifest"])), 0)
    started = server.post("/v1/completions", json={**sampled, "n": 1, "routed_experts_prompt_start": 7}).json()
    c = started["choices"][0]
    assert c["routed_experts_start"] == 7
    check(oracle, prompt + c["token_ids"], fetch(RouteManifest.from_dict(c["routed_experts_manifest"])), 7)
    events = sse(server, "/v1/completions", {**sampled, "n": 1, "routed_experts_prompt_start": 7})
    assert [c["routed_experts_start"] for e in events for c in e["choices"] if c.get("finish_reason")] == [7]
    events = sse(server, "/v1/completions", sampled)
    finals = {c["index"]: c for e in events for c in e["choices"] if c.get("finish_reason")}
    assert sorted(finals) == [0, 1, 2]
    for i, c in finals.items():
        out = [t for e in events for d in e["choices"] if d["index"] == i for t in (d.get("token_ids") or [])]
        check(oracle, prompt + out, fetch(RouteManifest.from_dict(c["routed_experts_manifest"])), 0)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"routed_experts_format": "json"}, "routed_experts_format"),
        ({"routed_experts_format": 3}, "routed_experts_format"),
        ({"routed_experts_session": ""}, "routed_experts_session"),
        ({"routed_experts_session": 12}, "routed_experts_session"),
        ({"routed_experts_session": "x" * 300}, "routed_experts_session"),
        ({"routed_experts_session": "s", "n": 2, "temperature": 1.0}, "routed_experts_session"),
        ({"routed_experts_session": "s", "routed_experts_prompt_start": 3}, "routed_experts_session"),
        ({"routed_experts_session": "s", "routed_experts_prompt_start": 0}, "routed_experts_session"),
        # a route field with the opt-out contradicts it: refused naming the field (not answered without routes)
        ({"routed_experts_prompt_start": 2, "vllm_xargs": {"return_routed_experts": False}},
         "routed_experts_prompt_start=2 asks for routes"),
        ({"routed_experts_session": "s", "vllm_xargs": {"return_routed_experts": False}}, "routed_experts_session"),
        ({"routed_experts_format": "packed", "vllm_xargs": {"return_routed_experts": False}},
         "routed_experts_format"),
        ({"return_routing_weights": "yes"}, "return_routing_weights"),
        ({"return_routing_weights": 1}, "return_routing_weights"),
        # each field has one place: in the other it is refused, never silently ignored
        ({"return_routed_experts": False}, "return_routed_experts"),
        ({"routed_experts_output": "keys"}, "routed_experts_output"),
        ({"vllm_xargs": {"routed_experts_format": "packed"}}, "vllm_xargs.routed_experts_format"),
        ({"vllm_xargs": {"routed_experts_session": "s"}}, "vllm_xargs.routed_experts_session"),
        ({"vllm_xargs": {"return_routing_weights": True}}, "vllm_xargs.return_routing_weights"),
        ({"vllm_xargs": {"routed_experts_prompt_start": 3}}, "vllm_xargs.routed_experts_prompt_start"),
        # a misspelt field would be ignored by vLLM: refused, naming the one meant
        ({"routed_experts_sesion": "s"}, "did you mean routed_experts_session"),
        ({"vllm_xargs": {"return_routed_expert": False}}, "did you mean return_routed_experts"),
        ({"routed_experts": True}, "routed_experts is the output field"),
        ({"routedExpertsSession": "s"}, "did you mean routed_experts_session"),
        ({"extra_args": {"return_routed_experts": False}}, "over HTTP, per-request flags go in"),
    ],
)
def test_bad_new_fields_get_400_naming_the_field(server, oracle, extra, field):
    prompt = random_prompt(np.random.default_rng(85), 30)
    for path, payload in (
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = server.post(path, json=body(server, max_tokens=2, **payload, **extra))
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert field in r.text
    ok = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=2)).json()["choices"][0]
    check(oracle, prompt + ok["token_ids"], decode_routes(ok), 0)


def test_null_route_fields_mean_unset(server, oracle):
    """JSON null for any auxout field is "not set" (as for vLLM's own optional fields), in both places."""
    prompt = random_prompt(np.random.default_rng(86), 40)
    nulls = {
        "routed_experts_prompt_start": None, "routed_experts_format": None, "routed_experts_session": None,
        "return_routing_weights": None,
        "vllm_xargs": {"return_routed_experts": None, "routed_experts_output": None},
    }  # fmt: skip
    for path, payload in (
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = server.post(path, json=body(server, max_tokens=3, **payload, **nulls))
        assert r.status_code == 200, (path, r.text)
        res = r.json()
        c = res["choices"][0]
        assert c["routed_experts_format"] == "npy" and c["routed_experts_start"] == 0
        assert c.get("routing_weights") is None and c.get("routed_experts_manifest") is None
        check(oracle, (res.get("prompt_token_ids") or c["prompt_token_ids"]) + c["token_ids"], decode_routes(c), 0)


def test_out_of_vocabulary_prompt_id_names_the_field(server, oracle, model_path):
    """With a tokenizer too, the 400 names the field and the position (vLLM's own check says neither)."""
    with open(f"{model_path}/config.json") as fh:
        vocab = int(json.load(fh)["vocab_size"])
    prompt = random_prompt(np.random.default_rng(87), 20)
    r = server.post("/v1/completions", json=body(server, prompt=prompt[:7] + [vocab] + prompt[8:], max_tokens=2))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and f"token id {vocab} at position 7" in err["message"], err
    ok = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=2)).json()["choices"][0]
    check(oracle, prompt + ok["token_ids"], decode_routes(ok), 0)


def test_beam_search_is_refused_unless_routes_are_opted_out(server, oracle):
    """vLLM runs beam search as one-token requests: no beam gets routes, so asking for them is a 400."""
    prompt = random_prompt(np.random.default_rng(88), 20)
    beam = {"prompt": prompt, "max_tokens": 3, "use_beam_search": True, "n": 2}
    r = server.post("/v1/completions", json=body(server, **beam))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "use_beam_search" and "return_routed_experts" in err["message"], err
    r = server.post(
        "/v1/completions", json=body(server, **beam, vllm_xargs={"return_routed_experts": False})
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and all(c.get("routed_experts") is None for c in r.json()["choices"])
    ok = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=2)).json()["choices"][0]
    check(oracle, prompt + ok["token_ids"], decode_routes(ok), 0)


WEIGHTS = {"return_routing_weights": True}


@pytest.mark.parametrize("fmt", FORMATS)
def test_routing_weights_in_every_format(server, oracle, fmt):
    prompt = random_prompt(np.random.default_rng(90), 70)
    r = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=5, routed_experts_format=fmt, **WEIGHTS))
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    ids, weights = decode_routes(c), decode_routes(c, "routing_weights")
    assert c["routing_weights_format"] == fmt and c["routing_weights_dtype"] == "float32"
    assert c["routing_weights_shape"] == c["routed_experts_shape"] == [74, 2, 4] and c["routed_experts_start"] == 0
    assert c["routed_experts_dtype"] == ("uint8" if fmt != "sglang" else "int32")
    tokens = prompt + c["token_ids"]
    check(oracle, tokens, ids, 0)
    check_weights(oracle, tokens, ids, weights, 0)
    plain = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=5, routed_experts_format=fmt))
    p = plain.json()["choices"][0]
    assert "routing_weights" not in p and np.array_equal(decode_routes(p), ids), "asking for weights changed the ids"


def test_routing_weights_streamed_and_session_deltas(server, oracle):
    rng = np.random.default_rng(91)
    prompt = random_prompt(rng, 70)
    full = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=8, **WEIGHTS)).json()["choices"][0]
    events = sse(server, "/v1/completions", body(server, prompt=prompt, max_tokens=8, routed_experts_session="w-s", **WEIGHTS))
    start, ids, _, out = stitched(events)
    wstart, weights, _, _ = stitched(events, name="routing_weights")
    assert start == wstart == 0 and out == full["token_ids"] and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, decode_routes(full))
    np.testing.assert_allclose(weights, decode_routes(full, "routing_weights"), rtol=1e-6, atol=1e-7)
    check_weights(oracle, prompt + out, ids, weights, 0)
    # next turn of the session, not streamed: only the rows the client lacks, weights aligned with the ids
    second = prompt + out + random_prompt(rng, 10)
    c2 = server.post("/v1/completions", json=body(server, prompt=second, max_tokens=4, routed_experts_session="w-s",
                                                  **WEIGHTS)).json()["choices"][0]  # fmt: skip
    assert c2["routed_experts_start"] == len(prompt) + len(out) - 1
    ids2, w2 = decode_routes(c2), decode_routes(c2, "routing_weights")
    check(oracle, second + c2["token_ids"], ids2, c2["routed_experts_start"])
    check_weights(oracle, second + c2["token_ids"], ids2, w2, c2["routed_experts_start"])


def test_a_session_turn_without_weights_leaves_no_gap_in_the_weights(server, oracle):
    """Weights asked, not asked, asked: the third turn's weights start where the client's end
    (``routing_weights_start``), before its ids' start, so the client's weights end where its ids do."""
    rng = np.random.default_rng(93)
    sid = {"routed_experts_session": f"gap-{uuid.uuid4().hex[:8]}"}
    tokens: list[int] = []
    ids = np.zeros((0, 2, 4), np.uint8)
    weights = np.zeros((0, 2, 4), np.float32)
    for turn, want in enumerate((True, False, True)):
        prompt = tokens + random_prompt(rng, 20)
        extra = WEIGHTS if want else {}
        c = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=4, **sid, **extra)).json()["choices"][0]
        tokens = prompt + c["token_ids"]
        start = c["routed_experts_start"]
        ids = np.concatenate([ids[:start], decode_routes(c)])
        weights = weights[: min(len(weights), start)]
        if want:
            w_start = c["routing_weights_start"]
            assert w_start == len(weights) and (turn == 0 or w_start < start), (w_start, start, len(weights))
            weights = np.concatenate([weights[:w_start], decode_routes(c, "routing_weights")])
        else:
            assert "routing_weights" not in c and "routing_weights_start" not in c
    assert len(ids) == len(weights) == len(tokens) - 1
    check(oracle, tokens, ids, 0)
    check_weights(oracle, tokens, ids, weights, 0)


@st.composite
def session_turns(draw: st.DrawFn) -> list[tuple[str, int, bool, str, int]]:
    """(how the prompt continues, new tokens, weights asked, format or "stream", output tokens)."""
    return [
        (draw(st.sampled_from(["extend", "extend", "rewrite", "repeat"])), draw(st.integers(1, 12)), draw(st.booleans()),
         draw(st.sampled_from([*FORMATS, "stream"])), draw(st.integers(1, 4)))
        for _ in range(draw(st.integers(2, 4)))
    ]  # fmt: skip


@settings(max_examples=6)
@given(turns=session_turns(), seed=st.integers(0, 2**31 - 1))
def test_random_session_turns_stitch_to_a_full_forward(server, oracle, turns, seed):
    """Random turn sequences on one session: weights on or off, every format, streamed or not,
    histories extended, repeated or rewritten from a random position. The client keeps each
    array's rows before its start and appends (cutting its weights at ``routed_experts_start``
    when a response has none); its ids and weights always equal transformers' full forward."""
    rng = np.random.default_rng(seed)
    sid = f"prop-{uuid.uuid4().hex[:8]}"
    tokens: list[int] = []
    ids = np.zeros((0, 2, 4), np.uint8)
    weights = np.zeros((0, 2, 4), np.float32)
    for how, n_new, want, fmt, n_out in turns:
        if how == "rewrite" and tokens:
            prompt = tokens[: int(rng.integers(0, len(tokens)))] + random_prompt(rng, n_new)
        elif how == "repeat" and tokens:
            prompt = list(tokens)
        else:
            prompt = tokens + random_prompt(rng, n_new)
        payload = body(server, prompt=prompt, max_tokens=n_out, routed_experts_session=sid,
                       routed_experts_format="npy" if fmt == "stream" else fmt, **(WEIGHTS if want else {}))  # fmt: skip
        if fmt == "stream":
            events = sse(server, "/v1/completions", payload)
            start, new_ids, _, out = stitched(events)
            new_w = stitched(events, name="routing_weights") if want else None
            w_start = new_w[0] if new_w is not None else None
            w_rows = new_w[1] if new_w is not None else None
        else:
            c = server.post("/v1/completions", json=payload).json()["choices"][0]
            start, new_ids, out = c["routed_experts_start"], decode_routes(c), c["token_ids"]
            w_start, w_rows = c.get("routing_weights_start"), decode_routes(c, "routing_weights")
            assert (w_rows is not None) == want
        assert start <= len(ids)
        ids = np.concatenate([ids[:start], new_ids])
        weights = weights[: min(len(weights), start)]
        if want:
            assert w_start is not None and w_rows is not None and w_start == len(weights) <= start
            weights = np.concatenate([weights[:w_start], w_rows])
        tokens = prompt + list(out)
        assert len(ids) == len(tokens) - 1
        check(oracle, tokens, ids, 0)
        if len(weights):
            check_weights(oracle, tokens[: len(weights) + 1], ids[: len(weights)], weights, 0)


@pytest.mark.parametrize("start", [100, 149, 150])
def test_routing_weights_streamed_from_a_prompt_start_past_the_first_chunks(server, oracle, start):
    """Prefill chunks before the prompt start emit no rows: with weights those empty steps once
    cut the stream mid-body (an empty byte-row chunk the frontend could not read back)."""
    prompt = random_prompt(np.random.default_rng(start), 150)  # three 64-token prefill chunks
    events = sse(server, "/v1/completions", body(server, prompt=prompt, max_tokens=6, routed_experts_prompt_start=start,
                                                 n=2, temperature=1.0, seed=5, **WEIGHTS))  # fmt: skip
    assert not [e for e in events if "error" in e], events
    for index in (0, 1):
        first, ids, _, out = stitched(events, index)
        wfirst, weights, _, _ = stitched(events, index, name="routing_weights")
        assert first == wfirst == start and len(out) == 6
        check(oracle, prompt + out, ids, start)
        check_weights(oracle, prompt + out, ids, weights, start)
    # one token from the prompt's end: no rows at all, an empty array of the right shape
    for stream in (False, True):
        payload = body(server, prompt=prompt, max_tokens=1, routed_experts_prompt_start=150, **WEIGHTS)
        if stream:
            choice = {k: v for e in sse(server, "/v1/completions", payload) for c in e["choices"] for k, v in c.items()}
        else:
            r = server.post("/v1/completions", json=payload)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length", choice
        for name in ("routed_experts", "routing_weights"):
            if choice.get(name) is not None:
                assert decode_routes(choice, name).shape == (0, 2, 4), name


def test_routing_weights_in_chat_n_and_keys_only(server, oracle):
    resp = server.openai.chat.completions.create(
        model=server.model_path, messages=[{"role": "user", "content": "Weights, please."}], max_tokens=5,
        temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True, **WEIGHTS},
    )  # fmt: skip
    choice = resp.choices[0]
    tokens = list(resp.model_extra["prompt_token_ids"]) + list(choice.model_extra["token_ids"])
    ids, weights = decode_routes(choice), decode_routes(choice, "routing_weights")
    check(oracle, tokens, ids, 0)
    check_weights(oracle, tokens, ids, weights, 0)
    prompt = random_prompt(np.random.default_rng(92), 50)
    r = server.post("/v1/completions", json=body(server, prompt=prompt, max_tokens=6, n=2, temperature=1.0, **WEIGHTS))
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1]
    for c in choices:  # every choice its own ids and weights
        ids, weights = decode_routes(c), decode_routes(c, "routing_weights")
        check(oracle, prompt + c["token_ids"], ids, 0)
        check_weights(oracle, prompt + c["token_ids"], ids, weights, 0)
    r = server.post("/v1/completions", json=body(
        server, prompt=prompt, max_tokens=5, vllm_xargs={"routed_experts_output": "keys"}, **WEIGHTS))
    c = r.json()["choices"][0]
    manifest = RouteManifest.from_dict(c["routed_experts_manifest"])
    assert manifest.has_weights and c.get("routing_weights") is None
    ids, weights = fetch(manifest, weights=True)
    check(oracle, prompt + c["token_ids"], ids, 0)
    check_weights(oracle, prompt + c["token_ids"], ids, weights, 0)


def test_batch_chat_choices_carry_their_conversations_routes(server, oracle):
    """``/v1/chat/completions/batch``: vLLM left each choice's ``routed_experts`` null."""
    convs = [[{"role": "user", "content": "Hello there."}], [{"role": "user", "content": "Count to five, please."}]]
    path = "/v1/chat/completions/batch"
    r = server.post(path, json=body(server, messages=convs, max_tokens=5, routed_experts_format="packed", **WEIGHTS))
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for conv, c in zip(convs, choices):
        single = server.post("/v1/chat/completions", json=body(server, messages=conv, max_tokens=5)).json()
        assert c["prompt_token_ids"] == single["prompt_token_ids"]  # (vLLM's batch response has none: auxout adds them)
        tokens = c["prompt_token_ids"] + c["token_ids"]
        assert c["token_ids"] == single["choices"][0]["token_ids"]
        assert c["routed_experts_format"] == "packed" and c["routed_experts_start"] == 0
        ids, weights = decode_routes(c), decode_routes(c, "routing_weights")
        check(oracle, tokens, ids, 0)
        check_weights(oracle, tokens, ids, weights, 0)
        np.testing.assert_array_equal(ids, decode_routes(single["choices"][0]))
    r = server.post(path, json=body(server, messages=convs, max_tokens=2, routed_experts_session="batch"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "routed_experts_session", r.text
    assert "this batch has 2" in r.json()["error"]["message"]
    r = server.post(path, json=body(server, messages=convs, max_tokens=2, routed_experts_prompt_start=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "routed_experts_prompt_start", r.text
    r = server.post(path, json=body(server, messages=convs, max_tokens=2, vllm_xargs={"return_routed_experts": False}))
    assert r.status_code == 200 and all(c.get("routed_experts") is None for c in r.json()["choices"]), r.text


@pytest.mark.parametrize(
    "path, payload",
    [
        ("/v1/responses", {"input": "Hi.", "max_output_tokens": 3}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 3}),
    ],
)
def test_apis_without_routes_refuse_route_fields(server, oracle, path, payload):
    """The Responses and Anthropic Messages APIs have no place for routes: asking there is a 400, not ignored."""
    payload = {"model": server.model_path, **payload}
    for extra, field in (
        ({"routed_experts_format": "packed"}, "routed_experts_format"),
        ({"routed_experts_session": "s"}, "routed_experts_session"),
        ({"vllm_xargs": {"return_routed_experts": True}}, "vllm_xargs.return_routed_experts"),
    ):
        r = server.post(path, json={**payload, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and f"{path} returns no routes" in err["message"], err
    assert server.post(path, json=payload).status_code == 200  # without route fields: served as before


def test_other_entry_points_check_route_fields_too(server, oracle):
    """``/invocations`` hands the body to completions or chat; ``/inference/v1/generate`` reads
    the prompt start inside ``sampling_params``: neither coerces nor ignores a route field."""
    prompt = random_prompt(np.random.default_rng(91), 30)
    for bad in (True, 2.0, "3"):
        r = server.post("/invocations", json=body(server, prompt=prompt, max_tokens=3, routed_experts_prompt_start=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "routed_experts_prompt_start", r.text
        r = server.post("/inference/v1/generate", json={
            "model": server.model_path, "token_ids": prompt,
            "sampling_params": {"max_tokens": 3, "routed_experts_prompt_start": bad}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.routed_experts_prompt_start"
    r = server.post("/invocations", json=body(server, prompt=prompt, max_tokens=3, routed_experts_sesion="s"))
    assert r.status_code == 400 and "did you mean routed_experts_session" in r.text
    r = server.post("/inference/v1/generate", json={
        "model": server.model_path, "token_ids": prompt, "sampling_params": {"max_tokens": 3}, "routed_experts_format": "packed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "routed_experts_format" and "/v1/completions" in r.text
    r = server.post("/invocations", json=body(server, prompt=prompt, max_tokens=3, routed_experts_prompt_start=4))
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    check(oracle, prompt + c["token_ids"], decode_routes(c), 4)
    r = server.post("/inference/v1/generate", json={
        "model": server.model_path, "token_ids": prompt, "sampling_params": {"max_tokens": 3, "temperature": 0}})
    assert r.status_code == 200 and r.json()["choices"][0].get("routed_experts") is not None, r.text


def test_zz_the_server_log_never_shows_the_store_password(server):
    """After every test above (keys-only manifests, sessions, weights): vLLM logged its config,
    auxout's options included, without the password; no line anywhere shows it."""
    text = server.log.read_text(errors="replace")
    assert server.redis_url.removeprefix("redis://") in text, "the store options were not logged: nothing was checked"
    assert SECRET not in text
