"""``auxout serve``: routes over HTTP equal the oracle; bad route options get a 4xx and the server lives on.

The server is a real subprocess (``python -m auxout.cli serve``) on 127.0.0.1 and a free port,
with the third architecture (OLMoE), its tokenizer loaded: token-id prompts work beside text.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from routes_oracle import Oracle, random_prompt
from serve_proc import auxout_server

pytestmark = pytest.mark.vllm

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("olmoe")


@pytest.fixture(scope="module")
def server(model_path: str, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = [
        "--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "512",
        "--max-num-batched-tokens", "64", "--enable-prompt-tokens-details", "--seed", "0",
    ]  # fmt: skip
    with auxout_server(model_path, args, log, ready_s=480) as (base, _), httpx.Client(
        base_url=base, timeout=60
    ) as client:
        client.model_path = model_path  # type: ignore[attr-defined]
        yield client


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


class Completion:
    def __init__(self, choice: dict) -> None:
        self.token_ids = choice["token_ids"]
        b64 = choice.get("routed_experts")
        self.routed_experts = None if b64 is None else np.load(io.BytesIO(base64.b64decode(b64)))


def complete(server, prompt: list[int], max_tokens: int = 8, **extra) -> tuple[httpx.Response, dict]:
    body = {
        "model": server.model_path,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    r = server.post("/v1/completions", json=body)
    return r, (r.json() if r.headers.get("content-type", "").startswith("application/json") else {})


def test_routes_over_http_match_oracle(server, oracle):
    prompt = random_prompt(np.random.default_rng(30), 60)
    r, data = complete(server, prompt)
    assert r.status_code == 200, r.text
    c = Completion(data["choices"][0])
    rows = oracle.check(prompt, c)
    assert rows.shape == (60 + 8 - 1, 2, 2)


def test_multi_turn_with_prompt_start_and_cache_hit(server, oracle):
    rng = np.random.default_rng(31)
    first = random_prompt(rng, 70)
    r1, d1 = complete(server, first)
    c1 = Completion(d1["choices"][0])
    oracle.check(first, c1)
    second = first + c1.token_ids + random_prompt(rng, 9)
    start = len(first) + len(c1.token_ids) - 1
    r2, d2 = complete(server, second, routed_experts_prompt_start=start)
    assert r2.status_code == 200, r2.text
    assert d2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    c2 = Completion(d2["choices"][0])
    oracle.check(second, c2, prompt_start=start)
    # Stitching turn 1 and turn 2 routes gives the whole conversation's routes.
    whole = np.concatenate([c1.routed_experts, c2.routed_experts])
    assert len(whole) == len(second) + len(c2.token_ids) - 1


def test_opt_out_over_http(server, oracle):
    prompt = random_prompt(np.random.default_rng(32), 40)
    r, data = complete(server, prompt, vllm_xargs={"return_routed_experts": False})
    assert r.status_code == 200, r.text
    assert data["choices"][0].get("routed_experts") is None


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"routed_experts_prompt_start": -1}, "routed_experts_prompt_start"),
        ({"routed_experts_prompt_start": 41}, "routed_experts_prompt_start"),
        ({"routed_experts_prompt_start": "abc"}, "routed_experts_prompt_start"),
        ({"routed_experts_prompt_start": 1.5}, "routed_experts_prompt_start"),
        ({"vllm_xargs": {"return_routed_experts": "no"}}, "return_routed_experts"),
        ({"vllm_xargs": {"routed_experts_output": "bogus"}}, "routed_experts_output"),
        ({"vllm_xargs": {"routed_experts_output": "keys"}}, "routed_experts_output"),  # arena: no shared store
    ],
)
def test_bad_route_options_get_4xx_and_server_keeps_serving(server, oracle, extra, needle):
    prompt = random_prompt(np.random.default_rng(33), 40)
    r, data = complete(server, prompt, **extra)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert needle in r.text
    r_ok, d_ok = complete(server, prompt, max_tokens=3)
    assert r_ok.status_code == 200, r_ok.text
    oracle.check(prompt, Completion(d_ok["choices"][0]))
