"""One rank of the FSDP2 replay check (spawned twice by test_fsdp.py): sharded loss and full gradients per scenario."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

B, S = 2, 16  # samples per rank, tokens per sample


def batch(rank: int, num_experts: int, layers: int, k: int) -> tuple[torch.Tensor, np.ndarray]:
    """Rank-specific tokens and forced routes (no repeated experts in a row)."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, 128, (B, S), generator=g)
    rng = np.random.default_rng(200 + rank)
    routes = np.argsort(rng.random((B, S, layers, num_experts)), axis=-1)[..., :k]
    return ids, routes


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from conftest import build_tiny
        from torch.distributed.fsdp import fully_shard

        from auxout.trainer.hf import RouteRecorder, moe_layers, replay

        results = {}
        for ckpt in (False, True):
            model = build_tiny("qwen3_moe", seed=0)
            model.train()
            lay = moe_layers(model)
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            ids, routes = batch(rank, lay.num_experts, len(lay), lay.top_k)
            with replay(model, routes) as ctx, RouteRecorder(model) as rec:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
            used = rec.routes().reshape(-1, B, S, len(lay), lay.top_k)
            grads = {n: p.grad.full_tensor().detach().numpy() for n, p in model.named_parameters() if p.grad is not None}
            results[f"ckpt{int(ckpt)}"] = dict(
                loss=loss.item(), recompute=ctx.recompute_count, fallback=ctx.fallback_count,
                used_match=[bool(np.array_equal(u, routes)) for u in used], grads=grads,
            )
        if rank == 0:
            import pickle

            with open(os.path.join(out_dir, "fsdp.pkl"), "wb") as f:
                pickle.dump(results, f)
        else:
            import pickle

            with open(os.path.join(out_dir, f"fsdp_rank{rank}.pkl"), "wb") as f:
                pickle.dump({k: {"loss": v["loss"]} for k, v in results.items()}, f)
        dist.barrier()  # both ranks done before either tears gloo down (else, at times, an abort at exit)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    run(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    # Results are written and gloo is torn down: skip the interpreter's teardown, where a gloo
    # thread still being joined can abort the process ("terminate called without an active
    # exception", seen about once in 30 runs on a loaded machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
