"""``RouteCapture``'s two buffers: numpy on the host (CPU workers) and a torch tensor (GPU workers).

The tensor path is what ``AuxoutGPUWorker`` runs on an accelerator; here it is forced on a CPU
device so its capture (``copy_`` with a dtype narrowing), snapshot (a host copy that the next
step cannot overwrite) and bounds checks run in CI. The routers are stand-ins exposing vLLM's
``set_capture_fn`` hook: the capture buffer is the unit under test.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from auxout.errors import InvariantError
from auxout.profile import RouteProfile
from auxout.vllm.workers.capture import RouteCapture

pytestmark = pytest.mark.vllm


class _Router:
    def __init__(self) -> None:
        self.fn: Any = None

    def set_capture_fn(self, fn: Any) -> None:
        self.fn = fn


def _ids(rng: np.random.Generator, n: int, k: int, e: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32))


@pytest.mark.parametrize("num_layers", [3, 8], ids=["3-layers", "8-layers-stacked"])
@pytest.mark.parametrize("num_experts", [64, 512], ids=["uint8", "uint16"])
@pytest.mark.parametrize("host_buffer", [True, False], ids=["numpy", "tensor"])
def test_capture_and_snapshot(host_buffer, num_experts, num_layers):
    profile = RouteProfile(num_layers=num_layers, top_k=4, num_experts=num_experts)
    cap = RouteCapture(profile, max_tokens=32, device="cpu", host_buffer=host_buffer)
    assert cap.on_host is host_buffer
    assert isinstance(cap.buffer, torch.Tensor) and cap.buffer.dtype == (torch.uint8 if num_experts <= 256 else torch.uint16)
    if not host_buffer:  # the tensor path owns its own buffer: numpy writes would not reach it
        assert cap.buffer.data_ptr() != cap.host_buffer.ctypes.data
    routers = [_Router() for _ in range(num_layers)]
    cap.bind(routers)
    rng = np.random.default_rng(0)
    step1 = [_ids(rng, 10, 4, num_experts) for _ in range(num_layers)]
    for r, ids in zip(routers, step1, strict=True):
        r.fn(ids)
    snap1 = cap.snapshot(10)
    assert snap1.dtype == profile.dtype and snap1.shape == (10, num_layers, 4)
    expected1 = torch.stack(step1, dim=1).numpy().astype(profile.dtype)
    assert np.array_equal(snap1, expected1)
    # the next step overwrites the buffer; the earlier snapshot must not change
    step2 = [_ids(rng, 7, 4, num_experts) for _ in range(num_layers)]
    for r, ids in zip(routers, step2, strict=True):
        r.fn(ids)
    assert np.array_equal(snap1, expected1), "snapshot aliases the capture buffer"
    assert np.array_equal(cap.snapshot(7), torch.stack(step2, dim=1).numpy().astype(profile.dtype))
    if host_buffer:  # the host path copies at the snapshot: the bad call fails that snapshot, once
        routers[1].fn(_ids(rng, 33, 4, num_experts))
        with pytest.raises(InvariantError, match="routed 33 tokens"):
            cap.snapshot(7)
        assert np.array_equal(cap.snapshot(7), torch.stack(step2, dim=1).numpy().astype(profile.dtype))
        padded = [_ids(rng, 9, 4, num_experts) for _ in range(num_layers)]
        for r, ids in zip(routers, padded, strict=True):  # padded rows beyond the step's are dropped
            r.fn(ids)
        assert np.array_equal(cap.snapshot(7), torch.stack(padded, dim=1)[:7].numpy().astype(profile.dtype))
        for r, ids in zip(routers, step2, strict=True):  # a later buffer read sees the last snapshot's rows
            r.fn(ids)
        snap2 = cap.snapshot(7)
        assert np.array_equal(cap.rows_bytes(7).numpy().view(profile.dtype).reshape(snap2.shape), snap2)
        for r in routers:  # every layer routed, but fewer tokens than the step claims
            r.fn(_ids(rng, 5, 4, num_experts))
        with pytest.raises(InvariantError, match="routed 5 tokens, the step has 7"):
            cap.snapshot(7)
    else:
        with pytest.raises(InvariantError, match="routed 33 tokens"):
            routers[1].fn(_ids(rng, 33, 4, num_experts))
    with pytest.raises(InvariantError, match="exceeds capture buffer"):
        cap.snapshot(33)
    cap.unbind()
    assert all(r.fn is None for r in routers)


def test_numpy_buffer_cannot_live_on_a_device():
    with pytest.raises(ValueError, match="numpy capture buffer lives on the host"):
        RouteCapture(RouteProfile(2, 2, 8), 4, device="meta", host_buffer=True)


class _WeightedRouter(_Router):
    """A stand-in for vLLM's ``BaseRouter``: ``select_experts`` calls the capture with the ids
    (before an EPLB remap would change them) and returns ``(weights, ids)`` to the experts."""

    def __init__(self, weights: torch.Tensor, ids: torch.Tensor) -> None:
        super().__init__()
        self.weights, self.ids = weights, ids

    def select_experts(self, hidden_states: Any, router_logits: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fn is not None:
            self.fn(self.ids)
        return self.weights, self.ids + 1000  # what the experts get (physical ids): never captured


@pytest.mark.parametrize("num_experts", [64, 512], ids=["uint8", "uint16"])
@pytest.mark.parametrize("host_buffer", [True, False], ids=["numpy", "tensor"])
def test_weights_captured_with_their_ids(host_buffer, num_experts):
    profile = RouteProfile(num_layers=2, top_k=3, num_experts=num_experts, weights=True)
    cap = RouteCapture(profile, max_tokens=16, device="cpu", host_buffer=host_buffer)
    rng = np.random.default_rng(1)
    ids = [_ids(rng, 9, 3, num_experts) for _ in range(2)]
    weights = [torch.from_numpy(rng.random((9, 3), dtype=np.float32)) for _ in range(2)]
    routers = [_WeightedRouter(w, i) for w, i in zip(weights, ids, strict=True)]
    cap.bind(routers)
    for r in routers:
        w, physical = r.select_experts(None, None)  # the wrapper returns what the router returned
        assert w is r.weights and torch.equal(physical, r.ids + 1000)
    snap = cap.snapshot(9)
    assert snap.dtype == profile.dtype and snap.shape == (9, 2, 3)
    assert np.array_equal(snap["id"], torch.stack(ids, dim=1).numpy().astype(profile.id_dtype))
    assert np.array_equal(snap["w"], torch.stack(weights, dim=1).numpy())
    # PP stages ship the rows as bytes: the next stage's buffer rebuilds the same (id, weight) rows
    other = RouteCapture(profile, max_tokens=16, device="cpu", host_buffer=host_buffer)
    other.load_rows(cap.rows_bytes(9).clone())
    assert np.array_equal(other.snapshot(9), snap)
    # ids captured without their weights (a router path that skips select_experts) fail loudly
    routers[0].fn(ids[0])
    with pytest.raises(InvariantError, match="routing weights were not captured"):
        cap.snapshot(9)
    cap.unbind()
    assert "select_experts" not in vars(routers[0]) and all(r.fn is None for r in routers)
