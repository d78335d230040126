"""Engine start-up failures say what is wrong and what to do."""

from __future__ import annotations

import pytest
from routes_oracle import make_llm

pytestmark = pytest.mark.vllm


@pytest.mark.slow  # a full engine start-up (40-190 s here); the unit test in test_integration_units is quick
def test_mla_model_on_cpu_says_prefix_caching_is_turned_off_by_vllm_cpu(capfd):
    """DeepSeek-V3 (MLA): vLLM-CPU turns prefix caching off whatever was asked; the message must say so.

    The worker's error is raised in the engine-core process; vLLM's exception in the caller only
    says the engine failed, so the reason is read from the engine's output (what the user sees).
    """
    from auxout.models import build_tiny_moe

    path = build_tiny_moe("deepseek_v3")
    with pytest.raises(RuntimeError):
        make_llm(path, max_model_len=256, enable_prefix_caching=True)
    out, err = capfd.readouterr()
    assert "vLLM-CPU turns prefix caching (and chunked prefill) off for models with multi-head latent" in out + err
    assert "needs prefix caching (enable_prefix_caching=True)" not in out + err
