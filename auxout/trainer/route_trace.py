"""RouteTrace: the routes of one training sample, aligned to its tokens, and the batch layouts trainers use.

Engines return routes as ``[S-1, L, K]``: row ``i`` holds the experts token ``i`` was routed to as an
input (the last token never went through the model). A RouteTrace keeps one row per token ``[S, L, K]``
plus a ``covered`` mask, so every layout conversion is an indexing operation that keeps each row with
its token; rows nobody returned are the sentinel ``-1`` and replay falls back to the live router there.

Multi-turn conversations are stitched from per-turn outputs that carry ``prompt_start`` (rows
``[prompt_start, len(tokens)-1)``); the token prefix is verified so that a re-templated history
cannot silently shift the routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from auxout.errors import AuxOutError

SENTINEL = -1


class RouteTraceError(AuxOutError, ValueError):
    """Routes and tokens do not line up (wrong length, token prefix mismatch, gap or double count)."""


def is_index(value: object) -> bool:
    """An int or numpy integer, not a bool: what a position, length or layer index must be."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _as_start(value: object, name: str) -> int:
    """A prompt start as a Python int (``1.7``, ``True`` or ``"1"`` would silently shift the rows)."""
    if not is_index(value):
        raise RouteTraceError(f"{name} must be an integer position, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def _signed(dtype: Any) -> np.dtype:
    out = np.dtype(dtype)
    if out.kind != "i":
        raise RouteTraceError(f"dtype must be a signed integer type (padding is {SENTINEL}), got {out}")
    return out


def _as_routes(a: Any, name: str = "routed_experts") -> np.ndarray:
    r = np.asarray(a)
    if r.dtype.kind not in "iu":
        raise RouteTraceError(f"{name} must have an integer dtype, got {r.dtype}")
    if r.ndim != 3:
        raise RouteTraceError(f"{name} must be [rows, L, K], got shape {r.shape}")
    return r.astype(np.int32)


def _as_tokens(t: Any, name: str = "tokens") -> np.ndarray:
    a = np.asarray(t)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise RouteTraceError(f"{name} must be a 1-D integer sequence, got shape {a.shape} dtype {a.dtype}")
    return a.astype(np.int64)


def topk_sets_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per (token, layer): do two route arrays choose the same top-k *set* (order-free, e.g. DeepSeek)?"""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise RouteTraceError(f"route shapes differ: {a.shape} vs {b.shape}")
    return (np.sort(a.astype(np.int64), axis=-1) == np.sort(b.astype(np.int64), axis=-1)).all(axis=-1)


@dataclass(frozen=True)
class Turn:
    """One engine response: the full token list it saw+produced and the routes it returned."""

    tokens: np.ndarray
    routes: np.ndarray  # [len(tokens) - 1 - prompt_start, L, K]
    prompt_start: int = 0


@dataclass
class RouteTrace:
    """Tokens ``[S]``, routes ``[S, L, K]`` (int32, -1 where unknown), ``covered [S]``, prompt length."""

    tokens: np.ndarray
    routes: np.ndarray
    covered: np.ndarray
    prompt_len: int

    def __post_init__(self) -> None:
        s = len(self.tokens)
        if self.routes.shape[0] != s or self.covered.shape != (s,):
            raise RouteTraceError(f"routes {self.routes.shape} / covered {self.covered.shape} do not match {s} tokens")
        if not 0 <= self.prompt_len <= s:
            raise RouteTraceError(f"prompt_len={self.prompt_len} outside [0, {s}]")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_output(cls, prompt_ids: Sequence[int] | np.ndarray, output_ids: Sequence[int] | np.ndarray,
                    routed_experts: Any,
                    prompt_start: int = 0) -> RouteTrace:
        """One request: ``routed_experts`` covers positions ``[prompt_start, S-1)`` of prompt+output.

        Positions before ``prompt_start`` (rows the caller asked the engine to skip) stay uncovered
        (-1, ``covered`` False): ``check_complete`` names them; stitch earlier turns to fill them."""
        p, o = _as_tokens(prompt_ids, "prompt_ids"), _as_tokens(output_ids, "output_ids")
        turn = Turn(np.concatenate([p, o]), _as_routes(routed_experts), _as_start(prompt_start, "prompt_start"))
        return cls.stitch([turn], prompt_len=len(p), allow_gaps=True)

    @classmethod
    def stitch(cls, turns: Sequence[Turn | tuple[Any, Any, int]], prompt_len: int | None = None,
               allow_overlap: bool = False, allow_gaps: bool = False) -> RouteTrace:
        """Stitch per-turn routes of a multi-turn conversation into one trace over the last turn's tokens.

        Turn k must extend turn k-1's tokens exactly (else refuse: a re-tokenized history would shift
        routes). Its rows start at ``prompt_start_k``; rows already covered by an earlier turn are a
        double count (refused unless ``allow_overlap``, then they must agree and the first is kept),
        uncovered positions before ``prompt_start_k`` are a gap (refused unless ``allow_gaps``).
        """
        if not turns:
            raise RouteTraceError("no turns to stitch")
        ts = [
            t if isinstance(t, Turn) else Turn(_as_tokens(t[0]), _as_routes(t[1]), _as_start(t[2], f"turn {k} prompt_start"))
            for k, t in enumerate(turns)
        ]
        shape = ts[0].routes.shape[1:]
        final = _as_tokens(ts[-1].tokens)
        s = len(final)
        routes = np.full((s, *shape), SENTINEL, dtype=np.int32)
        covered = np.zeros(s, dtype=bool)
        prev: np.ndarray | None = None
        end = 0  # first position no earlier turn covers
        for k, t in enumerate(ts):
            tok, r = _as_tokens(t.tokens), _as_routes(t.routes, f"turn {k} routes")
            if r.shape[1:] != shape:
                raise RouteTraceError(f"turn {k} routes are [*, {r.shape[1]}, {r.shape[2]}], turn 0 were {shape}")
            if prev is not None:
                n = len(prev)
                if len(tok) < n or not np.array_equal(tok[:n], prev):
                    diff = int(np.argmax(tok[: min(n, len(tok))] != prev[: min(n, len(tok))])) if len(tok) else 0
                    raise RouteTraceError(
                        f"turn {k} tokens do not extend turn {k - 1}'s {n} tokens (first difference at position "
                        f"{diff}, or shorter: {len(tok)}); refusing to stitch misaligned routes"
                    )
            start = t.prompt_start
            expect = len(tok) - 1 - start
            if start < 0 or expect < 0:
                raise RouteTraceError(f"turn {k}: prompt_start={start} outside [0, {len(tok) - 1}]")
            if len(r) != expect:
                raise RouteTraceError(
                    f"turn {k}: {len(r)} route rows for positions [{start}, {len(tok) - 1}) ({expect} expected); "
                    f"the engine may have ignored prompt_start or returned S rows instead of S-1"
                )
            if start > end and not allow_gaps:
                raise RouteTraceError(f"turn {k}: positions [{end}, {start}) have no routes (gap)")
            lo = max(start, 0)
            dup = np.arange(lo, lo + len(r))
            dup = dup[covered[dup]]
            if dup.size:
                if not allow_overlap:
                    raise RouteTraceError(
                        f"turn {k}: positions [{dup[0]}, {dup[-1] + 1}) already have routes from an earlier turn "
                        f"(double count: prompt_start={start} but earlier turns covered up to {end})"
                    )
                same = topk_sets_equal(routes[dup], r[dup - start])
                if not same.all():
                    bad = np.argwhere(~same)[0]
                    raise RouteTraceError(
                        f"turn {k}: overlapping routes disagree at position {dup[bad[0]]}, MoE layer {bad[1]}"
                    )
            new = ~covered[lo : lo + len(r)]
            routes[lo : lo + len(r)][new] = r[new]
            covered[lo : lo + len(r)] = True
            end = max(end, lo + len(r))
            prev = tok
        return cls(final, routes, covered, len(final) if prompt_len is None else prompt_len)

    # ------------------------------------------------------------------ views
    @property
    def num_layers(self) -> int:
        return int(self.routes.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.routes.shape[2])

    @property
    def response_mask(self) -> np.ndarray:
        """True at response tokens (positions >= prompt_len)."""
        return np.arange(len(self.tokens)) >= self.prompt_len

    def per_sample(self) -> np.ndarray:
        """Engine layout ``[S-1, L, K]`` (-1 where no route is known)."""
        return self.routes[:-1].copy()

    def for_forward(self) -> np.ndarray:
        """``[S, L, K]``: one row per input token of the training forward; the last is usually -1."""
        return self.routes.copy()

    def truncate(self, max_len: int) -> RouteTrace:
        """Keep the first ``max_len`` tokens with their rows (the kept last token keeps its route)."""
        if not is_index(max_len) or max_len < 0:
            raise RouteTraceError(f"max_len must be a non-negative int, got {max_len!r}")
        n = min(max_len, len(self.tokens))
        return RouteTrace(self.tokens[:n].copy(), self.routes[:n].copy(), self.covered[:n].copy(),
                          min(self.prompt_len, n))

    def check_complete(self) -> None:
        """Refuse if any input token other than the last lacks routes (replay would fall back there)."""
        miss = np.flatnonzero(~self.covered[:-1])
        if miss.size:
            raise RouteTraceError(f"{miss.size} positions have no routes, first at {int(miss[0])}")

    def agreement(self, reference: np.ndarray) -> float:
        """Fraction of covered (token, layer) top-k sets equal to ``reference`` (``[S-1]`` or ``[S]`` rows).

        Against an fp32 oracle (``auxout.trainer.hf.capture_routes``) an aligned trace scores near 1 and a
        shifted one near chance, which is how misalignment that keeps the length is caught.
        """
        ref = np.asarray(reference)
        n = min(len(ref), len(self.tokens))
        mask = self.covered[:n]
        if not mask.any():
            raise RouteTraceError("no covered positions to compare")
        return float(topk_sets_equal(self.routes[:n][mask], ref[:n][mask]).mean())


# ---------------------------------------------------------------------- batch layouts
def pad_batch(traces: Sequence[RouteTrace], side: str = "right", length: int | None = None, pad_token: int = 0,
              dtype: Any = np.int16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Padded ``(input_ids [B,S], attention_mask [B,S], routes [B,S,L,K])``; pad rows are -1.

    The routes use the same padding side as the tokens, so column j of ``routes`` is the token in
    column j of ``input_ids`` -- pass both to :func:`auxout.trainer.hf.replay` unchanged.
    """
    if side not in ("left", "right"):
        raise RouteTraceError(f"side must be 'left' or 'right', got {side!r}")
    if not traces:
        raise RouteTraceError("empty batch")
    s = max(len(t.tokens) for t in traces) if length is None else length
    if any(len(t.tokens) > s for t in traces):
        raise RouteTraceError(f"a trace is longer than length={s}; truncate it first")
    lk = traces[0].routes.shape[1:]
    if any(t.routes.shape[1:] != lk for t in traces):
        raise RouteTraceError("traces disagree on [L, K]")
    b = len(traces)
    ids = np.full((b, s), pad_token, dtype=np.int64)
    mask = np.zeros((b, s), dtype=np.int64)
    routes = np.full((b, s, *lk), SENTINEL, dtype=_signed(dtype))
    for i, t in enumerate(traces):
        n = len(t.tokens)
        sl = slice(0, n) if side == "right" else slice(s - n, s)
        ids[i, sl], mask[i, sl], routes[i, sl] = t.tokens, 1, t.routes
    return ids, mask, routes


