"""A deterministic stand-in for an MoE model's router, for driving connectors without torch.

Row ``p`` of ``routes(tokens)`` depends only on ``tokens[:p+1]`` (causal, like a real router),
so a row computed for a rejected draft token differs from the row of the token that was
accepted, and a row served for the wrong position is caught by comparing with a full pass.
With ``weights=True`` rows are structured (id, float32 weight) slots like an engine capturing
routing weights; the weights are the renormalized top scores, also causal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from auxout.profile import RouteProfile

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_BASE = np.uint64(0x100000001B3)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, vectorized (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class FakeMoE:
    """Causal fake router: ``routes(token_ids) -> [len, num_layers, top_k]`` distinct ids per row."""

    def __init__(
        self,
        num_layers: int = 4,
        top_k: int = 2,
        num_experts: int = 16,
        vocab_size: int = 1000,
        seed: int = 0,
        weights: bool = False,
    ) -> None:
        self.profile = RouteProfile(num_layers, top_k, num_experts, weights)
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.vocab_size = vocab_size
        rng = np.random.default_rng(seed)
        self._salt = rng.integers(1, 2**63, size=(num_layers, num_experts), dtype=np.uint64)
        self._seed = np.uint64(rng.integers(1, 2**63))
        self._pow = np.ones(1, dtype=np.uint64)

    def _powers(self, n: int) -> np.ndarray:
        """``BASE**i`` for ``i < n`` (mod 2**64), cached and grown by doubling."""
        if len(self._pow) < n:
            size = max(n, 2 * len(self._pow))
            with np.errstate(over="ignore"):
                tail = np.cumprod(np.full(size - 1, _BASE, dtype=np.uint64))
            self._pow = np.concatenate([np.ones(1, dtype=np.uint64), tail])
        return self._pow[:n]

    def prefix_hashes(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``h[p]`` identifies ``token_ids[:p+1]`` (a polynomial hash mod 2**64)."""
        t = np.asarray(token_ids, dtype=np.uint64)
        if t.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {t.shape}")
        with np.errstate(over="ignore"):
            return _mix(np.cumsum((t + np.uint64(1)) * self._powers(len(t))) ^ self._seed)

    def routes(self, token_ids: Sequence[int] | np.ndarray, start: int = 0) -> np.ndarray:
        """Rows ``[start, len(token_ids))`` of the routed experts of a full forward."""
        h = self.prefix_hashes(token_ids)[start:]
        with np.errstate(over="ignore"):
            scores = _mix(h[:, None, None] ^ self._salt[None])  # [n, L, E]
        top = np.argsort(scores, axis=-1, kind="stable")[..., -self.top_k :][..., ::-1]
        if not self.profile.weights:
            return np.ascontiguousarray(top.astype(self.profile.dtype))
        score = (np.take_along_axis(scores, top, axis=-1) >> np.uint64(40)).astype(np.float32) + 1
        rows = np.empty(top.shape, dtype=self.profile.dtype)
        rows["id"] = top
        rows["w"] = score / score.sum(axis=-1, keepdims=True)
        return rows

    def next_token(self, token_ids: Sequence[int] | np.ndarray) -> int:
        """Deterministic greedy next token."""
        if len(token_ids) == 0:
            raise ValueError("next_token needs at least one token")
        h = self.prefix_hashes(token_ids)[-1]
        with np.errstate(over="ignore"):
            return int(_mix(np.array([h ^ np.uint64(0x5851F42D4C957F2D)]))[0] % np.uint64(self.vocab_size))
