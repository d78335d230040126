"""Every tiny checkpoint `build_tiny_moe` writes loads in transformers, routes, and is reproducible."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from auxout.testing.models import build_tiny_moe
from auxout.trainer.hf import capture_routes, moe_layers, replay

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"]


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path, "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_checkpoint_loads_routes_and_replays(arch: str, tmp_path: Path) -> None:
    path = build_tiny_moe(arch, seed=3, path=str(tmp_path / "a"))
    again = build_tiny_moe(arch, seed=3, path=str(tmp_path / "b"))
    assert _digest(path) == _digest(again), "same seed must give the same weights"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(range(5, 45))
    routes = capture_routes(model, ids)
    assert routes.shape == (len(ids), len(moe_layers(model)), routes.shape[2])
    assert len(set(routes[:, 0, 0].tolist())) > 1, "routing must not be uniform"
    with torch.no_grad():
        plain = model(torch.tensor([ids])).logits
        with replay(model, routes):
            replayed = model(torch.tensor([ids])).logits
    assert torch.equal(plain, replayed)


def test_tiny_checkpoint_has_a_full_vocabulary_tokenizer_and_chat_template(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = build_tiny_moe("qwen3_moe", seed=3, path=str(tmp_path / "t"))
    again = build_tiny_moe("qwen3_moe", seed=3, path=str(tmp_path / "u"))
    assert Path(path, "tokenizer.json").read_bytes() == Path(again, "tokenizer.json").read_bytes()
    tok = AutoTokenizer.from_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    assert len(tok) == cfg.vocab_size  # every id the model takes is a token (token-id prompts stay valid)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id)
    text = "What is the weather like today? 42"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
