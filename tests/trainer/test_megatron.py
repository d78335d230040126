"""auxout routes through megatron-core's RouterReplay: layout math, the sentinel-aware replay, and real MoE layers.

The end-to-end part runs Megatron's MoELayer (router, allgather dispatcher, SequentialMLP experts) on CPU
with gloo and one rank, in a subprocess spawned once (megatron_worker.py documents its one CPU shim).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # dev extra

from auxout.trainer import RouteTraceError
from auxout.trainer.hf import InvalidRoutesError
from auxout.trainer.megatron import (
    MegatronReplay,
    SentinelRouterReplay,
    pack_thd,
    per_layer_targets,
    rows_sbhd,
    sp_shard,
    stage_layers,
)

HERE = Path(__file__).parent
E, K = 8, 2


def _routes(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((*shape, E)), axis=-1)[..., :K]


# ---------------------------------------------------------------------- layout math
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_sbhd_rows_are_sequence_first(b, s, seed):
    r = _routes((b, s, 3), seed)
    rows = rows_sbhd(r)
    assert rows.shape == (s * b, 3, K)
    for si in range(s):
        for bi in range(b):
            np.testing.assert_array_equal(rows[si * b + bi], r[bi, si])  # what [S, B, H].view(-1, H) routes


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1))
def test_thd_packing_pads_with_no_route(lens, mult, seed):
    samples = [_routes((n, 2), seed + i) for i, n in enumerate(lens)]
    rows, cu, cu_pad = pack_thd(samples, pad_to_multiple=mult)
    assert cu.tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
    assert (np.diff(cu_pad) % mult == 0).all() and (np.diff(cu_pad) >= lens).all() and cu_pad[-1] == len(rows)
    filled = np.zeros(len(rows), bool)
    for smp, start in zip(samples, cu_pad[:-1]):
        np.testing.assert_array_equal(rows[start : start + len(smp)], smp)
        filled[start : start + len(smp)] = True
    assert (rows[~filled] == -1).all()  # padding tokens get the no-route row, never a filler id


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_sequence_parallel_shards(b, tp, chunk, seed):
    s = tp * chunk
    r = _routes((b, s, 2), seed)
    rows = rows_sbhd(r)
    shards = [sp_shard(rows, i, tp) for i in range(tp)]
    np.testing.assert_array_equal(np.concatenate(shards), rows)
    for i, sh in enumerate(shards):  # rank i holds positions [i*chunk, (i+1)*chunk) of every sample
        np.testing.assert_array_equal(sh, rows_sbhd(r[:, i * chunk : (i + 1) * chunk]))
    if tp > 1:
        with pytest.raises(RouteTraceError, match="sequence-parallel"):
            sp_shard(rows[:-1], 0, tp)


def test_pipeline_stage_layer_ranges():
    moe = [1, 2, 3, 5]  # hidden layers holding MoE (0 and 4 dense), 6 layers over 3 stages
    stages = [stage_layers(moe, lo, lo + 2) for lo in (0, 2, 4)]
    assert stages == [[0], [1, 2], [3]]
    assert sorted(sum(stages, [])) == list(range(len(moe)))
    rows = _routes((5, len(moe)), 1).reshape(5, len(moe), K)
    t = per_layer_targets(rows, layers=stages[1], num_experts=E)
    assert len(t) == 2 and t[0].dtype == torch.int64
    np.testing.assert_array_equal(t[1].numpy(), rows[:, 2])


def test_targets_refuse_corrupt_rows_allow_no_route():
    rows = _routes((6, 2), 2)
    rows[4, 1] = -1
    assert len(per_layer_targets(rows, num_experts=E)) == 2
    rows[3, 0] = [5, 5]  # sglang#23885: "Duplicate experts in routing!"
    with pytest.raises(InvalidRoutesError, match=r"rows\[3, moe_layer=0\] = \[5, 5\]"):
        per_layer_targets(rows, num_experts=E)
    rows[3, 0] = [0, 8]
    with pytest.raises(InvalidRoutesError, match=r"outside \[0, 8\)"):
        per_layer_targets(rows, num_experts=E)
    for layers in ([2], [-1], [0, 5]):  # (a raw IndexError, or the last layer picked silently)
        with pytest.raises(RouteTraceError, match=r"not MoE layer indices of rows with L=2"):
            per_layer_targets(rows, layers=layers)


# ---------------------------------------------------------------------- RouterReplay itself
@pytest.fixture
def registry():
    saved = list(RouterReplay.global_router_replay_instances)
    RouterReplay.clear_global_router_replay_instances()
    yield RouterReplay.global_router_replay_instances
    RouterReplay.clear_global_router_replay_instances()
    RouterReplay.global_router_replay_instances.extend(saved)


def test_sentinel_replay_takes_live_choice_only_on_no_route_rows(registry):
    rr = SentinelRouterReplay()
    scores = torch.randn(6, E, generator=torch.Generator().manual_seed(0))
    target = torch.from_numpy(_routes((6,), 3).astype(np.int64))
    target[2] = -1
    rr.set_target_indices(target)
    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, idx = rr.get_replay_topk(scores, K, None, None, lambda s, k, num_groups=None, group_topk=None: s.topk(k))
    keep = torch.ones(6, dtype=torch.bool)
    keep[2] = False
    assert torch.equal(idx[keep], target[keep])
    assert torch.equal(idx[2], scores[2].topk(K).indices)
    assert torch.equal(probs, scores.gather(1, idx))
    rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)  # recompute pops the queued target
    _, idx2 = rr.get_replay_topk(scores, K, None, None, lambda s, k, num_groups=None, group_topk=None: s.topk(k))
    assert torch.equal(idx2, idx) and rr.replay_backward_list == []
    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(ValueError, match="does not match the 5 tokens"):
        rr.get_replay_topk(scores[:5], K, None, None, None)


def test_microbatch_targets_go_to_layers_in_instantiation_order(registry):
    insts = [SentinelRouterReplay() for _ in range(3)]
    mbs = [per_layer_targets(_routes((4, 3), seed)) for seed in (0, 1)]
    with pytest.raises(ValueError, match="targets for 2 MoE layers; this stage has 3"):
        MegatronReplay([mbs[0][:2]])
    mr = MegatronReplay(mbs)
    for i in range(2):
        mr.before_forward(i)
        assert all(torch.equal(inst.target_topk_idx, mbs[i][j]) for j, inst in enumerate(insts))
        assert all(inst.router_replay_action == RouterReplayAction.REPLAY_FORWARD for inst in insts)
    assert [len(inst.replay_backward_list) for inst in insts] == [2, 2, 2]  # queued for recompute, FIFO
    with mr.backward():
        assert all(inst.router_replay_action == RouterReplayAction.REPLAY_BACKWARD for inst in insts)
    mr.finish()
    assert all(inst.router_replay_action is None and inst.replay_backward_list == [] for inst in insts)


# ---------------------------------------------------------------------- real Megatron MoE layers
@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(HERE / "megatron_worker.py"), str(out), str(port)], env=env,
                       capture_output=True, timeout=600)
    assert p.returncode == 0, p.stderr.decode(errors="replace")[-4000:]
    with open(out / "megatron.pkl", "rb") as f:
        return pickle.load(f)


def _sets(routing_map: np.ndarray) -> list[set[int]]:
    return [set(np.flatnonzero(row).tolist()) for row in routing_map]


def _per_layer_calls(seen, layer):
    return [m for i, m in seen if i == layer]


def test_megatron_layers_replay_in_forward_and_recompute(megatron_run):
    r = megatron_run
    assert r["num_instances"] == 2 and r["installed"]
    live, rep, rec = r["live"], r["replay"], r["replay_recompute"]
    for run, calls_per_mb in ((rep, 1), (rec, 2)):  # recompute: each MoE layer routes again inside backward
        for layer in range(2):
            calls = _per_layer_calls(run["seen"], layer)
            live_calls = _per_layer_calls(live["seen"], layer)
            assert len(calls) == 2 * calls_per_mb
            for n, routing_map in enumerate(calls):
                mb = n // calls_per_mb
                target = rows_sbhd(r["routes"][mb])[:, layer]
                got, live_sets = _sets(routing_map), _sets(live_calls[mb])
                for row, t in enumerate(target):
                    want = live_sets[row] if (t == -1).all() else set(t.tolist())  # no route: the live router
                    assert got[row] == want, (layer, n, row)
        for (i, routing_map), (j, counts) in zip(run["seen"], run["counts"]):  # the experts got those tokens
            assert i == j
            np.testing.assert_array_equal(routing_map.sum(0), counts)
    assert rec["left"] == [0, 0] and rep["left"] == [2, 2]  # recompute consumed exactly the queued targets
    # replay differs from live routing (so the check above is not vacuous), recompute changes no gradient
    assert any((a != b).any() for (_, a), (_, b) in zip(live["seen"], rep["seen"]))
    assert set(rep["grads"]) == set(rec["grads"]) and any("router" in n for n in rep["grads"])
    for n, g in rep["grads"].items():
        scale = float(np.abs(g).max())  # router grads are ~1e-13 here (Megatron's 0.02-std init): compare relatively
        assert scale > 0, n
        np.testing.assert_allclose(rec["grads"][n], g, rtol=1e-5, atol=1e-6 * scale, err_msg=n)
        if "router" in n:
            assert not np.allclose(g, live["grads"][n], rtol=1e-3, atol=1e-3 * scale), n


def test_upstream_router_replay_cannot_express_no_route(megatron_run):
    """Why auxout swaps in SentinelRouterReplay: upstream gathers a -1 id and fails."""
    assert "out of bounds" in megatron_run["upstream_sentinel"]
