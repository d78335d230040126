"""Megatron-core MoE layers on CPU (gloo, one rank) replaying auxout routes; spawned once by test_megatron.py.

CPU shim (the only one): megatron-core 0.16.1's ``TopKRouter.gating`` moves the router weight to
``torch.cuda.current_device()`` and its ``router_gating_linear`` calls ``te_general_gemm``, which is
undefined without Transformer Engine. Each router's ``gating`` is replaced by the same fp32 linear on
CPU; routing (``routing`` -> ``topk_routing_with_score_function`` -> ``RouterReplay``), dispatch and
experts are Megatron's own code. Megatron's own recompute (``moe_layer_recompute``) saves the CUDA RNG
state and cannot run on CPU, so recompute is ``torch.utils.checkpoint`` around each MoE layer: the
router still re-runs inside backward, which is what ``REPLAY_BACKWARD`` exists for.
"""

from __future__ import annotations

import os
import pickle
import sys
import types

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

E, K, H, S, B = 8, 2, 32, 6, 2


def cpu_gating(self, inp):
    return torch.nn.functional.linear(inp.float(), self.weight.float())


def build():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import TransformerConfig

    RouterReplay.clear_global_router_replay_instances()
    cfg = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
        moe_ffn_hidden_size=16, ffn_hidden_size=64, use_cpu_initialization=True, moe_enable_routing_replay=True,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, add_bias_linear=False,
        params_dtype=torch.float32, moe_router_load_balancing_type="none",
    )
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    torch.manual_seed(0)
    model = torch.nn.ModuleList([MoELayer(cfg, spec.submodules.mlp.submodules, layer_number=i + 1) for i in range(2)])
    for layer in model:
        layer.router.gating = types.MethodType(cpu_gating, layer.router)
    return model


def main(out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from auxout.trainer.megatron import (
        MegatronReplay,
        SentinelRouterReplay,
        install,
        per_layer_targets,
        rows_sbhd,
    )

    rng = np.random.default_rng(0)
    xs, routes = [], []
    for mb in range(2):
        xs.append(torch.randn(S, B, H, generator=torch.Generator().manual_seed(mb)))
        r = np.argsort(rng.random((B, S, 2, E)), axis=-1)[..., :K]
        r[1, S - 2 :] = -1  # padding of sample 1 (right-padded): no route
        routes.append(r)
    res: dict = {"routes": routes}

    def run(model, recompute: bool, replay: bool):
        seen: list[tuple[int, np.ndarray]] = []
        counts: list[tuple[int, np.ndarray]] = []
        hooks = []
        for i, layer in enumerate(model):
            hooks.append(layer.router.register_forward_hook(
                lambda m, a, o, i=i: seen.append((i, o[1].detach().numpy().copy()))))
            hooks.append(layer.experts.register_forward_pre_hook(
                lambda m, a, i=i: counts.append((i, a[1].detach().numpy().copy()))))
        model.zero_grad()
        targets = [per_layer_targets(rows_sbhd(r), num_experts=E) for r in routes]
        mr = MegatronReplay(targets) if replay else None
        for mb, x in enumerate(xs):
            if mr is not None:
                mr.before_forward(mb)
            h = x
            for layer in model:
                h = checkpoint(lambda t, layer=layer: layer(t)[0], h, use_reentrant=False) if recompute else layer(h)[0]
            loss = h.pow(2).mean()
            if mr is not None:
                with mr.backward():
                    loss.backward()
            else:
                loss.backward()
        left = [len(i.replay_backward_list) for i in RouterReplay.global_router_replay_instances]
        if mr is not None:
            mr.finish()
        for hk in hooks:
            hk.remove()
        grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
        return dict(seen=seen, counts=counts, grads=grads, left=left)

    model = build()
    res["num_instances"] = len(RouterReplay.global_router_replay_instances)
    insts = install(model)
    res["installed"] = all(isinstance(i, SentinelRouterReplay) for i in insts) and all(
        layer.router.router_replay is i for layer, i in zip(model, insts))
    res["live"] = run(model, recompute=False, replay=False)
    res["replay"] = run(model, recompute=False, replay=True)
    res["replay_recompute"] = run(model, recompute=True, replay=True)
    try:  # upstream RouterReplay cannot express "no route": a -1 id reaches torch.gather
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        plain = RouterReplay()
        plain.set_target_indices(per_layer_targets(rows_sbhd(routes[0]))[0])
        plain.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        plain.get_replay_topk(torch.randn(S * B, E), K, None, None, None)
        res["upstream_sentinel"] = "accepted"
    except Exception as e:  # noqa: BLE001 - the error text is the result
        res["upstream_sentinel"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, "megatron.pkl"), "wb") as f:
        pickle.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main(sys.argv[1], int(sys.argv[2]))
