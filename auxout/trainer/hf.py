"""Routing capture and replay for transformers (>= 5.16) MoE models.

In transformers 5.x every MoE router module returns ``(logits, weights, top_k_ids)`` and the MoE
block hands ``(hidden, ids, weights)`` to its experts module. auxout hooks exactly there:

* :func:`capture_routes` is the oracle: a full forward, with the ids the experts really received
  (pre-hook on each experts module), per MoE layer.
* :func:`replay` forces given ids and recomputes the weights from the model's *own* router logits
  with that architecture's rule, so the trainer sees the rollout's experts while gradients still
  reach the router (Rollout Routing Replay, R3).

Routes are indexed by MoE layer, never by hidden-layer number: dense layers (e.g. DeepSeek's
``first_k_dense_replace``) have no row. See :func:`moe_layers` for the mapping.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from auxout.errors import AuxOutError
from auxout.profile import id_dtype_for

SENTINEL = -1
"""Route value meaning "no route for this (token, layer)": the live router decides."""

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer: its position among MoE layers, its hidden-layer number and its modules."""

    moe_index: int
    hidden_index: int
    router: nn.Module
    experts: nn.Module
    rule: str
    name: str


@dataclass(frozen=True)
class MoELayers:
    """Ordered MoE layers of a model, with the hidden-layer -> MoE-layer mapping made explicit."""

    layers: tuple[MoELayer, ...]
    num_experts: int
    top_k: int
    num_hidden_layers: int

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[MoELayer]:
        return iter(self.layers)

    def __getitem__(self, i: int) -> MoELayer:
        return self.layers[i]

    @property
    def hidden_to_moe(self) -> dict[int, int]:
        """Hidden-layer number -> MoE-layer index (dense layers are absent)."""
        return {m.hidden_index: m.moe_index for m in self.layers}

    @property
    def moe_to_hidden(self) -> list[int]:
        return [m.hidden_index for m in self.layers]

    @property
    def routers(self) -> list[nn.Module]:
        return [m.router for m in self.layers]

    @property
    def route_dtype(self) -> np.dtype:
        """uint8 when every id fits (<= 256 experts), else uint16 -- the wire dtype engines use."""
        return id_dtype_for(self.num_experts)


ROUTER_SUFFIXES = ("TopKRouter", "TopkRouter", "Router", "TopKGating")
"""Class-name endings of transformers MoE routers (5.x): every such module returns
``(logits [T, E], weights [T, k], ids [T, k])`` and sits beside an ``experts`` module."""

CALIBRATION_CALLS = 4
"""Router calls per layer checked against the router's own weights before the rule is trusted."""

RULES = ("softmax_topk_renorm", "softmax_topk", "topk_softmax", "sigmoid_group", "sigmoid_topk", "sigmoid_topk_renorm")
"""Weighting rules auxout can recompute for forced ids; the live router's own output decides which one applies."""


def _rule_for(router: nn.Module) -> str | None:
    """First guess of the weighting rule from the router's class and attributes (checked on first use)."""
    cls = type(router).__name__
    if cls.startswith("GptOss"):
        return "topk_softmax"
    if hasattr(router, "e_score_correction_bias") and hasattr(router, "routed_scaling_factor"):
        return "sigmoid_group"
    if cls.startswith("Mixtral"):
        return "softmax_topk_renorm"
    if hasattr(router, "norm_topk_prob"):
        return "softmax_topk_renorm" if router.norm_topk_prob else "softmax_topk"
    return None


