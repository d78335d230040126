"""What replaying routes costs a training step: forward+backward with replay beside the same step without, same run.

    .venv/bin/python benchmarks/replay_cost.py [--rounds 6] [--tokens 4096] [--only hf,megatron] [--threads 1]

Arms, interleaved in ABBA order round by round (each round: plain, replay, replay, plain or the
reverse; the round's ratio is the mean replay step over the mean plain step):

- transformers (``auxout.trainer.hf.replay``), two families built from config in memory (fp32,
  random weights): ``qwen3_moe`` (64 experts, top-8) and ``mixtral`` (8 experts, top-2), each
  4 decoder layers of hidden size 256 on one ``--tokens`` sequence; the step is
  ``model(input_ids, labels=input_ids).loss.backward()``, and the replay step opens a fresh
  ``replay(model, routes)`` context around it, as a trainer does per batch;
- Megatron-core (``auxout.trainer.megatron``): 4 of its ``MoELayer`` (64 experts, top-8, hidden
  256) on CPU as the tests run them (gloo, one rank, the router's gating as an fp32 linear), on
  ``--tokens`` rows (sequence ``tokens / 2``, batch 2); the replay step builds the per-layer
  targets (``rows_sbhd`` + ``per_layer_targets`` with checks) and drives ``MegatronReplay``.

The replayed routes are the model's own live choice (recorded once before timing), so both arms
send every token to the same experts and the ratio is the cost of replay itself. Each step is
timed in wall time and in this process's CPU time; with one torch thread (the default) the CPU
time is the step's work, the steadier figure on a machine shared with other jobs. Printed per
model and clock: median step time of each arm, the median per-round ratio replay/plain (target
<= 1.02) and the lowest and highest round ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 128, "intermediate_size": 512,
                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 512},
}
COMMON = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "vocab_size": 2048, "tie_word_embeddings": False}


Times = dict[tuple[str, str], list[float]]  # (arm, clock) -> seconds per step, one per round


def abba(plain: Callable[[], Any], replay: Callable[[], Any], rounds: int) -> Times:
    """Wall and CPU seconds per step of each arm per round (one warm-up round first, not counted)."""
    arms = {"plain": plain, "replay": replay}
    out: Times = {(a, c): [] for a in arms for c in ("wall", "cpu")}
    for r in range(rounds + 1):
        order = ["plain", "replay", "replay", "plain"] if r % 2 else ["replay", "plain", "plain", "replay"]
        per: Times = {k: [] for k in out}
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            arms[name]()
            per[name, "wall"].append(time.perf_counter() - t0)
            per[name, "cpu"].append(time.process_time() - c0)
        if r:
            for k in out:
                out[k].append(statistics.mean(per[k]))
    return out


def report(label: str, times: Times) -> None:
    for clock in ("cpu", "wall"):
        plain, replay = times["plain", clock], times["replay", clock]
        ratios = sorted(r / p for p, r in zip(plain, replay, strict=True))
        print(f"{label:<44} {clock:<5} {statistics.median(plain) * 1e3:9.1f} {statistics.median(replay) * 1e3:10.1f} "
              f"{statistics.median(ratios):8.3f} {ratios[0]:6.3f}-{ratios[-1]:6.3f}", flush=True)


def bench_hf(family: str, tokens: int, rounds: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from auxout.trainer.hf import capture_routes, replay

    cfg = AutoConfig.for_model(family, **COMMON, **FAMILIES[family], max_position_embeddings=max(4096, tokens))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").train()
    ids = torch.randint(3, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    routes = capture_routes(model, ids)  # the live choice: both arms run the same experts

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    def replay_step() -> None:
        with replay(model, routes) as ctx:
            step()
        assert ctx.fallback_count == 0

    report(f"transformers {family} ({tokens} tokens)", abba(step, replay_step, rounds))


def _cpu_gating(self: Any, inp: torch.Tensor) -> torch.Tensor:
    """Megatron's router gating without Transformer Engine: the same fp32 linear, on CPU."""
    return torch.nn.functional.linear(inp.float(), self.weight.float())


def bench_megatron(tokens: int, rounds: int) -> None:
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.core.transformer.transformer_config import TransformerConfig

    from auxout.trainer.megatron import MegatronReplay, install, per_layer_targets, rows_sbhd

    ps.initialize_model_parallel(1, 1)
    experts, top_k, hidden, layers, batch = 64, 8, 256, 4, 2
    RouterReplay.clear_global_router_replay_instances()
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=4, num_moe_experts=experts, moe_router_topk=top_k,
        moe_ffn_hidden_size=128, ffn_hidden_size=512, use_cpu_initialization=True, moe_enable_routing_replay=True,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, add_bias_linear=False,
        params_dtype=torch.float32, moe_router_load_balancing_type="none",
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
    torch.manual_seed(0)
    model = torch.nn.ModuleList([MoELayer(cfg, spec.submodules.mlp.submodules, layer_number=i + 1) for i in range(layers)])
    for layer in model:
        layer.router.gating = types.MethodType(_cpu_gating, layer.router)
    install(model)
    seq = tokens // batch
    x = torch.randn(seq, batch, hidden, generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        h = x
        for layer in model:
            h = layer(h)[0]
        h.pow(2).mean().backward()

    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        h = x
        for layer in model:
            h = layer(h)[0]
    live = torch.stack(RouterReplay.get_recorded_data(), dim=1)  # [S*B rows, L, K] in Megatron's row order
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    routes = live.reshape(seq, batch, layers, top_k).permute(1, 0, 2, 3).numpy().astype(np.uint8)  # [B, S, L, K]

    def replay_step() -> None:
        mr = MegatronReplay([per_layer_targets(rows_sbhd(routes), num_experts=experts)])
        mr.before_forward(0)
        model.zero_grad(set_to_none=True)
        h = x
        for layer in model:
            h = layer(h)[0]
        with mr.backward():
            h.pow(2).mean().backward()
        mr.finish()

    report(f"megatron-core MoELayer x{layers} ({tokens} rows)", abba(step, replay_step, rounds))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--only", default="hf,megatron")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.only.split(",")
    print(f"{args.rounds} ABBA rounds, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'model':<44} {'clock':<5} {'plain ms':>9} {'replay ms':>10} {'ratio':>8} {'min-max':>13}", flush=True)
    if "hf" in parts:
        for family in FAMILIES:
            bench_hf(family, args.tokens, args.rounds)
    if "megatron" in parts:
        bench_megatron(args.tokens, args.rounds)


if __name__ == "__main__":
    main()
