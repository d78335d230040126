"""Every MoE architecture in the installed transformers, with a generic tiny config (for the status table)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

VOCAB = 128

SIZES: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "head_dim": 16, "max_position_embeddings": 256, "num_experts_per_tok": 2,
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 0, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "sliding_window": 64, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


def moe_model_types() -> list[str]:
    """Model types whose transformers modeling code defines a router class and an experts module."""
    import transformers

    root = Path(transformers.__file__).parent / "models"
    out = []
    for d in sorted(root.iterdir()):
        f = d / f"modeling_{d.name}.py"
        if not f.is_file():
            continue
        src = f.read_text(encoding="utf-8")
        if re.search(r"^class \w*(Router|TopKGating)\w*\(", src, re.M) and "experts" in src:
            out.append(d.name)
    return sorted(out)


def tiny_config(model_type: str):
    """The architecture's default config shrunk: only keys the config already has are changed."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    text = getattr(cfg, "text_config", None)
    target = text if text is not None and hasattr(text, "hidden_size") else cfg
    for k, v in SIZES.items():
        if hasattr(target, k):
            setattr(target, k, v)
    lt = getattr(target, "layer_types", None)
    if isinstance(lt, list) and lt:
        moe_like = [t for t in lt if "linear" not in str(t) and "mamba" not in str(t)] or lt
        target.layer_types = (moe_like * 2)[:2]
    return cfg


def build(model_type: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)
    with torch.no_grad():  # trained-like router margins: the weighting rule is then unambiguous
        for m in model.modules():
            if type(m).__name__.endswith(("Router", "TopKGating")):
                for p in m.parameters():
                    if p.ndim == 2:
                        p.normal_(0.0, 0.125)
    return model.eval()
