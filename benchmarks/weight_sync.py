"""What a correct weight sync costs next to vLLM's ``reload_weights`` alone, in ONE run.

One in-process engine (``external_launcher``, as TRL's colocate mode builds it) with auxout; a
transformers copy of the checkpoint has every weight moved before each sync (a small random step,
as an optimizer step would move them), so each sync loads changed weights. Arms, in the order A B B A (repeated):

- A, ``reload``: vLLM's layerwise ``model_runner.reload_weights(weights_iterator=...)`` as vLLM
  ships it (auxout's MoE prepack repair swapped out for the call: the experts are then left
  wrong, the next sync rewrites them), checkpoint-named tensors (converted outside the timer),
  then ``reset_prefix_cache()``.
- B, ``update_weights``: ``auxout.vllm.update_weights(llm, model.named_parameters(), hf_model=model)``:
  name conversion, checks against the checkpoint, the same reload and repair, the reset.

Prints the median seconds of each arm, their ratio, and the median of the per-cycle ratios, with
the A/A and B/B pairs as the instrument's own noise. Timings on a shared machine are noisy.

    python benchmarks/weight_sync.py                       # tiny qwen3_moe, 24 syncs
    python benchmarks/weight_sync.py --size realistic --syncs 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ORDER = ("reload", "update", "update", "reload")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: the tiny qwen3_moe, or --size)")
    p.add_argument("--size", help="an auxout.testing.models.SIZES preset instead of the tiny model")
    p.add_argument("--syncs", type=int, default=24)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from auxout.testing.servers import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    import auxout.vllm
    from auxout.testing.models import build_sized_moe, build_tiny_moe
    from auxout.vllm import weight_sync

    path = args.model or (build_sized_moe(args.size) if args.size else build_tiny_moe("qwen3_moe"))
    llm = LLM(model=path, distributed_executor_backend="external_launcher", skip_tokenizer_init=True,
              dtype=args.dtype, enforce_eager=True, block_size=32, max_model_len=256, seed=0,
              **auxout.vllm.engine_kwargs())  # fmt: skip
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    config = llm.llm_engine.model_config.hf_config

    @torch.no_grad()
    def step() -> None:
        for t in model.parameters():
            t.add_(torch.randn(t.shape, generator=gen) * 1e-4)

    methods = [m for _, m in weight_sync._fused_moe_methods(runner.get_model())]

    def reload() -> float:
        named = weight_sync.checkpoint_named(model.named_parameters(), config, model)
        repaired = [m.process_weights_after_loading for m in methods]
        for m in methods:  # vLLM's own processing for this call
            m.process_weights_after_loading = m._auxout_unrepaired
        try:
            t = time.perf_counter()
            runner.reload_weights(weights_iterator=list(named.items()))
            llm.reset_prefix_cache()
            return time.perf_counter() - t
        finally:
            for m, f in zip(methods, repaired):
                m.process_weights_after_loading = f

    def update() -> float:
        t = time.perf_counter()
        auxout.vllm.update_weights(llm, model.named_parameters(), hf_model=model)
        return time.perf_counter() - t

    arms: dict[str, Any] = {"reload": reload, "update": update}
    times: dict[str, list[float]] = {"reload": [], "update": []}
    cycles: list[dict[str, list[float]]] = []
    update()  # (warm-up: first reload allocates)
    for i in range(args.syncs):
        arm = ORDER[i % len(ORDER)]
        if i % len(ORDER) == 0:
            cycles.append({"reload": [], "update": []})
        step()
        dt = arms[arm]()
        times[arm].append(dt)
        cycles[-1][arm].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    per_cycle = [statistics.mean(c["update"]) / statistics.mean(c["reload"]) for c in cycles if c["update"] and c["reload"]]
    noise_r = [c["reload"][1] / c["reload"][0] for c in cycles if len(c["reload"]) == 2]
    noise_u = [c["update"][1] / c["update"][0] for c in cycles if len(c["update"]) == 2]
    params = sum(t.numel() for t in model.parameters())
    print(f"model {path} ({params / 1e6:.1f}M parameters, engine {args.dtype}), {args.syncs} syncs, "
          f"{len(methods)} fused-MoE layers")  # fmt: skip
    print(f"  reload_weights + reset: median {med['reload'] * 1e3:.1f} ms")
    print(f"  update_weights:         median {med['update'] * 1e3:.1f} ms")
    print(f"  ratio of medians {med['update'] / med['reload']:.3f}; median per-cycle ratio "
          f"{statistics.median(per_cycle):.3f}; noise A/A {statistics.median(noise_r):.3f}, "
          f"B/B {statistics.median(noise_u):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