def unpad_batch(routes: np.ndarray, attention_mask: np.ndarray) -> list[np.ndarray]:
    """Inverse of :func:`pad_batch` for routes: per-sample ``[S_i, L, K]`` (either padding side)."""
    m = np.asarray(attention_mask).astype(bool)
    return [np.asarray(routes)[i][m[i]] for i in range(m.shape[0])]


def pack(traces: Sequence[RouteTrace], dtype: Any = np.int16) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Packed (THD) layout: ``(input_ids [T], position_ids [T], cu_seqlens [B+1], routes [T, L, K])``."""
    if not traces:
        raise RouteTraceError("empty batch")
    out = _signed(dtype)  # (uncovered rows are -1)
    lens = np.array([len(t.tokens) for t in traces])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ids = np.concatenate([t.tokens for t in traces])
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    routes = np.concatenate([t.routes for t in traces]).astype(out)
    return ids, pos, cu, routes


def unpack(routes: np.ndarray, cu_seqlens: np.ndarray) -> list[np.ndarray]:
    """Inverse of :func:`pack`: split ``[T, L, K]`` at ``cu_seqlens``."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or len(cu) == 0 or cu.dtype.kind not in "iu":
        raise RouteTraceError(f"cu_seqlens must be a non-empty 1-D integer array, got {cu.dtype} {cu.shape}")
    if cu[0] != 0 or cu[-1] != len(routes) or np.any(np.diff(cu) < 0):
        raise RouteTraceError(f"cu_seqlens {cu.tolist()} do not partition {len(routes)} rows")
    return [np.asarray(routes)[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


def to_megatron(routes: np.ndarray) -> list[np.ndarray]:
    """Per-MoE-layer list of ``[T, K]`` arrays (Megatron ``RouterReplay`` takes one target per layer)."""
    r = np.asarray(routes)
    if r.ndim != 3:
        raise RouteTraceError(f"expected packed [T, L, K] routes, got shape {r.shape}")
    return [np.ascontiguousarray(r[:, i, :]) for i in range(r.shape[1])]


def from_megatron(per_layer: Sequence[np.ndarray]) -> np.ndarray:
    """Inverse of :func:`to_megatron`."""
    return np.stack([np.asarray(x) for x in per_layer], axis=1)
