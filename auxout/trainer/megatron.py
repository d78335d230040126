"""Routes into Megatron-core's ``RouterReplay`` (megatron-core >= 0.16), in the token order Megatron routes.

Megatron keeps one ``RouterReplay`` per MoE layer in ``RouterReplay.global_router_replay_instances``,
in router instantiation order, i.e. the MoE layers of *this pipeline stage* in layer order. Each
router sees its input flattened from Megatron's sequence-first layout:

* padded batch ``[S, B, H]`` -> row ``s * B + b``; packed THD ``[T, 1, H]`` -> row ``t``;
* with sequence parallelism a tensor-parallel rank holds a contiguous ``1/tp`` of the sequence
  dimension, so its rows are a contiguous ``1/tp`` block of those rows;
* with gradient accumulation each micro-batch is routed separately; with activation recompute
  the routers run again inside backward in the order of the forwards (``REPLAY_BACKWARD``
  pops targets first in, first out).

This module builds those per-layer ``[rows, K]`` int64 targets from auxout routes (pure numpy,
testable without Megatron) and, through :class:`MegatronReplay`, hands them to ``RouterReplay``.
Upstream ``RouterReplay`` gathers every target id, so it cannot express "no route" (an id of -1
crashes the gather; a filler id would be a real route): :func:`install` swaps each instance for
:class:`SentinelRouterReplay`, where an all ``-1`` row -- padding, the last token of a sample --
takes the live router's choice, exactly as :func:`auxout.trainer.hf.replay` does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from auxout.trainer.hf import InvalidRoutesError, route_row_problems
from auxout.trainer.route_trace import SENTINEL, RouteTraceError, is_index


# ---------------------------------------------------------------------- layout math (numpy)
def rows_sbhd(routes: Any) -> np.ndarray:
    """Padded ``[B, S, L, K]`` (auxout / HF layout) -> Megatron's sequence-first rows ``[S*B, L, K]``."""
    r = np.asarray(routes)
    if r.ndim != 4:
        raise RouteTraceError(f"padded routes must be [B, S, L, K], got shape {r.shape}")
    return np.ascontiguousarray(r.transpose(1, 0, 2, 3)).reshape(-1, *r.shape[2:])