def _router_attr(router: nn.Module, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = getattr(router, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def moe_layers(model: nn.Module) -> MoELayers:
    """Find every MoE router in hidden-layer order, generically.

    A router is a module whose class name ends with one of :data:`ROUTER_SUFFIXES`, that sits
    inside a decoder layer (``layers.N.``) next to an ``experts`` module, and knows its ``top_k``
    and expert count. The weighting rule is guessed from the class and verified against the
    router's own output on the first replayed forwards of each router module (see :func:`replay`;
    the result is kept for the module's later replay contexts).
    """
    found: list[tuple[int, str, nn.Module]] = []
    modules = dict(model.named_modules())
    for name, mod in modules.items():
        if not type(mod).__name__.endswith(ROUTER_SUFFIXES) or "." not in name:
            continue
        parent = modules[name.rsplit(".", 1)[0]]
        if not isinstance(getattr(parent, "experts", None), nn.Module):
            continue
        m = _LAYER_RE.search(name)
        if m is None:
            raise TypeError(f"router {name!r} is not inside a decoder layer (`layers.N.`)")
        found.append((int(m.group(1)), name, mod))
    if not found:
        raise TypeError(f"{type(model).__name__} has no MoE router modules (`*Router` beside an `experts` module)")
    found.sort(key=lambda t: t[0])
    hidden = [h for h, _, _ in found]
    if len(set(hidden)) != len(hidden):
        raise TypeError(f"more than one router per decoder layer: {hidden}")
    layers = []
    for i, (h, name, router) in enumerate(found):
        experts = getattr(modules[name.rsplit(".", 1)[0]], "experts")  # noqa: B009
        layers.append(MoELayer(i, h, router, experts, _rule_for(router) or "", name))
    ks = {_router_attr(r, ("top_k", "num_experts_per_tok")) for _, _, r in found}
    es = {_router_attr(r, ("num_experts", "n_routed_experts", "num_local_experts")) for _, _, r in found}
    k, e = ks.pop(), es.pop()
    if ks or es:
        raise TypeError("MoE layers disagree on top_k / num_experts")
    if k is None or e is None:
        raise TypeError(f"router {type(found[0][2]).__name__} does not expose top_k / num_experts")
    cfg = getattr(model, "config", None)
    n_hidden = int(getattr(cfg, "num_hidden_layers", max(hidden) + 1))
    return MoELayers(tuple(layers), e, k, n_hidden)


def routing_weights(rule: str, router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Weights of the chosen experts ``idx`` from router ``logits`` with the architecture's rule.

    For ids equal to the live top-k this reproduces the router's own weights bit for bit (same ops,
    same order), so replaying captured routes leaves the forward unchanged.
    """
    if rule == "topk_softmax":  # GPT-OSS: softmax over the k selected raw logits
        return torch.softmax(logits.gather(-1, idx), dim=-1, dtype=logits.dtype)
    if rule == "sigmoid_group":  # DeepSeek-V3: sigmoid scores (no correction bias), renorm, scale
        w = logits.sigmoid().gather(-1, idx)
        if getattr(router, "norm_topk_prob", False):
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * float(getattr(router, "routed_scaling_factor", 1.0))
    if rule in ("sigmoid_topk", "sigmoid_topk_renorm"):  # e.g. MiniMax-M2, AFMoE (with route_scale)
        w = logits.float().sigmoid().gather(-1, idx)
        if rule == "sigmoid_topk_renorm":
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        scale = getattr(router, "routed_scaling_factor", getattr(router, "route_scale", None))
        return w * float(scale) if isinstance(scale, (int, float)) and scale != 1 else w
    if rule not in ("softmax_topk", "softmax_topk_renorm"):
        raise ValueError(f"unknown routing rule {rule!r}; known: {RULES}")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w = probs.gather(-1, idx)
    if rule == "softmax_topk_renorm":
        w = w / w.sum(dim=-1, keepdim=True)
    return w


_CALIBRATED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], list[str], int]] = weakref.WeakKeyDictionary()
"""Per router module: what its rule depends on, the rules still consistent with its output, and the
calls checked. Kept across :func:`replay` contexts (a trainer opens one per batch, and each would
otherwise check the first call again, ~6 weightings over all experts per MoE layer and step)."""


def _rule_inputs(router: nn.Module) -> tuple[Any, ...]:
    """What the weighting rule of ``router`` can depend on: a change to any of them checks it again."""
    return (type(router), *(getattr(router, a, None) for a in ("norm_topk_prob", "routed_scaling_factor", "route_scale")))


def _consistent_rules(candidates: list[str], layer: MoELayer, logits: torch.Tensor, live_w: torch.Tensor,
                      live_idx: torch.Tensor) -> list[str]:
    """The candidate rules that reproduce this router call's own weights from its logits.

    Called on every forward until one rule is left: near-uniform logits (a fresh model) cannot tell
    softmax from sigmoid apart, a later call with spread logits can.
    """
    ref = live_w.detach().float()
    keep = []
    with torch.no_grad():
        for rule in candidates:
            w = routing_weights(rule, layer.router, logits.detach(), live_idx.to(torch.int64)).float()
            if w.shape == ref.shape and torch.allclose(w, ref, rtol=1e-5, atol=1e-6):
                keep.append(rule)
    if not keep:
        raise TypeError(
            f"unsupported MoE router {type(layer.router).__name__} ({layer.name}): none of the weighting rules "
            f"{candidates} reproduces its routing weights, so forced ids cannot be weighted like the model would"
        )
    return keep


def _as_route_tensor(routes: Any, layers: MoELayers) -> torch.Tensor:
    """Validate a route array and return it as int64 ``[B, S, L, K]``."""
    if isinstance(routes, torch.Tensor):
        t = routes.detach().cpu()
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"routed_experts must have an integer dtype, got {t.dtype}")
        t = t.to(torch.int64)
    else:
        a = np.asarray(routes)
        if a.dtype.kind not in "iu":
            raise TypeError(f"routed_experts must have an integer dtype, got {a.dtype}")
        t = torch.from_numpy(a.astype(np.int64))
    if t.ndim == 3:
        t = t.unsqueeze(0)
    if t.ndim != 4:
        raise ValueError(
            f"routed_experts has shape {tuple(t.shape)}: expected [S, L, K] or [B, S, L, K] "
            f"(L={len(layers)} MoE layers, K={layers.top_k})"
        )
    if t.shape[2] != len(layers):
        hint = ""
        if t.shape[2] == layers.num_hidden_layers:
            hint = " (it matches num_hidden_layers: routes must be indexed by MoE layer, dense layers dropped)"
        raise ValueError(
            f"routed_experts layer axis is {t.shape[2]}, the model has {len(layers)} MoE layers "
            f"(hidden layers {layers.moe_to_hidden}){hint}"
        )
    if t.shape[3] != layers.top_k:
        raise ValueError(f"routed_experts top_k axis is {t.shape[3]}, the model routes top_k={layers.top_k}")
    return t


class InvalidRoutesError(AuxOutError, ValueError):
    """A route row repeats an expert or names one out of range (and is not the all ``-1`` "no route" row)."""


def route_row_problems(routes: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sentinel, bad)`` bool masks over the rows of ``[..., K]`` routes.

    ``sentinel``: the row is all ``-1`` -- documented "no route", the live router decides.
    ``bad``: anything else with an id outside ``[0, num_experts)`` or a repeated expert -- the
    corruption engines have shipped (all-zero rows, vllm#44214; duplicates, sglang#23885).
    """
    sentinel = (routes == SENTINEL).all(dim=-1)
    bad = ((routes < 0) | (routes >= num_experts)).any(dim=-1)
    if routes.shape[-1] > 1:
        srt = routes.sort(dim=-1).values
        bad |= (srt[..., 1:] == srt[..., :-1]).any(dim=-1)
    return sentinel, bad & ~sentinel


def check_routes(routes: torch.Tensor, num_experts: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Refuse corrupt rows of ``[B, S, L, K]`` routes; return the ``[B, S, L]`` sentinel mask.

    Rows where ``valid`` (``[B, S]``, e.g. the attention mask) is False are padding and not checked:
    they are replaced by the live router's choice like sentinel rows.
    """
    sentinel, bad = route_row_problems(routes, num_experts)
    if valid is not None:
        pad = ~valid.bool()[:, :, None]
        bad &= ~pad
        sentinel |= pad
    if bool(bad.any()):
        where = bad.nonzero()
        b, pos, layer = (int(v) for v in where[0])
        row = routes[b, pos, layer].tolist()
        why = "repeats an expert" if all(0 <= e < num_experts for e in row) else f"has an id outside [0, {num_experts})"
        raise InvalidRoutesError(
            f"routed_experts[batch={b}, position={pos}, moe_layer={layer}] = {row} {why}; {len(where)} such row(s) "
            f"in all. Only an all -1 row means 'no route' (the live router decides); a corrupt row is refused "
            f"rather than replayed (duplicate/zero-filled routes: vllm#44214, sglang#23885)"
        )
    return sentinel


@dataclass
class ReplayContext:
    """State of one :func:`replay`: per-layer cursors and how many rows fell back to the live router.

    Training with activation checkpointing runs each checkpointed router twice: in the forward and
    again inside ``backward()``. Calls made during backward are recomputes: they re-take the slice
    the matching forward took (first in, first out per layer) instead of advancing the cursor.
    """

    routes: torch.Tensor  # int64 [B, S, L, K]
    layers: MoELayers
    valid_mask: torch.Tensor | None = None  # bool [B, S]: rows not counted as fallbacks when False
    cursors: list[int] = field(default_factory=list)
    fallback_count: int = 0
    fallback_per_layer: list[int] = field(default_factory=list)
    recompute_count: int = 0
    input_shape: tuple[int, int] | None = None  # (B, T) of the current forward, from a model pre-hook
    rules: list[str] = field(default_factory=list)
    candidates: list[list[str]] = field(default_factory=list)
    calibrations: list[int] = field(default_factory=list)
    router_order: bool = False  # reorder each row's slots: the live router's picks first, in its order
    _sentinel: torch.Tensor | None = None  # bool [B, S, L]
    _pending: list[list[tuple[int, int]]] = field(default_factory=list)
    _device_routes: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cursors = [0] * len(self.layers)
        self.fallback_per_layer = [0] * len(self.layers)
        self.candidates = [list(dict.fromkeys([lay.rule, *RULES] if lay.rule else RULES)) for lay in self.layers]
        self.calibrations = [0] * len(self.layers)
        for i, lay in enumerate(self.layers):
            known = _CALIBRATED.get(lay.router)
            if known is not None and known[0] == _rule_inputs(lay.router):
                self.candidates[i], self.calibrations[i] = list(known[1]), known[2]
        self.rules = [c[0] for c in self.candidates]
        self._pending = [[] for _ in self.layers]
        self._sentinel = check_routes(self.routes, self.layers.num_experts, self.valid_mask)

    @property
    def batch_size(self) -> int:
        return int(self.routes.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.routes.shape[1])

    def reset(self) -> None:
        """Rewind every cursor to position 0 (e.g. to run a second full forward on the same routes)."""
        self.cursors = [0] * len(self.layers)
        self._pending = [[] for _ in self.layers]

    def _take(self, moe_index: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = self.batch_size
        if self.input_shape is not None:
            if self.input_shape[0] != b or self.input_shape[0] * self.input_shape[1] != rows:
                raise ValueError(
                    f"forward input is [B={self.input_shape[0]}, T={self.input_shape[1]}] ({rows} rows at MoE layer "
                    f"{moe_index}) but routed_experts has batch size {b}"
                )
        elif rows % b:
            raise ValueError(
                f"MoE layer {moe_index} got {rows} token rows, not a multiple of the routes' batch size {b}"
            )
        t = rows // b
        recompute = torch._C._current_graph_task_id() != -1
        if recompute:  # inside backward(): a checkpoint recompute
            pending = self._pending[moe_index]
            if not pending or pending[0][1] != t:
                raise ValueError(
                    f"MoE layer {moe_index} recomputed {t} positions during backward, but the forward slices "
                    f"waiting for recompute are {pending}"
                )
            pos, _ = pending.pop(0)
            self.recompute_count += 1
        else:
            pos = self.cursors[moe_index]
            if pos + t > self.seq_len:
                raise ValueError(
                    f"replay ran past the routes: MoE layer {moe_index} needs positions [{pos}, {pos + t}) but "
                    f"routed_experts covers {self.seq_len} positions. Routes must cover every input token "
                    f"([S, L, K] for S tokens; engines return S-1 rows: pad the last with -1, see RouteTrace)"
                )
            self.cursors[moe_index] = pos + t
            if torch.is_grad_enabled() or self.layers[moe_index].router.training:
                self._pending[moe_index].append((pos, t))
        if device not in self._device_routes:
            assert self._sentinel is not None
            self._device_routes[device] = (self.routes.to(device), self._sentinel.to(device))
        r, sent = self._device_routes[device]
        idx = r[:, pos : pos + t, moe_index, :].reshape(rows, -1)
        fallback = sent[:, pos : pos + t, moe_index].reshape(rows)
        if recompute:  # (its rows were counted by the forward it repeats)
            counted = torch.zeros(rows, dtype=torch.bool, device=device)
        elif self.valid_mask is None:
            counted = torch.ones(rows, dtype=torch.bool, device=device)
        else:
            counted = self.valid_mask[:, pos : pos + t].reshape(rows).to(device)
        return idx, fallback, counted


def _output_positions(out: Any, layer: MoELayer) -> tuple[int, int, int]:
    """Where (logits, weights, ids) sit in a router's output tuple (most return them in that order, Granite reversed)."""
    if isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out):
        ints = [j for j, t in enumerate(out) if not t.is_floating_point()]
        floats = sorted((j for j, t in enumerate(out) if t.is_floating_point()), key=lambda j: -out[j].shape[-1])
        if len(ints) == 1 and len(floats) == 2 and out[floats[1]].shape == out[ints[0]].shape:
            return floats[0], floats[1], ints[0]
    raise TypeError(
        f"router {type(layer.router).__name__} ({layer.name}) does not return (logits, weights, ids): not replayable"
    )


def _in_router_order(idx: torch.Tensor, live_idx: torch.Tensor) -> torch.Tensor:
    """``idx`` with each row's slots reordered: experts the router also picked first, in its order,
    then the others as given. Engines return a row's ids in their own kernel's order (vLLM-CPU's
    differs from transformers'); the experts' outputs are summed in slot order, so without this a
    row whose experts agree would still round differently from the model's own forward."""
    k = idx.shape[-1]
    match = idx.unsqueeze(-1) == live_idx.unsqueeze(-2)  # [rows, k forced, k live]
    key = torch.where(match.any(-1), match.to(torch.int8).argmax(-1), k)
    return idx.gather(-1, key.argsort(dim=-1, stable=True))


def _layer_hook(ctx: ReplayContext, layer: MoELayer) -> Callable[..., Any]:
    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        pos = _output_positions(out, layer)
        logits, live_w, live_idx = (out[j] for j in pos)
        i = layer.moe_index
        if ctx.calibrations[i] < CALIBRATION_CALLS and (ctx.calibrations[i] == 0 or len(ctx.candidates[i]) > 1):
            # until the rule is unambiguous (rules that are the same math, e.g. softmax-then-renorm and
            # softmax-over-top-k, stay ambiguous: the first, the architecture's own, is used)
            ctx.candidates[i] = _consistent_rules(ctx.candidates[i], layer, logits, live_w, live_idx)
            ctx.rules[i] = ctx.candidates[i][0]
            ctx.calibrations[i] += 1
            _CALIBRATED[layer.router] = (_rule_inputs(layer.router), list(ctx.candidates[i]), ctx.calibrations[i])
        idx, fallback, counted = ctx._take(i, logits.shape[0], logits.device)
        n_fb = int((fallback & counted).sum())
        if bool(fallback.any()):
            idx = torch.where(fallback.unsqueeze(-1), live_idx.to(idx.dtype), idx)
        ctx.fallback_count += n_fb
        ctx.fallback_per_layer[i] += n_fb
        idx = idx.to(live_idx.dtype)
        if ctx.router_order:
            idx = _in_router_order(idx, live_idx)
        w = routing_weights(ctx.rules[i], layer.router, logits, idx).to(live_w.dtype)
        new = list(out)
        new[pos[1]], new[pos[2]] = w, idx
        return tuple(new)

    return hook


@contextmanager
def replay(
    model: nn.Module, routed_experts: Any, attention_mask: Any = None, *, router_order: bool = False
) -> Iterator[ReplayContext]:
    """Force every MoE layer to the given expert ids while the router still computes the weights.

    ``routed_experts`` is ``[S, L, K]`` (one sequence of S input tokens) or ``[B, S, L, K]`` in the
    same (padded) layout as the batch's ``input_ids``; any integer dtype. Each MoE layer keeps a
    cursor advanced by the tokens each forward processes, so one context serves a full forward or
    chunked prefill followed by decode steps with a cache, and activation-checkpoint recomputes
    inside ``backward()`` replay the same ids as their forward. An all ``-1`` row means "no route":
    the live router decides (``ctx.fallback_count`` counts those rows, not padding where
    ``attention_mask`` is 0). Any other row with a repeated or out-of-range id raises
    :class:`InvalidRoutesError` naming its position and layer, before the forward runs.

    The experts get each row's ids in the order given, and sum their outputs in that order. An
    engine's order is its top-k kernel's (vLLM-CPU's differs from transformers'): the same experts
    then round differently from the model's own forward (about 2e-7 in fp32). ``router_order=True``
    reorders each row's slots, the experts the live router also picked first and in its order,
    the others after them as given: a row whose experts agree is then bit-exact.
    """
    layers = moe_layers(model)
    routes = _as_route_tensor(routed_experts, layers)
    mask = None
    if attention_mask is not None:
        mask = torch.as_tensor(np.asarray(attention_mask) if not isinstance(attention_mask, torch.Tensor)
                               else attention_mask).bool().cpu()
        if mask.ndim == 1:
            mask = mask.unsqueeze(0)
        if tuple(mask.shape) != tuple(routes.shape[:2]):
            raise ValueError(
                f"attention_mask shape {tuple(mask.shape)} does not match routed_experts [B, S] "
                f"{tuple(routes.shape[:2])}"
            )
    ctx = ReplayContext(routes, layers, mask, router_order=router_order)

    def shape_hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        ctx.input_shape = (int(x.shape[0]), int(x.shape[1])) if x is not None and x.ndim >= 2 else None

    handles = [model.register_forward_pre_hook(shape_hook, with_kwargs=True)]
    handles += [layer.router.register_forward_hook(_layer_hook(ctx, layer)) for layer in layers]
    try:
        yield ctx
    finally:
        for h in handles:
            h.remove()


class RouteRecorder:
    """Records the ids each experts module actually receives (forward pre-hook), per MoE layer."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = moe_layers(model)
        self.rows: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._handles: list[Any] = []

    def __enter__(self) -> RouteRecorder:
        for layer in self.layers:
            self._handles.append(
                layer.experts.register_forward_pre_hook(self._hook(layer.moe_index), with_kwargs=True)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            idx: torch.Tensor | None = None
            if len(args) > 1 and isinstance(args[1], torch.Tensor) and not args[1].is_floating_point():
                idx = args[1]
            else:
                idx = next((v for k, v in kwargs.items() if k in ("top_k_index", "router_indices", "topk_indices")),
                           None)
            if idx is None:
                raise TypeError(
                    f"experts module {type(mod).__name__} of MoE layer {i} was not called with (hidden, top_k_ids, "
                    f"weights): this architecture's MoE block is not supported"
                )
            self.rows[i].append(idx.detach().to("cpu", torch.int64).clone())

        return hook

    def routes(self) -> np.ndarray:
        """All recorded rows, in forward order, as ``[rows, L, K]`` (rows = B*T summed over forwards)."""
        per_layer = [torch.cat(r) if r else torch.empty(0, self.layers.top_k, dtype=torch.int64) for r in self.rows]
        n = {p.shape[0] for p in per_layer}
        if len(n) != 1:
            raise RuntimeError(f"MoE layers recorded different row counts: {sorted(n)}")
        return torch.stack(per_layer, dim=1).numpy().astype(self.layers.route_dtype)


@torch.no_grad()
def capture_routes(model: nn.Module, token_ids: Sequence[int] | np.ndarray | torch.Tensor,
                   attention_mask: Any = None) -> np.ndarray:
    """Oracle routes of one full forward (no cache): ``[S, L, K]`` for ``[S]`` ids, ``[B, S, L, K]`` for ``[B, S]``.

    The ids are those the experts modules received, so this also reports forced routes under
    :func:`replay`. dtype is uint8 for <= 256 experts, else uint16.
    """
    ids = torch.as_tensor(np.asarray(token_ids) if not isinstance(token_ids, torch.Tensor) else token_ids)
    single = ids.ndim == 1
    if single:
        ids = ids.unsqueeze(0)
    if ids.ndim != 2:
        raise ValueError(f"token_ids must be [S] or [B, S], got shape {tuple(ids.shape)}")
    device = next(model.parameters()).device
    kw: dict[str, Any] = {}
    if attention_mask is not None:
        kw["attention_mask"] = torch.as_tensor(np.asarray(attention_mask)).reshape(ids.shape).to(device)
    with RouteRecorder(model) as rec:
        model(input_ids=ids.to(device), use_cache=False, **kw)
    r = rec.routes()
    b, s = ids.shape
    r = r.reshape(b, s, r.shape[1], r.shape[2])
    return r[0] if single else r
