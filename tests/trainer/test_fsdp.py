"""Replay under FSDP2 (`fully_shard`, 2 gloo ranks on CPU): same losses and gradients as the unsharded model.

The two ranks are spawned once for the module (fsdp_worker.py); they run plain and activation-checkpointed
training steps with forced routes and report losses, the ids the experts received and the full gradients.
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
from conftest import build_tiny
from fsdp_worker import batch

from auxout.trainer.hf import moe_layers, replay

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(HERE / "fsdp_worker.py"), str(r), "2", str(port), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    with open(out / "fsdp.pkl", "rb") as f:
        res = pickle.load(f)
    with open(out / "fsdp_rank1.pkl", "rb") as f:
        res1 = pickle.load(f)
    return res, res1


@pytest.fixture(scope="module")
def reference():
    """Unsharded model, same forced routes: per-rank losses and the gradient of their mean (what FSDP2 reduces)."""
    model = build_tiny("qwen3_moe", seed=0)
    model.train()
    lay = moe_layers(model)
    losses = []
    for rank in range(2):
        ids, routes = batch(rank, lay.num_experts, len(lay), lay.top_k)
        with replay(model, routes):
            losses.append(model(input_ids=ids, labels=ids, use_cache=False).loss)
    (sum(losses) / 2).backward()
    grads = {n: p.grad.detach().numpy() for n, p in model.named_parameters() if p.grad is not None}
    return [x.item() for x in losses], grads


@pytest.mark.parametrize("scenario", ["ckpt0", "ckpt1"])
def test_fsdp2_replay_matches_unsharded(sharded, reference, scenario):
    res, res1 = sharded
    ref_losses, ref_grads = reference
    r = res[scenario]
    assert r["fallback"] == 0 and all(r["used_match"])  # every expert call got the forced ids
    assert len(r["used_match"]) == (2 if scenario == "ckpt1" else 1)  # checkpointing recomputed the MoE blocks
    assert r["recompute"] == (2 if scenario == "ckpt1" else 0)  # ... and the recompute took the forward's ids
    assert r["loss"] == pytest.approx(ref_losses[0], rel=1e-5)
    assert res1[scenario]["loss"] == pytest.approx(ref_losses[1], rel=1e-5)
    assert set(r["grads"]) == set(ref_grads)
    router = [n for n in ref_grads if n.endswith("mlp.gate.weight")]
    assert router and all(np.abs(ref_grads[n]).sum() > 0 for n in router)
    for n, g in ref_grads.items():
        np.testing.assert_allclose(r["grads"][n], g, rtol=1e-4, atol=1e-6, err_msg=n)


def test_unreplayed_gradients_differ(reference):
    """Control: the live router's choice gives different router gradients, so the match above is not vacuous."""
    model = build_tiny("qwen3_moe", seed=0)
    model.train()
    ids, _ = batch(0, 8, 2, 2)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    g = model.model.layers[0].mlp.gate.weight.grad
    assert not torch.allclose(g, torch.from_numpy(reference[1]["model.layers.0.mlp.gate.weight"]), atol=1e-6)
