"""Capture the router's top-k ids of every fused-MoE layer of a vLLM model into one step buffer.

vLLM's routers call ``capture_fn(topk_ids)`` with logical (pre-EPLB) ids once per MoE layer
per forward. Rows land in a preallocated ``[max_tokens, num_moe_layers, top_k]`` buffer indexed
by MoE layer *order* (dense layers are skipped), already narrowed to the profile dtype, so a
step's snapshot is one contiguous copy. On CPU the buffer is a numpy array (a numpy assignment
costs a few microseconds, a small strided torch ``copy_`` several times that); on accelerators
it is a device tensor, so capture never synchronizes with the host.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from auxout.errors import InvariantError
from auxout.profile import RouteProfile

_TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16}


def find_moe_routers(model: torch.nn.Module) -> list[Any]:
    """The ``BaseRouter`` of every fused-MoE layer, in layer order."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runners = [m for m in model.modules() if isinstance(m, MoERunner)]
    runners.sort(key=lambda m: getattr(m, "layer_id", 0))
    routers = []
    for runner in runners:
        if runner._quant_method.is_monolithic:
            raise ValueError(f"auxout cannot capture routes of monolithic MoE kernel in layer {runner.layer_id}")
        if not isinstance(runner.router, BaseRouter):
            raise ValueError(f"auxout cannot capture routes of router {type(runner.router).__name__}")
        routers.append(runner.router)
    if not routers:
        raise ValueError("auxout found no fused-MoE router in the model: routes need an MoE model")
    return routers


def profile_from_model_config(model_config: Any, num_moe_layers: int) -> RouteProfile:
    """Route shape from vLLM's model config and the number of bound MoE layers."""
    return RouteProfile(
        num_layers=num_moe_layers,
        top_k=int(model_config.get_num_experts_per_tok()),
        num_experts=int(model_config.get_num_experts()),
    )


class RouteCapture:
    """Per-step capture buffer bound to a model's routers (one per worker)."""

    def __init__(self, profile: RouteProfile, max_tokens: int, device: torch.device | str = "cpu") -> None:
        self.profile = profile
        self.max_tokens = max_tokens
        shape = (max_tokens, profile.num_layers, profile.top_k)
        self.on_host = torch.device(device).type == "cpu"
        self.host_buffer = np.zeros(shape, dtype=profile.dtype)
        self.buffer = (
            torch.from_numpy(self.host_buffer)
            if self.on_host
            else torch.zeros(shape, dtype=_TORCH_DTYPES[profile.dtype], device=device)
        )
        self._routers: list[Any] = []

    def bind(self, routers: list[Any]) -> None:
        if len(routers) != self.profile.num_layers:
            raise ValueError(f"profile has {self.profile.num_layers} MoE layers but the model has {len(routers)}")
        for index, router in enumerate(routers):
            router.set_capture_fn(partial(self._capture, index))
        self._routers = routers

    def unbind(self) -> None:
        for router in self._routers:
            router.set_capture_fn(None)
        self._routers = []

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        n = topk_ids.shape[0]
        if n > self.max_tokens:
            raise InvariantError(f"MoE layer {layer} routed {n} tokens, capture buffer holds {self.max_tokens}")
        if self.on_host:
            self.host_buffer[:n, layer] = topk_ids.numpy()
        else:
            self.buffer[:n, layer].copy_(topk_ids)

    def snapshot(self, num_rows: int) -> np.ndarray:
        """A new host array with this step's first ``num_rows`` rows (the buffer is reused next step)."""
        if not 0 <= num_rows <= self.max_tokens:
            raise InvariantError(f"snapshot of {num_rows} rows exceeds capture buffer of {self.max_tokens}")
        if self.on_host:
            return self.host_buffer[:num_rows].copy()
        return self.buffer[:num_rows].cpu().numpy()


def bind_capture(model: torch.nn.Module, model_config: Any, max_tokens: int) -> RouteCapture:
    """Find the MoE routers of ``model`` and bind a fresh capture buffer to them."""
    routers = find_moe_routers(model)
    device = next(model.parameters()).device
    capture = RouteCapture(profile_from_model_config(model_config, len(routers)), max_tokens, device)
    capture.bind(routers)
    return capture
