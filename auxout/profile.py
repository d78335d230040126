"""The per-token shape and dtype of routed-expert rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class RouteProfile:
    """``num_layers`` MoE layers × ``top_k`` logical expert ids per token.

    Ids are stored as ``uint8`` when there are at most 256 experts, else ``uint16``.
    """

    num_layers: int
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "top_k", "num_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"RouteProfile.{name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts > 65536:
            raise ValueError(f"num_experts={self.num_experts} does not fit uint16 ids")

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.uint16)

    @property
    def shape_per_token(self) -> tuple[int, int]:
        return (self.num_layers, self.top_k)

    @property
    def token_nbytes(self) -> int:
        return self.num_layers * self.top_k * self.dtype.itemsize

    def block_nbytes(self, block_size: int) -> int:
        return block_size * self.token_nbytes

    def empty(self, n: int = 0) -> np.ndarray:
        return np.empty((n, self.num_layers, self.top_k), dtype=self.dtype)
