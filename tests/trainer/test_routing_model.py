"""``build_routing_moe``: a small MoE whose routing carries weight, so ``auxout verify`` shows what
replay is for (rollout->train KL with replay at most a fifth of the KL without), where the tiny
random models' experts barely move the logprobs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from auxout.testing.models import ROUTING_MOE, build_routing_moe, build_tiny_moe
from auxout.trainer.hf import capture_routes, moe_layers, replay
from auxout.trainer.verify import main

MAX_RATIO = 0.2


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path, "model.safetensors").read_bytes()).hexdigest()


def _moved_by_other_experts(path: str) -> float:
    """Mean |logprob change| over a sequence when every token takes the next expert instead."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([list(range(5, 45))])
    routes = capture_routes(model, ids[0].tolist())
    with torch.no_grad():
        plain = torch.log_softmax(model(ids).logits, -1)
        with replay(model, routes):
            assert torch.equal(torch.log_softmax(model(ids).logits, -1), plain)
        with replay(model, (routes + 1) % moe_layers(model).num_experts):
            return float((torch.log_softmax(model(ids).logits, -1) - plain).abs().mean())


def test_the_routing_model_is_reproducible_and_its_experts_carry_weight(tmp_path: Path) -> None:
    path = build_routing_moe(seed=3, path=tmp_path / "a")
    assert _digest(path) == _digest(build_routing_moe(seed=3, path=tmp_path / "b"))
    assert _digest(path) != _digest(build_routing_moe(seed=4, path=tmp_path / "c"))
    layers = moe_layers(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    assert (len(layers), layers.top_k) == (2, ROUTING_MOE["config"]["num_experts_per_tok"])
    # other experts move the logprobs an order of magnitude more than in the tiny random model
    assert _moved_by_other_experts(path) > 10 * _moved_by_other_experts(build_tiny_moe("qwen3_moe", seed=3))


def _verify(args: list[str], out: Path) -> dict:
    rc = main([*args, "--rollout", "hf-bf16", "--out", str(out), "--no-progress"])
    assert rc == 0
    return json.loads((out / "verify.json").read_text())


def test_verify_on_the_routing_model_shows_replay_closing_the_kl(tmp_path: Path) -> None:
    """Rollout in bf16, training forward in fp32: on the routing model the KL with replay is at most
    a fifth of the KL without (0.002 measured; 0.3-0.9 on the tiny random model)."""
    rep = _verify(["--routing-model"], tmp_path / "routing")
    assert rep["with_replay"]["agreement"] == 1.0
    assert rep["without_replay"]["agreement"] < 1.0  # (bf16 flipped some experts: there is a gap to close)
    assert rep["kl_ratio"] <= MAX_RATIO, rep


@pytest.mark.slow
@pytest.mark.vllm
def test_verify_with_a_vllm_rollout_on_the_routing_model(tmp_path: Path) -> None:
    rc = main(["--routing-model", "--rollout", "vllm", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    rep = json.loads((tmp_path / "verify.json").read_text())
    assert rep["kl_ratio"] <= MAX_RATIO, rep
