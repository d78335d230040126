"""Tiny random MoE models (hidden 64, 8 experts, top-2) built from transformers configs, shared per module."""

from __future__ import annotations

import pytest
import torch

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")
VOCAB = 128


def tiny_config(arch: str):
    """Config of a ~100k-parameter model; DeepSeek gets 3 layers with the first dense (2 MoE layers)."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "qwen3_moe":
        extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)
    elif arch == "qwen2_moe":
        extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                     shared_expert_intermediate_size=48)
    elif arch == "mixtral":
        extra = dict(num_local_experts=8, num_experts_per_tok=2)
    elif arch == "olmoe":
        extra = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    elif arch == "deepseek_v3":
        extra = dict(num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4, n_routed_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                     q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     routed_scaling_factor=2.5, norm_topk_prob=True)
    elif arch == "gpt_oss":
        extra = dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=64,
                     layer_types=["sliding_attention", "full_attention"],
                     rope_parameters=dict(rope_type="default", rope_theta=150000.0))
    else:
        raise ValueError(arch)
    return AutoConfig.for_model(arch, **{**common, **extra})


def build_tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, router_std: float = 0.125):
    """Random model; router weights scaled (std 1/sqrt(H)) so top-k margins look like a trained model's."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=dtype)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith(("TopKRouter", "TopkRouter")):
                m.weight.normal_(0.0, router_std)
                if hasattr(m, "e_score_correction_bias"):
                    m.e_score_correction_bias.normal_(0.0, 0.05)
    return model.eval()


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    return request.param, build_tiny(request.param)
