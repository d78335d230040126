"""Rows that still live in the in-process store's arena, copied once by whoever joins them.

A prefix hit's rows are read back from the store and then, in every engine, joined with the
request's own rows before they are handed over (vLLM's frontend gets one array per request). A
read into a buffer followed by that join copies the history twice; ``StoreRows`` names the
blocks instead (the arena and the slots they occupy), and ``join_rows`` gathers them straight
into the joined array. Pickling one (a step output sent to another process) sends the rows.

The store keeps the slots of every ``StoreRows`` still alive out of reuse (``ArenaStore``
quarantines them when their keys are evicted), so the rows read stay the rows written however
long a consumer holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class StoreRows:
    """Rows ``[lo, hi)`` of the blocks ``src[slots[0]], src[slots[1]], ...`` taken in order.

    ``src`` is the store's arena seen as ``[num_slots, block_size, *shape_per_token]``; the
    store tracks it (a weak reference) to know which slots are still being read.
    """

    __slots__ = ("src", "slots", "lo", "hi")

    def __init__(self, src: np.ndarray, slots: np.ndarray, lo: int = 0, hi: int | None = None) -> None:
        self.src = src
        self.slots = slots
        self.lo = lo
        self.hi = len(slots) * src.shape[1] if hi is None else hi

    def __len__(self) -> int:
        return self.hi - self.lo

    @property
    def dtype(self) -> np.dtype:
        return self.src.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.hi - self.lo, *self.src.shape[2:])

    def __getitem__(self, key: slice) -> StoreRows:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"StoreRows supports contiguous slices only, got {key!r}")
        x, y, _ = key.indices(len(self))
        y = max(x, y)
        lo, hi = self.lo + x, self.lo + y
        bs = self.src.shape[1]
        b0 = lo // bs
        return StoreRows(self.src, self.slots[b0 : -(-hi // bs)], lo - b0 * bs, hi - b0 * bs)

    def copy_into(self, out: np.ndarray) -> None:
        """Gather the rows into ``out`` (``len(self)`` rows): one copy when ``out`` is C-contiguous."""
        bs = self.src.shape[1]
        lo, hi = self.lo, self.hi
        if lo % bs == 0 and hi % bs == 0 and out.flags.c_contiguous:  # (else reshape would copy)
            n = hi // bs - lo // bs
            np.take(self.src, self.slots[lo // bs : hi // bs], axis=0, out=out.reshape(n, *self.src.shape[1:]), mode="clip")
            return
        b0, b1 = lo // bs, -(-hi // bs)
        tmp = np.take(self.src, self.slots[b0:b1], axis=0, mode="clip")
        out[...] = tmp.reshape(-1, *self.src.shape[2:])[lo - b0 * bs : hi - b0 * bs]

    def to_array(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.src.dtype)
        self.copy_into(out)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.to_array()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.to_array().__reduce__()  # type: ignore[return-value]  # another process gets the rows themselves

    def __repr__(self) -> str:
        return f"StoreRows({len(self)} rows of {len(self.slots)} blocks, {self.dtype}{list(self.src.shape[2:])})"


def join_rows(parts: Sequence[np.ndarray | StoreRows]) -> np.ndarray:
    """One array of ``parts`` in order: each row copied once (``StoreRows`` gathered in place)."""
    if not any(type(p) is StoreRows for p in parts):
        return parts[0] if len(parts) == 1 else np.concatenate(parts)  # type: ignore[return-value,arg-type]
    first = parts[0]
    out = np.empty((sum(map(len, parts)), *first.shape[1:]), dtype=first.dtype)
    pos = 0
    for p in parts:
        m = len(p)
        if type(p) is StoreRows:
            p.copy_into(out[pos : pos + m])
        else:
            out[pos : pos + m] = p
        pos += m
    return out


__all__ = ["StoreRows", "join_rows"]
