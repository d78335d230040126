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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

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
        return np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.uint16)


def _rule_for(router: nn.Module) -> str:
    """Name of the weighting rule a router uses; matched on class name, checked on attributes."""
    cls = type(router).__name__
    if cls.startswith("GptOss"):
        return "topk_softmax"
    if hasattr(router, "e_score_correction_bias") and hasattr(router, "routed_scaling_factor"):
        return "sigmoid_group"
    if cls.startswith("Mixtral"):
        return "softmax_topk_renorm"
    if hasattr(router, "norm_topk_prob"):
        return "softmax_topk_renorm" if router.norm_topk_prob else "softmax_topk"
    raise TypeError(
        f"unsupported MoE router {cls}: auxout.hf knows Qwen2/Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, GPT-OSS"
    )


def moe_layers(model: nn.Module) -> MoELayers:
    """Find every MoE router (class name ``*TopKRouter``/``*TopkRouter``) in hidden-layer order."""
    found: list[tuple[int, str, nn.Module]] = []
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith(("TopKRouter", "TopkRouter")):
            m = _LAYER_RE.search(name)
            if m is None:
                raise TypeError(f"router {name!r} is not inside a decoder layer (`layers.N.`)")
            found.append((int(m.group(1)), name, mod))
    if not found:
        raise TypeError(f"{type(model).__name__} has no MoE router modules (`*TopKRouter`)")
    found.sort(key=lambda t: t[0])
    hidden = [h for h, _, _ in found]
    if len(set(hidden)) != len(hidden):
        raise TypeError(f"more than one router per decoder layer: {hidden}")
    modules = dict(model.named_modules())
    layers = []
    for i, (h, name, router) in enumerate(found):
        parent = modules[name.rsplit(".", 1)[0]]
        experts = getattr(parent, "experts", None)
        if not isinstance(experts, nn.Module):
            raise TypeError(f"MoE block of {name!r} has no `experts` module")
        layers.append(MoELayer(i, h, router, experts, _rule_for(router), name))
    ks = {int(getattr(r, "top_k")) for _, _, r in found}  # noqa: B009 (nn.Module attrs are untyped)
    es = {int(getattr(r, "num_experts")) for _, _, r in found}  # noqa: B009
    if len(ks) != 1 or len(es) != 1:
        raise TypeError(f"MoE layers disagree on top_k {ks} / num_experts {es}")
    cfg = getattr(model, "config", None)
    n_hidden = int(getattr(cfg, "num_hidden_layers", max(hidden) + 1))
    return MoELayers(tuple(layers), es.pop(), ks.pop(), n_hidden)


def routing_weights(rule: str, router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Weights of the chosen experts ``idx`` from router ``logits`` with the architecture's rule.

    For ids equal to the live top-k this reproduces the router's own weights bit for bit (same ops,
    same order), so replaying captured routes leaves the forward unchanged.
    """
    if rule == "topk_softmax":  # GPT-OSS: softmax over the k selected raw logits
        return torch.softmax(logits.gather(-1, idx), dim=-1, dtype=logits.dtype)
    if rule == "sigmoid_group":  # DeepSeek-V3: sigmoid scores (no correction bias), renorm, scale
        w = logits.sigmoid().gather(-1, idx)
        if getattr(router, "norm_topk_prob"):  # noqa: B009
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * float(getattr(router, "routed_scaling_factor"))  # noqa: B009
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w = probs.gather(-1, idx)
    if rule == "softmax_topk_renorm":
        w = w / w.sum(dim=-1, keepdim=True)
    return w


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


def _invalid_rows(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows that cannot be replayed: a sentinel/out-of-range id or a repeated expert."""
    bad = ((idx < 0) | (idx >= num_experts)).any(dim=-1)
    if idx.shape[-1] > 1:
        s = idx.sort(dim=-1).values
        bad |= (s[:, 1:] == s[:, :-1]).any(dim=-1)
    return bad


@dataclass
class ReplayContext:
    """State of one :func:`replay`: per-layer cursors and how many rows fell back to the live router."""

    routes: torch.Tensor  # int64 [B, S, L, K]
    layers: MoELayers
    valid_mask: torch.Tensor | None = None  # bool [B, S]: rows not counted as fallbacks when False
    cursors: list[int] = field(default_factory=list)
    fallback_count: int = 0
    fallback_per_layer: list[int] = field(default_factory=list)
    input_shape: tuple[int, int] | None = None  # (B, T) of the current forward, from a model pre-hook
    _device_routes: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cursors = [0] * len(self.layers)
        self.fallback_per_layer = [0] * len(self.layers)

    @property
    def batch_size(self) -> int:
        return int(self.routes.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.routes.shape[1])

    def reset(self) -> None:
        """Rewind every cursor to position 0 (e.g. to run a second full forward on the same routes)."""
        self.cursors = [0] * len(self.layers)

    def _take(self, moe_index: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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
        pos = self.cursors[moe_index]
        if pos + t > self.seq_len:
            raise ValueError(
                f"replay ran past the routes: MoE layer {moe_index} needs positions [{pos}, {pos + t}) but "
                f"routed_experts covers {self.seq_len} positions. Routes must cover every input token "
                f"([S, L, K] for S tokens; engines return S-1 rows: pad the last with -1, see RouteTrace)"
            )
        self.cursors[moe_index] = pos + t
        if device not in self._device_routes:
            self._device_routes[device] = self.routes.to(device)
        r = self._device_routes[device]
        idx = r[:, pos : pos + t, moe_index, :].reshape(rows, -1)
        if self.valid_mask is None:
            counted = torch.ones(rows, dtype=torch.bool, device=device)
        else:
            counted = self.valid_mask[:, pos : pos + t].reshape(rows).to(device)
        return idx, counted


def _layer_hook(ctx: ReplayContext, layer: MoELayer) -> Callable[..., Any]:
    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        logits, live_w, live_idx = out
        idx, counted = ctx._take(layer.moe_index, logits.shape[0], logits.device)
        bad = _invalid_rows(idx, ctx.layers.num_experts)
        n_bad = int((bad & counted).sum())
        if bool(bad.any()):
            idx = torch.where(bad.unsqueeze(-1), live_idx.to(idx.dtype), idx)
        ctx.fallback_count += n_bad
        ctx.fallback_per_layer[layer.moe_index] += n_bad
        idx = idx.to(live_idx.dtype)
        w = routing_weights(layer.rule, layer.router, logits, idx).to(live_w.dtype)
        return (logits, w, idx)

    return hook


@contextmanager
def replay(model: nn.Module, routed_experts: Any, attention_mask: Any = None) -> Iterator[ReplayContext]:
    """Force every MoE layer to the given expert ids while the router still computes the weights.

    ``routed_experts`` is ``[S, L, K]`` (one sequence of S input tokens) or ``[B, S, L, K]`` in the
    same (padded) layout as the batch's ``input_ids``; any integer dtype. Each MoE layer keeps a
    cursor advanced by the tokens each forward processes, so one context serves a full forward or
    chunked prefill followed by decode steps with a cache. Rows with ``-1``/out-of-range/repeated ids
    use the live router; ``ctx.fallback_count`` counts them (rows where ``attention_mask`` is 0 --
    padding -- are not counted).
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
    ctx = ReplayContext(routes, layers, mask)

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
            idx = args[1] if len(args) > 1 else next(
                v for k, v in kwargs.items() if k in ("top_k_index", "router_indices", "topk_indices")
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