def pack_thd(per_sample: Sequence[Any], pad_to_multiple: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed THD rows for Megatron: ``(routes [T, L, K], cu_seqlens, cu_seqlens_padded)``.

    Each sample's ``[S_i, L, K]`` rows (one per token, see ``RouteTrace.for_forward``) are padded
    with ``-1`` rows to a multiple of ``pad_to_multiple`` (Megatron pads each sequence to a multiple
    of ``tp * cp * 2`` for THD with CP), so a padding token is never given a route.
    """
    if not per_sample or pad_to_multiple < 1:
        raise RouteTraceError(f"need at least one sample and pad_to_multiple >= 1, got {pad_to_multiple}")
    arrs = [np.asarray(a) for a in per_sample]
    shape = arrs[0].shape[1:]
    if any(a.ndim != 3 or a.shape[1:] != shape for a in arrs):
        raise RouteTraceError(f"every sample must be [S_i, L, K] with the same [L, K] {shape}")
    lens = np.array([len(a) for a in arrs])
    padded = -(-lens // pad_to_multiple) * pad_to_multiple
    out = np.full((int(padded.sum()), *shape), SENTINEL, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu_pad = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    for a, start in zip(arrs, cu_pad[:-1]):
        out[start : start + len(a)] = a
    return out, cu, cu_pad


def sp_shard(rows: np.ndarray, tp_rank: int, tp_size: int) -> np.ndarray:
    """The rows a sequence-parallel rank routes: the contiguous ``tp_rank``-th of ``tp_size`` blocks.

    ``rows`` come from :func:`rows_sbhd` or :func:`pack_thd`; the sequence length must divide by
    ``tp_size`` (Megatron requires it), which keeps every block whole tokens of the same positions.
    """
    n = len(rows)
    if not 0 <= tp_rank < tp_size or n % tp_size:
        raise RouteTraceError(f"{n} rows do not split into {tp_size} sequence-parallel shards (rank {tp_rank})")
    step = n // tp_size
    return rows[tp_rank * step : (tp_rank + 1) * step]


def stage_layers(moe_layer_numbers: Sequence[int], first_layer: int, last_layer: int) -> list[int]:
    """Indices (into the route's MoE-layer axis) of the MoE layers a pipeline stage owns.

    ``moe_layer_numbers`` are the hidden-layer numbers of the MoE layers (``MoELayers.moe_to_hidden``,
    0-based); the stage holds hidden layers ``[first_layer, last_layer)``.
    """
    return [i for i, h in enumerate(moe_layer_numbers) if first_layer <= h < last_layer]


def per_layer_targets(rows: Any, layers: Sequence[int] | None = None, num_experts: int | None = None) -> list[torch.Tensor]:
    """``[rows, L, K]`` -> one int64 ``[rows, K]`` tensor per MoE layer (optionally a stage's ``layers``).

    With ``num_experts`` the rows are checked like :func:`auxout.trainer.hf.replay` does: a row that
    repeats an expert or names one out of range raises :class:`InvalidRoutesError` with its row and
    layer; all ``-1`` rows are allowed (no route).
    """
    r = np.asarray(rows)
    if r.ndim != 3 or r.dtype.kind not in "iu":
        raise RouteTraceError(f"rows must be integer [rows, L, K], got {r.dtype} {r.shape}")
    idx = list(range(r.shape[1])) if layers is None else list(layers)
    bad_layers = [i for i in idx if not is_index(i) or not 0 <= i < r.shape[1]]
    if bad_layers:
        raise RouteTraceError(f"layers {bad_layers} are not MoE layer indices of rows with L={r.shape[1]} (0..{r.shape[1] - 1})")
    t = torch.from_numpy(r[:, idx, :].astype(np.int64))
    if num_experts is not None:
        _, bad = route_row_problems(t, num_experts)
        if bool(bad.any()):
            row, layer = (int(v) for v in bad.nonzero()[0])
            raise InvalidRoutesError(
                f"Megatron replay rows[{row}, moe_layer={idx[layer]}] = {t[row, layer].tolist()} repeats an expert or "
                f"is outside [0, {num_experts}) ({int(bad.sum())} such rows); only an all -1 row means 'no route'"
            )
    return [t[:, j, :].contiguous() for j in range(len(idx))]


# ---------------------------------------------------------------------- Megatron side
def _replay_module() -> Any:
    try:
        from megatron.core.transformer.moe import router_replay
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("auxout.trainer.megatron needs megatron-core (pip install 'megatron-core>=0.16')") from e
    return router_replay


@functools.cache
def _sentinel_class() -> Any:
    rr = _replay_module()

    class SentinelRouterReplay(rr.RouterReplay):  # type: ignore[misc,name-defined]
        """``RouterReplay`` where an all ``-1`` target row means "no route": the live router decides."""

        def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Any = None, group_topk: Any = None,
                            default_compute_topk: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
            action = self.router_replay_action
            if action == rr.RouterReplayAction.REPLAY_FORWARD:
                target = self.target_topk_idx
            elif action == rr.RouterReplayAction.REPLAY_BACKWARD:
                target = self.replay_backward_list.pop(0)
            else:
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            if target is None or tuple(target.shape) != (scores.shape[0], topk):
                raise ValueError(
                    f"replay target {None if target is None else tuple(target.shape)} does not match the "
                    f"{scores.shape[0]} tokens x top-{topk} this router routes now (layout, micro-batch or SP shard?)"
                )
            target = target.to(scores.device)
            sentinel = (target == SENTINEL).all(dim=-1, keepdim=True)
            if bool(sentinel.any()):
                _, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                target = torch.where(sentinel, live, target)
            return scores.gather(1, target), target

    return SentinelRouterReplay


def __getattr__(name: str) -> Any:
    if name == "SentinelRouterReplay":  # built lazily: megatron-core is an optional dependency
        return _sentinel_class()
    raise AttributeError(name)


def install(model: Any) -> list[Any]:
    """Swap every ``RouterReplay`` of ``model`` for the sentinel-aware subclass, in place and in order.

    Call once after the model is built with ``moe_enable_routing_replay=True``. Returns the instances
    (one per MoE layer of this stage, instantiation order). The global registry must hold exactly
    ``model``'s routers (so targets cannot land on another model's layers).
    """
    rr = _replay_module()
    cls = _sentinel_class()
    instances = rr.RouterReplay.global_router_replay_instances
    if not instances:
        raise RuntimeError("no RouterReplay instances: build the model with moe_enable_routing_replay=True")
    owners = {id(m.router_replay): m for m in model.modules() if getattr(m, "router_replay", None) is not None}
    if set(owners) != {id(i) for i in instances}:
        raise RuntimeError(
            f"the RouterReplay registry holds {len(instances)} instances, the model's routers {len(owners)}: "
            f"call RouterReplay.clear_global_router_replay_instances() before building the model"
        )
    new = []
    for old in instances:
        inst = old
        if not isinstance(old, cls):
            inst = cls.__new__(cls)
            inst.__dict__.update(old.__dict__)
            owners[id(old)].router_replay = inst
        new.append(inst)
    instances[:] = new
    return new


class MegatronReplay:
    """Drives ``RouterReplay`` for one training step of micro-batches.

    >>> mr = MegatronReplay(targets_per_microbatch)   # list (micro-batch) of per-layer [rows, K] tensors
    >>> for i, mb in enumerate(micro_batches):        # forward_step of the schedule
    ...     mr.before_forward(i); loss = model(mb)
    ...     with mr.backward(): loss.backward()       # recomputed routers replay micro-batch i
    >>> mr.finish()
    """

    def __init__(self, targets: Sequence[Sequence[torch.Tensor]]) -> None:
        self.rr = _replay_module()
        self.instances = self.rr.RouterReplay.global_router_replay_instances
        for i, per_layer in enumerate(targets):
            if len(per_layer) != len(self.instances):
                raise ValueError(
                    f"micro-batch {i} has targets for {len(per_layer)} MoE layers; this stage has {len(self.instances)} "
                    f"routers (select the stage's layers with stage_layers)"
                )
        self.targets = targets

    def before_forward(self, microbatch: int) -> None:
        """Targets of ``microbatch`` for the forward (also queued for its recompute in backward)."""
        self.rr.RouterReplay.set_replay_data(list(self.targets[microbatch]))
        self.rr.RouterReplay.set_global_router_replay_action(self.rr.RouterReplayAction.REPLAY_FORWARD)

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Routers recomputed inside this block take the queued targets (activation recompute)."""
        self.rr.RouterReplay.set_global_router_replay_action(self.rr.RouterReplayAction.REPLAY_BACKWARD)
        try:
            yield
        finally:
            self.rr.RouterReplay.set_global_router_replay_action(self.rr.RouterReplayAction.REPLAY_FORWARD)

    def finish(self) -> None:
        """Drop targets and the replay action (the next step routes live unless replayed again)."""
        self.rr.RouterReplay.clear_global_indices()
        self.rr.RouterReplay.clear_global_router_replay_action()
