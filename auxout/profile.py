"""The per-token shape and dtype of routed-expert rows.

Rows hold expert ids (``uint8``/``uint16``); with routing weights on, each slot is one
structured item ``("id", <id dtype>), ("w", "<f4")``: ids and their combine weights travel as one
row through every data-plane component (staging, stores, manifests, held rows), so a cached
prefix returns its weights exactly like its ids. :func:`split_rows` separates them for users.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class RouteProfile:
    """``num_layers`` MoE layers × ``top_k`` logical expert ids per token.

    Ids are stored as ``uint8`` when there are at most 256 experts, else ``uint16``. With
    ``weights`` each slot also carries the router's float32 top-k combine weight (structured dtype).
    """

    num_layers: int
    top_k: int
    num_experts: int
    weights: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "top_k", "num_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"RouteProfile.{name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts > 65536:
            raise ValueError(f"num_experts={self.num_experts} does not fit uint16 ids")
        if not isinstance(self.weights, bool):
            raise ValueError(f"RouteProfile.weights must be a bool, got {self.weights!r}")

    @property
    def id_dtype(self) -> np.dtype:
        return id_dtype_for(self.num_experts)

    @property
    def dtype(self) -> np.dtype:
        return _profile_dtype(self.num_experts, self.weights)

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


WEIGHT_DTYPE = np.dtype("<f4")


def id_dtype_for(num_experts: int) -> np.dtype:
    """The expert-id dtype engines and trainers exchange: uint8 up to 256 experts, else uint16."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def route_dtype(id_dtype: np.dtype | str, weights: bool) -> np.dtype:
    """The row item dtype: the ids' dtype, or ``[("id", ids), ("w", "<f4")]`` with weights."""
    ids = np.dtype(id_dtype)
    return np.dtype([("id", ids), ("w", WEIGHT_DTYPE)]) if weights else ids


@functools.cache
def _profile_dtype(num_experts: int, weights: bool) -> np.dtype:
    """``RouteProfile.dtype``, built once per shape: the data plane checks it every step."""
    return route_dtype(id_dtype_for(num_experts), weights)


def has_weights(rows: np.ndarray) -> bool:
    return rows.dtype.names is not None


def is_route_bytes(data: object) -> bool:
    """Whether ``data`` is :func:`rows_as_bytes` output (``uint8 [n, L, K, itemsize]``), not ids."""
    return isinstance(data, np.ndarray) and data.ndim == 4 and data.dtype == np.uint8


def split_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``(ids, weights)`` as contiguous arrays of the rows' shape (weights None for id-only rows)."""
    if not has_weights(rows):
        return rows, None
    return np.ascontiguousarray(rows["id"]), np.ascontiguousarray(rows["w"])


def rows_with_weights(ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The structured rows of ``ids`` and their ``weights`` (same shape): the inverse of :func:`split_rows`."""
    if ids.shape != weights.shape:
        raise ValueError(f"ids {ids.shape} and weights {weights.shape} must have the same shape")
    out = np.empty(ids.shape, dtype=route_dtype(ids.dtype, True))
    out["id"] = ids
    out["w"] = weights
    return out


def rows_as_bytes(rows: np.ndarray) -> np.ndarray:
    """Structured ``[n, L, K]`` rows as ``uint8 [n, L, K, itemsize]``.

    vLLM's engine-core to frontend messages carry plain numeric arrays only (a structured array
    would need pickling); the extra axis keeps the row axis first (vLLM slices and concatenates
    on it) and tells :func:`rows_from_bytes` apart from ``[n, L, K]`` id arrays.
    """
    data = np.ascontiguousarray(rows)
    return data.view(np.uint8).reshape(*data.shape, data.dtype.itemsize)


def rows_from_bytes(data: np.ndarray) -> np.ndarray:
    """Inverse of :func:`rows_as_bytes` (ids are ``uint8`` for 5-byte items, ``uint16`` for 6)."""
    if not is_route_bytes(data):
        raise ValueError(f"expected uint8 [n, L, K, itemsize] route bytes, got {data.dtype}{list(data.shape)}")
    id_size = data.shape[3] - WEIGHT_DTYPE.itemsize
    if id_size not in (1, 2):
        raise ValueError(f"route items of {data.shape[3]} bytes are not ids plus a float32 weight")
    dt = route_dtype(np.dtype(f"<u{id_size}"), True)
    n, layers, top_k, item = data.shape  # (no -1: numpy cannot infer an axis of an empty array)
    flat = np.ascontiguousarray(data).reshape(n, layers, top_k * item)
    return flat.view(dt)


def dtype_name(dt: np.dtype) -> str:
    """A row dtype as text: ``dt.str`` for ids (``"|u1"``), ``"|u1+w<f4"`` with weights."""
    if dt.names is None:
        return dt.str
    return f"{dt['id'].str}+w{dt['w'].str}"


def parse_dtype_name(name: str) -> np.dtype:
    """Inverse of :func:`dtype_name` (raises ``TypeError`` for text that names no route dtype)."""
    ids, sep, w = name.partition("+w")
    if not sep:
        return np.dtype(name)
    if np.dtype(w) != WEIGHT_DTYPE:
        raise TypeError(f"route weights must be little-endian float32, got {w!r}")
    return route_dtype(np.dtype(ids), True)
