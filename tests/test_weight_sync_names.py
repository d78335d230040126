"""The caller side of ``auxout.vllm.update_weights`` without an engine: transformers 5 names back to
checkpoint names for every vLLM architecture, and the checks that run before the engine is touched."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from auxout.testing.models import VLLM_ARCHS, build_tiny_moe
from auxout.vllm.weight_sync import (
    WeightSyncError,
    _decode,
    _encode,
    check_against_checkpoint,
    checkpoint_named,
    checkpoint_shapes,
    generation_digest,
    tensor_digest,
)


@pytest.mark.parametrize("arch", VLLM_ARCHS)
@pytest.mark.parametrize("given_model", [True, False])
def test_transformers_names_become_the_checkpoint_names_and_tensors(arch: str, given_model: bool) -> None:
    """Fused experts (``experts.gate_up_proj``) and Mixtral's ``mlp`` for ``block_sparse_moe`` go back
    to the checkpoint's per-expert tensors, with the model's conversions or the config's defaults."""
    path = build_tiny_moe(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert any("experts.gate_up_proj" in n for n, _ in model.named_parameters())  # (fused in transformers 5)
    named = checkpoint_named(model.named_parameters(), AutoConfig.from_pretrained(path), model if given_model else None)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert set(named) == set(want)
    assert all(torch.equal(named[k], want[k]) for k in want)
    assert check_against_checkpoint(named, checkpoint_shapes(path) or {}) == named
    again = checkpoint_named(named, AutoConfig.from_pretrained(path))  # checkpoint names pass through
    assert set(again) == set(named)


def test_bad_items_are_named() -> None:
    cfg = AutoConfig.from_pretrained(build_tiny_moe("qwen3_moe"))
    with pytest.raises(WeightSyncError, match=r"weights: a name is int 3"):
        checkpoint_named([(3, torch.zeros(1))], cfg)  # type: ignore[list-item]
    with pytest.raises(WeightSyncError, match="expected \\(name, tensor\\) pairs, got str"):
        checkpoint_named(["model.norm.weight"], cfg)  # type: ignore[list-item]
    with pytest.raises(WeightSyncError, match="'model.norm.weight' given twice"):
        checkpoint_named([("model.norm.weight", torch.ones(64))] * 2, cfg)


_LAYERS = {
    "model.embed_tokens": ["model.embed_tokens.weight"],
    "model.layers.0": [f"model.layers.0.{n}.weight" for n in ("a", "b", "mlp.experts.0.up", "mlp.experts.1.up")],
    "model.layers.1": [f"model.layers.1.{n}.weight" for n in ("a", "b")],
    "model.norm": ["model.norm.weight"],
}
_EXPECTED = {n: (2, 3) for names in _LAYERS.values() for n in names}


@given(st.sets(st.sampled_from(sorted(_EXPECTED)), min_size=1))
def test_a_layer_is_sent_whole_or_not_at_all(names: set[str]) -> None:
    tensors = {n: torch.zeros(2, 3) for n in names}
    whole = all(set(group) <= names or not set(group) & names for group in _LAYERS.values())
    if whole:
        assert check_against_checkpoint(tensors, _EXPECTED) == tensors
    else:
        with pytest.raises(WeightSyncError, match="is incomplete"):
            check_against_checkpoint(tensors, _EXPECTED)


def test_tied_embeddings_drop_the_head_copy_and_shapes_are_checked() -> None:
    expected = {"model.embed_tokens.weight": (4, 2)}
    t = torch.zeros(4, 2)
    assert check_against_checkpoint({"model.embed_tokens.weight": t, "lm_head.weight": t}, expected, True) == {
        "model.embed_tokens.weight": t
    }
    with pytest.raises(WeightSyncError, match=r"not in the engine's checkpoint, e.g. \['lm_head.weight'\]"):
        check_against_checkpoint({"model.embed_tokens.weight": t, "lm_head.weight": t}, expected, False)
    with pytest.raises(WeightSyncError, match=r"shape \(2, 4\) differs from the checkpoint's \(4, 2\)"):
        check_against_checkpoint({"model.embed_tokens.weight": t.T}, expected)


@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       st.lists(st.integers(0, 5), min_size=0, max_size=3))  # fmt: skip
def test_tensors_cross_processes_as_bytes_unchanged(dtype: torch.dtype, shape: list[int]) -> None:
    t = (torch.arange(int(torch.tensor(shape).prod()) if shape else 1, dtype=torch.float64) * 0.37).to(dtype)
    t = t.reshape(shape)
    ((name, back),) = _decode(_encode({"w": t}))
    assert name == "w" and back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_a_generation_digest_changes_with_any_loaded_tensor() -> None:
    a, b = torch.ones(3, 1024), torch.ones(3, 1024)
    b[2, 7] = 1.0000001
    assert tensor_digest("w", a) != tensor_digest("w", b)
    assert tensor_digest("w", a) != tensor_digest("v", a)
    assert tensor_digest("w", a) == tensor_digest("w", a.clone())
    base = "0123456789abcdef"
    assert generation_digest(base, {}) == base  # nothing loaded in place: the parameters' digest
    assert generation_digest("", {"w": tensor_digest("w", a)}) == ""  # no parameter digest: unshared
    d1 = generation_digest(base, {"w": tensor_digest("w", a)})
    d2 = generation_digest(base, {"w": tensor_digest("w", b)})
    assert d1 != d2 and d1 != base and d1.isalnum() and len(d1) == 16
