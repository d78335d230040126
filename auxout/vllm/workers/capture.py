"""Capture the router's top-k ids of every fused-MoE layer of a vLLM model into one step buffer.

vLLM's routers call ``capture_fn(topk_ids)`` with logical (pre-EPLB) ids once per MoE layer
per forward. Rows land in a preallocated ``[max_tokens, num_moe_layers, top_k]`` buffer indexed
by MoE layer *order* (dense layers are skipped), already narrowed to the profile dtype, so a
step's snapshot is one contiguous copy. On accelerators the buffer is a device tensor, so
capture never synchronizes with the host. On CPU it is a numpy array, and a router's call only
keeps its ids tensor (``held[column] = topk_ids``, no Python frame at all; with routing weights
the wrapped ``select_experts`` keeps its weights tensor the same way); the snapshot copies every
layer's rows in one loop, straight into the new array it returns when every layer routed this
step (the buffer then gets those rows only if a later call reads it). A layer's forward streams
its weights through the caches, so a copy made inside the forward runs cold: measured about 60 us per layer in a realistic engine
against 4 us warm, which made capture the largest of auxout's per-step costs
(docs/performance.md). Holding the tensor is safe because the router makes a new ids tensor per
call and nothing writes to it in place (the EPLB remap and the dtype narrowing both copy; routers
scale or mask their weights before returning them); the bit-for-bit oracle tests check exactly
this, for ids and weights.

With routing weights on (``RouteProfile.weights``), each router instance's ``select_experts``
(vLLM's public routing call, which returns the ``(topk_weights, topk_ids)`` the experts combine
with) is wrapped on that instance only, and the weights land next to the ids in the same slots.
The ids still come from ``capture_fn`` (logical, before the EPLB remap; the remap is per slot, so
the slot order is the same).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from auxout.errors import InvariantError
from auxout.profile import RouteProfile

_TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16}
_UNWEIGHTED = (
    "routing weights were not captured for every routed layer this step: the router was called without "
    "its select_experts (a code path auxout does not wrap)"
)


def find_moe_routers(model: torch.nn.Module) -> list[Any]:
    """The ``BaseRouter`` of every fused-MoE layer, in layer order (this PP stage's layers)."""
    routers = [router for _, router in find_moe_routers_with_ids(model)]
    if not routers:
        raise ValueError("auxout found no fused-MoE router in the model: routes need an MoE model")
    return routers


def find_moe_routers_with_ids(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """``(decoder layer id, BaseRouter)`` of every fused-MoE layer of ``model``, in layer order."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runners = [m for m in model.modules() if isinstance(m, MoERunner)]
    runners.sort(key=lambda m: getattr(m, "layer_id", 0))
    routers: list[tuple[int, Any]] = []
    for runner in runners:
        if runner._quant_method.is_monolithic:
            raise ValueError(f"auxout cannot capture routes of monolithic MoE kernel in layer {runner.layer_id}")
        if not isinstance(runner.router, BaseRouter):
            raise ValueError(f"auxout cannot capture routes of router {type(runner.router).__name__}")
        routers.append((int(getattr(runner, "layer_id", len(routers))), runner.router))
    return routers  # empty on a PP stage without MoE layers


def profile_from_model_config(model_config: Any, num_moe_layers: int, weights: bool = False) -> RouteProfile:
    """Route shape from vLLM's model config and the number of bound MoE layers."""
    return RouteProfile(
        num_layers=num_moe_layers,
        top_k=int(model_config.get_num_experts_per_tok()),
        num_experts=int(model_config.get_num_experts()),
        weights=weights,
    )


_STACK_FROM = 8  # MoE layers from which snapshot stacks them (benchmarks/probes/capture_snapshot.py)


class RouteCapture:
    """Per-step capture buffer bound to a model's routers (one per worker)."""

    def __init__(
        self,
        profile: RouteProfile,
        max_tokens: int,
        device: torch.device | str = "cpu",
        *,
        host_buffer: bool | None = None,
    ) -> None:
        """``host_buffer`` forces the numpy (True) or torch-tensor (False) buffer; default: numpy
        exactly when ``device`` is the CPU (tests force the tensor path on a CPU device)."""
        self.profile = profile
        self.max_tokens = max_tokens
        shape = (max_tokens, profile.num_layers, profile.top_k)
        self.on_host = torch.device(device).type == "cpu" if host_buffer is None else host_buffer
        if self.on_host and torch.device(device).type != "cpu":
            raise ValueError(f"a numpy capture buffer lives on the host, not on {device}")
        self.host_buffer = np.zeros(shape, dtype=profile.dtype)
        self._id_size = profile.id_dtype.itemsize
        if profile.weights:  # torch has no structured dtype: the tensor is the rows' bytes
            self._host_ids, self._host_w = self.host_buffer["id"], self.host_buffer["w"]
            byte_shape = (max_tokens, profile.num_layers, profile.top_k * profile.dtype.itemsize)
            self.buffer = (
                torch.from_numpy(self.host_buffer.view(np.uint8))
                if self.on_host
                else torch.zeros(byte_shape, dtype=torch.uint8, device=device)
            )
        else:
            self.buffer = (
                torch.from_numpy(self.host_buffer)
                if self.on_host
                else torch.zeros(shape, dtype=_TORCH_DTYPES[profile.dtype], device=device)
            )
        self._routers: list[Any] = []
        self.columns: list[int] = []  # model-order MoE column of each bound router
        self._held: list[torch.Tensor | None] = [None] * profile.num_layers  # host ids not copied yet
        self._held_w: list[torch.Tensor | None] = [None] * profile.num_layers  # and their weights
        self._unweighted = 0  # id captures not (yet) followed by their weights: must be 0 at snapshot
        self._unbuffered: np.ndarray | None = None  # the last snapshot's rows, not in the buffer yet
        self._row_shape, self._row_dtype = profile.shape_per_token, profile.dtype
        self._ids_on_host = self.on_host and not profile.weights  # (snapshot's direct path)

    def bind(self, routers: list[Any], columns: list[int] | None = None) -> None:
        """Route router ``i`` into column ``columns[i]`` (default ``i``: all layers are local).

        With pipeline parallelism a stage binds only its own layers, at their model-order columns.
        """
        if columns is None:
            if len(routers) != self.profile.num_layers:
                raise ValueError(f"profile has {self.profile.num_layers} MoE layers but the model has {len(routers)}")
            columns = list(range(len(routers)))
        if len(columns) != len(routers) or len(set(columns)) != len(columns):
            raise ValueError(f"need one distinct column per router, got {columns} for {len(routers)} routers")
        if any(not 0 <= c < self.profile.num_layers for c in columns):
            raise ValueError(f"columns {columns} out of range for {self.profile.num_layers} MoE layers")
        for column, router in zip(columns, routers):
            if self.on_host:  # (C-level setitems: the copies wait for the snapshot)
                router.set_capture_fn(partial(self._held.__setitem__, column))
                if self.profile.weights:
                    _wrap_select_experts(router, partial(self._held_w.__setitem__, column))
            elif self.profile.weights:
                router.set_capture_fn(partial(self._capture_ids, column))
                _wrap_select_experts(router, partial(self._capture_weights, column))
            else:
                router.set_capture_fn(partial(self._capture, column))
        self._routers = routers
        self.columns = list(columns)

    def rows_bytes(self, num_rows: int) -> torch.Tensor:
        """This step's first ``num_rows`` rows as ``[n, L*k*itemsize]`` uint8 (a view: PP send)."""
        self._copy_held()
        rows = self.buffer[:num_rows]
        return rows.reshape(num_rows, -1).view(torch.uint8)

    def load_rows(self, data: torch.Tensor) -> None:
        """Write rows received from the previous PP stage (as :meth:`rows_bytes` made them)."""
        n = data.shape[0]
        if n > self.max_tokens or data.dtype != torch.uint8 or data.shape[1:] != (self.profile.token_nbytes,):
            raise InvariantError(
                f"received PP capture rows {tuple(data.shape)} {data.dtype}, expected at most "
                f"({self.max_tokens}, {self.profile.token_nbytes}) uint8"
            )
        self._copy_held()
        self.buffer[:n].reshape(n, -1).view(torch.uint8).copy_(data)

    def unbind(self) -> None:
        self._held[:] = [None] * len(self._held)
        self._held_w[:] = [None] * len(self._held_w)
        for router in self._routers:
            router.set_capture_fn(None)
            if "select_experts" in vars(router):  # our per-instance wrapper: the class method again
                del router.select_experts
        self._routers = []
        self.columns = []

    def _copy_held(self) -> None:
        """Copy the ids (and weights) the host path's routers left since the last copy into the buffer."""
        held, held_w = self._held, self._held_w
        if self._unbuffered is not None:  # the last snapshot went around the buffer: its rows first
            last, self._unbuffered = self._unbuffered, None
            self.host_buffer[: len(last)] = last
        if not self.profile.weights:  # (ids only: the per-step path, lean)
            ids = held[:]
            held[:] = [None] * len(held)  # (cleared first: a bad call must not stay behind for the next step)
            buf = self.host_buffer
            for layer, topk_ids in enumerate(ids):
                if topk_ids is not None:
                    buf[: self._rows(layer, topk_ids), layer] = topk_ids.numpy()
            return
        if all(t is None for t in held) and all(w is None for w in held_w):  # (not list.count: tensors' ==)
            return
        pairs = list(zip(held, held_w))
        held[:] = [None] * len(held)
        held_w[:] = [None] * len(held_w)
        for layer, (topk_ids, topk_weights) in enumerate(pairs):
            if topk_ids is None and topk_weights is None:
                continue
            if topk_ids is None or topk_weights is None or len(topk_weights) != len(topk_ids):
                raise InvariantError(_UNWEIGHTED)
            n = self._rows(layer, topk_ids)
            self._host_ids[:n, layer] = topk_ids.numpy()
            self._host_w[:n, layer] = topk_weights.float().numpy()

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Device path: copy in the forward (CUDA graphs replay the copy; nothing is held)."""
        n = self._rows(layer, topk_ids)
        self.buffer[:n, layer].copy_(topk_ids)

    def _capture_ids(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Device path with routing weights on: the ids go into the slots' id field."""
        n = self._rows(layer, topk_ids)
        self._unweighted += 1
        ids = topk_ids.to(_TORCH_DTYPES[self.profile.id_dtype]).contiguous().view(torch.uint8)
        self._slots(n, layer)[..., : self._id_size].copy_(ids.view(n, self.profile.top_k, self._id_size))

    def _capture_weights(self, layer: int, topk_weights: torch.Tensor) -> None:
        n = self._rows(layer, topk_weights)
        self._unweighted -= 1
        w = topk_weights.to(torch.float32).contiguous().view(torch.uint8)
        self._slots(n, layer)[..., self._id_size :].copy_(w.view(n, self.profile.top_k, 4))

    def _rows(self, layer: int, routed: torch.Tensor) -> int:
        """Rows one router call routed (its tokens), checked against the buffer."""
        n = routed.shape[0]
        if n > self.max_tokens:
            raise InvariantError(f"MoE layer {layer} routed {n} tokens, capture buffer holds {self.max_tokens}")
        return int(n)

    def _slots(self, n: int, layer: int) -> torch.Tensor:
        """Device byte buffer rows ``[:n]`` of one layer as ``[n, top_k, item bytes]`` (a view)."""
        return self.buffer[:n, layer].view(n, self.profile.top_k, self.profile.dtype.itemsize)

    def snapshot(self, num_rows: int) -> np.ndarray:
        """A new host array with this step's first ``num_rows`` rows (the buffer is reused next step)."""
        held = self._held
        # (``is`` tests, not ``None in held``: that compares with each tensor's ``==``, ~100 us)
        if self._ids_on_host and 0 <= num_rows <= self.max_tokens and all(t is not None for t in held):
            # every layer routed this step (no PP stage's rows in the buffer): one new array, each
            # layer copied straight into it (the buffer's copy and the copy out of it, in one)
            ids = held[:]
            held[:] = [None] * len(held)
            if len(ids) >= _STACK_FROM and all(len(t) == num_rows for t in ids):  # type: ignore[arg-type]
                # many layers: one torch.stack and one cast instead of two calls per layer
                # (from 8 layers; 16: 0.8x the time, 48: 0.6x, benchmarks/probes/capture_snapshot.py)
                out = torch.stack(ids, 1).numpy().astype(self._row_dtype)  # type: ignore[arg-type]
                self._unbuffered = out
                return out
            out = np.empty((num_rows, *self._row_shape), dtype=self._row_dtype)
            for layer, topk_ids in enumerate(ids):
                assert topk_ids is not None
                rows = topk_ids.numpy()  # (sliced and measured as numpy: torch's calls cost more)
                if len(rows) != num_rows:
                    if self._rows(layer, topk_ids) < num_rows:
                        raise InvariantError(f"MoE layer {layer} routed {len(rows)} tokens, the step has {num_rows}")
                    rows = rows[:num_rows]
                out[:, layer] = rows
            self._unbuffered = out  # (the buffer gets these rows only if a later call reads it)
            return out
        self._copy_held()
        if not 0 <= num_rows <= self.max_tokens:
            raise InvariantError(f"snapshot of {num_rows} rows exceeds capture buffer of {self.max_tokens}")
        if self._unweighted:
            self._unweighted = 0
            raise InvariantError(_UNWEIGHTED)
        if self.on_host:
            return self.host_buffer[:num_rows].copy()
        # copy=True: on a CPU device .cpu() would alias the buffer the next step overwrites
        rows = self.buffer[:num_rows].to("cpu", copy=True).numpy()
        return rows.view(self.profile.dtype) if self.profile.weights else rows


def _wrap_select_experts(router: Any, record: Any) -> None:
    """Record the combine weights ``router.select_experts`` returns (this instance only)."""
    original = type(router).select_experts.__get__(router)

    def select_experts(*args: Any, **kwargs: Any) -> Any:
        topk_weights, topk_ids = original(*args, **kwargs)
        record(topk_weights)
        return topk_weights, topk_ids

    router.select_experts = select_experts


def bind_capture(
    model: torch.nn.Module, model_config: Any, max_tokens: int, pp_size: int = 1, weights: bool = False
) -> RouteCapture:
    """Find the MoE routers of ``model`` (this PP stage's) and bind a fresh capture buffer to them.

    The buffer always spans every MoE layer of the model, in model order.
    """
    from auxout.vllm.workers.topology import moe_columns

    found = find_moe_routers_with_ids(model)
    total, columns = moe_columns([layer for layer, _ in found], pp_size)
    if total == 0:
        raise ValueError("auxout found no fused-MoE router in the model: routes need an MoE model")
    device = next(model.parameters()).device
    capture = RouteCapture(profile_from_model_config(model_config, total, weights), max_tokens, device)
    capture.bind([router for _, router in found], columns)
    return capture
