"""Every MoE architecture in the pinned transformers: replay works (round trip, forced ids, gradient) or refuses loudly.

The lists below are docs/trainer.md's status table; the first test fails when transformers gains or
loses an MoE family, so the table cannot go stale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families import VOCAB, build, moe_model_types

from auxout.trainer.hf import RouteRecorder, capture_routes, moe_layers, replay

SUPPORTED = (
    "afmoe", "axk1", "axk2", "cohere2_moe", "deepseek_v2", "deepseek_v3", "ernie4_5_moe", "exaone_moe", "flex_olmo",
    "glm4_moe", "glm4_moe_lite", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoeshared", "hy_v4",
    "kimi_linear", "laguna", "mellum", "minimax", "minimax_m2", "mixtral", "nemotron_h", "olmoe", "qwen2_moe",
    "qwen3_5_moe", "qwen3_moe", "qwen3_next", "solar_open",
)
REFUSED = {  # auxout raises a clear error instead of replaying: the router does something else
    "phimoe": "none of the weighting rules",  # sparsemixer: weights depend on a masked second pass
    "hy_v3": "none of the weighting rules",
    "zaya": "does not return \\(logits, weights, ids\\)",
    "jetmoe": "has no MoE router modules",
    "llama4": "not called with \\(hidden, top_k_ids",
    "deepseek_v4": "repeats an expert",  # hash-routed layers: ids from a token table, repeated in a random model
}
NOT_TRIED = {  # no tiny text-only causal LM from the generic config (multimodal, encoder-decoder, config quirks)
    "aria", "deepseek_ocr2", "glm4v_moe", "minimax_m3_vl", "mistral4", "openai_privacy_filter", "qwen3_omni_moe",
    "qwen3_vl_moe", "step3p7", "switch_transformers", "nllb_moe", "inkling", "gemma4", "diffusion_gemma", "dbrx",
    "dots1", "ernie4_5_vl_moe", "lfm2_moe", "qwen4_exp", "granitemoehybrid", "longcat_flash", "mimo_v2_flash",
    "deepseek_v32", "glm_moe_dsa", "glm5_next",
}
S = 12


def test_status_table_covers_every_moe_family():
    found = set(moe_model_types())
    listed = set(SUPPORTED) | set(REFUSED) | NOT_TRIED
    assert found == listed, f"new: {sorted(found - listed)}, gone: {sorted(listed - found)}"


def _forced(n: int, layers: int, experts: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((n, layers, experts)), axis=-1)[..., :k]


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_family_round_trip_forced_ids_and_gradient(model_type):
    model = build(model_type)
    lay = moe_layers(model)
    ids = torch.randint(3, VOCAB, (1, S), generator=torch.Generator().manual_seed(1))
    with RouteRecorder(model) as rec, torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    with replay(model, rec.routes()) as ctx, torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    assert ctx.fallback_count == 0
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)  # replaying the live routes changes nothing

    # forced ids reach the experts, and with ids fixed the loss is smooth in the router weights: autograd's
    # directional derivative must match a central finite difference
    forced = _forced(S, len(lay), lay.num_experts, lay.top_k, 2)
    w = next(p for p in lay[0].router.parameters() if p.ndim == 2)
    model.train()
    try:
        model.zero_grad()
        with replay(model, forced), RouteRecorder(model) as rec:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        np.testing.assert_array_equal(np.sort(rec.routes(), -1), np.sort(forced, -1))
        assert w.grad is not None and w.grad.abs().sum() > 0
        d = w.grad / w.grad.norm()
        eps = 1e-2
        vals = []
        with torch.no_grad():
            for sign in (1, -1):
                w.add_(sign * eps * d)
                with replay(model, forced):
                    vals.append(model(input_ids=ids, labels=ids, use_cache=False).loss.item())
                w.sub_(sign * eps * d)
        fd = (vals[0] - vals[1]) / (2 * eps)
        ad = float((w.grad * d).sum())
        assert fd == pytest.approx(ad, rel=5e-2, abs=1e-5), (fd, ad)
    finally:
        model.zero_grad()
        model.eval()


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_unsupported_family_refuses_loudly(model_type):
    model = build(model_type)
    ids = torch.randint(3, VOCAB, (1, S), generator=torch.Generator().manual_seed(1))
    with pytest.raises((TypeError, ValueError), match=REFUSED[model_type]):
        lay = moe_layers(model)
        with replay(model, capture_routes(model, ids[0])), torch.no_grad():
            model(input_ids=ids, use_cache=False)
        del lay
