"""P/D with vLLM's production connector, NIXL, on two real ``auxout serve`` engines.

A prefill server and a decode server move KV through ``NixlConnector`` (UCX on CPU) and share
routes through a real redis-server. Requests are split as vLLM's disaggregated proxy does: the
prefill engine gets ``max_tokens: 1`` and ``do_remote_decode``, the decode engine gets the
``kv_transfer_params`` the prefill engine returned. NIXL lines the remote blocks up from the
end of the local ones and its hit covers the whole prompt, partial last block included, so
prompt lengths around block boundaries are the cases that matter: the greedy tokens must equal
the prefill engine's own full generation, and the decode side's routes must equal transformers'
full forward, bit for bit in top-k sets, with the decode engine's prefix cache still correct
afterwards.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from routes_oracle import Oracle, random_prompt
from serve_proc import auxout_server, free_port

import auxout
from auxout.testing.servers import redis_server

pytestmark = pytest.mark.vllm

BLOCK = 32
LENGTHS = [27, 31, 32, 33, 63, 64, 65, 68, 96, 97, 130]
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}

nixl = pytest.importorskip("nixl", reason="NIXL is installed by scripts/install.sh (nixl-cu12 with --no-deps)")


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


@pytest.fixture(scope="module")
def pair(model_path: str, tmp_path_factory: Any):  # type: ignore[no-untyped-def]
    """``(prefill_url, decode_url)``: two NIXL engines sharing one Redis namespace for routes."""
    logs = tmp_path_factory.mktemp("nixl")
    with redis_server() as srv:
        store = json.dumps({"url": srv.url, "namespace": "nixl"})
        args = [
            "--dtype", "float32", "--block-size", str(BLOCK), "--enforce-eager", "--max-model-len", "512",
            "--served-model-name", "tiny", "--kv-transfer-config", json.dumps(NIXL),
            "--auxout-store", "redis", "--auxout-store-options", store,
        ]  # fmt: skip
        env = lambda: {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "PYTHONHASHSEED": "0"}  # noqa: E731
        with (
            auxout_server(model_path, args, logs / "prefill.log", env=env()) as (p_url, _),
            auxout_server(model_path, args, logs / "decode.log", env=env()) as (d_url, _),
        ):
            yield p_url, d_url, logs


def complete(url: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict:
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def pd(p_url: str, d_url: str, prompt: list[int], max_tokens: int, **extra: Any) -> tuple[dict, dict]:
    """The two legs of a disaggregated request, as vLLM's proxy example makes them."""
    first = complete(
        p_url, prompt, 1,
        kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        },
    )  # fmt: skip
    params = first.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill"), first
    return first, complete(d_url, prompt, max_tokens, kv_transfer_params=params, **extra)


def check_routes(oracle: Oracle, prompt: list[int], choice: dict, prompt_start: int = 0) -> np.ndarray:
    tokens = prompt + choice["token_ids"]
    got = auxout.decode_routes(choice)
    assert got is not None, f"no routes: {sorted(choice)}"
    assert choice["routed_experts_start"] == prompt_start
    oracle.check_rows(tokens, got, prompt_start)
    return got


def test_prompts_around_block_boundaries(pair, oracle):  # type: ignore[no-untyped-def]
    p_url, d_url, logs = pair
    rng = np.random.default_rng(2026)
    for length in LENGTHS:
        prompt = random_prompt(rng, length)
        first, second = pd(p_url, d_url, prompt, 12)
        (choice,) = second["choices"]
        assert choice["finish_reason"] == "length", choice
        # the reference: the same greedy request on one engine (the prefill one, whole)
        single = complete(p_url, prompt, 12)["choices"][0]
        assert choice["token_ids"] == single["token_ids"], f"{length}-token prompt: P/D tokens differ"
        check_routes(oracle, prompt, choice)
        recomputed = (second.get("kv_transfer_params") or {}).get("auxout_recomputed_tokens", 0)
        # the decode side resumes at the last block boundary before the prompt's last token (as
        # vLLM's own prefix cache does): what lies between is recomputed, and counted
        assert recomputed == (length - 1) % BLOCK, f"{length}: {recomputed} prompt tokens recomputed"
        # the prefill leg returns no routes: a router that splices the two responses cannot
        # overwrite the decode side's rows
        assert first["choices"][0].get("routed_experts") is None, first["choices"][0]
    # the decode engine's own prefix cache holds correct KV and routes afterwards
    for length in (65, 97):
        prompt = random_prompt(np.random.default_rng(length), length)
        pd(p_url, d_url, prompt, 4)
        again = complete(d_url, prompt, 8)
        assert again["choices"][0]["token_ids"] == complete(p_url, prompt, 8)["choices"][0]["token_ids"]
        check_routes(oracle, prompt, again["choices"][0])
    for name in ("prefill.log", "decode.log"):
        text = (logs / name).read_text()
        assert "Traceback" not in text and "EngineDeadError" not in text, text[-3000:]


def test_prompt_start_and_sessions_through_pd(pair, oracle):  # type: ignore[no-untyped-def]
    p_url, d_url, _ = pair
    rng = np.random.default_rng(7)
    prompt = random_prompt(rng, 80)
    _, second = pd(p_url, d_url, prompt, 6, routed_experts_prompt_start=40)
    check_routes(oracle, prompt, second["choices"][0], prompt_start=40)
    # a session on the decode engine: turn 2 extends turn 1, only the new rows come back
    _, t1 = pd(p_url, d_url, prompt, 6, routed_experts_session="nixl-episode")
    c1 = t1["choices"][0]
    held = check_routes(oracle, prompt, c1)
    turn2 = prompt + c1["token_ids"] + random_prompt(rng, 20)
    _, t2 = pd(p_url, d_url, turn2, 6, routed_experts_session="nixl-episode")
    c2 = t2["choices"][0]
    start = c2["routed_experts_start"]
    assert 0 < start <= len(held), start
    rows = np.concatenate([held[:start], auxout.decode_routes(c2)])
    tokens = turn2 + c2["token_ids"]
    expected = oracle.routes(tokens)[: len(tokens) - 1]
    assert rows.shape == expected.shape
    assert (np.sort(rows, -1) == np.sort(expected, -1)).all()


def test_through_vllm_router_pd_mode(pair, oracle, tmp_path):  # type: ignore[no-untyped-def]
    """vLLM's router in P/D mode makes the two legs itself; the routes come from the decode leg."""
    from serve_proc import vllm_router

    p_url, d_url, _ = pair
    args = ["--vllm-pd-disaggregation", "--prefill", p_url, "--decode", d_url, "--kv-connector", "nixl"]
    with vllm_router(args, tmp_path / "router.log", timeout=60) as url:
        for length in (64, 68, 97):
            prompt = random_prompt(np.random.default_rng(1000 + length), length)
            choice = complete(url, prompt, 10)["choices"][0]
            assert choice["token_ids"] == complete(p_url, prompt, 10)["choices"][0]["token_ids"], length
            check_routes(oracle, prompt, choice)
