"""In-process route store: one preallocated arena of fixed-size slots.

Reference counts are held by live requests (a key is pinned while any request needs it, even
before its data exists); unreferenced objects age out LRU. Releases arrive tail-first, so the
tail of a finished chain is evicted before its head, mirroring the KV cache's free queue.
Everything fails closed: a batch that cannot fit is rejected whole (newly registered keys are
rolled back) and a read of a missing key raises, naming it.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterable, Sequence

import numpy as np

from auxout.errors import CorruptObjectError, StoreClosedError
from auxout.stores.base import BlockObjects, StoreObject
from auxout.stores.policy import EvictionPolicy
from auxout.stores.rows import StoreRows
from auxout.stores.slots import SlotIndex, write_slots


class ArenaStore:
    """Bounded LRU object store in one numpy arena; objects never move once written."""

    def __init__(self, max_bytes: int, object_nbytes: int, policy: EvictionPolicy | None = None) -> None:
        if not isinstance(object_nbytes, int) or object_nbytes <= 0:
            raise ValueError(f"ArenaStore object_nbytes must be a positive int, got {object_nbytes!r}")
        if not isinstance(max_bytes, int) or max_bytes < object_nbytes:
            raise ValueError(
                f"ArenaStore max_bytes={max_bytes!r} must fit at least one object of {object_nbytes} bytes"
            )
        self.object_nbytes = object_nbytes
        self.num_slots = max_bytes // object_nbytes
        self._arena: np.ndarray | None = np.empty((self.num_slots, object_nbytes), dtype=np.uint8)
        self._lengths = np.zeros(self.num_slots, dtype=np.int64)
        self._short = 0  # slots whose recorded length is neither 0 nor object_nbytes (reads check lengths)
        self._index = SlotIndex(self.num_slots, "route store (ArenaStore)", policy, backend="arena")
        self._lru = self._index.lru  # oldest first; value = slot (read by tests and metrics)
        self._lock = threading.Lock()
        # rows handed out uncopied (``read_rows``): the arena view each read made and its slots.
        # Reads only append; most are dropped before any eviction asks, so a read is counted per
        # slot (``_view_count``) only once an eviction finds it still alive.
        self._fresh: list[tuple[weakref.ref[np.ndarray], np.ndarray]] = []
        self._counted: list[tuple[weakref.ref[np.ndarray], np.ndarray]] = []
        self._view_count = np.zeros(self.num_slots, dtype=np.int32)
        self._prune_at = 64
        self._index.viewed = self._viewed

    # -- introspection (tests, metrics) -------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def references(self, key: str) -> int:
        return self._index.refs.get(key, 0)

    @property
    def referenced_keys(self) -> dict[str, int]:
        return dict(self._index.refs)

    @property
    def stored_keys(self) -> list[str]:
        """Keys with data, least recently used first."""
        return [k for k, slot in self._lru.items() if slot >= 0]

    # -- protocol -------------------------------------------------------------------------
    def put(
        self, objects: Sequence[StoreObject], *, retain: Iterable[str] = (), release: Iterable[str] = ()
    ) -> None:
        with self._lock:
            arena = self._check_open()
            _, payloads, slots, _ = self._index.plan_put(objects, retain, release, self.object_nbytes)
            if not slots:
                return  # all already stored (first write wins) or dropped as terminal victims
            idx = np.asarray(slots, dtype=np.int64)
            full = self.object_nbytes
            if payloads is None and self._short == 0 and isinstance(objects, BlockObjects) and objects.nbytes == full:
                # the common batch (the worker's full-size blocks, no short object stored): no
                # length bookkeeping beyond marking the slots full
                write_slots(arena, idx, None, objects)
                self._lengths[idx] = full
                return
            old = self._lengths[idx]
            sizes = write_slots(arena, idx, payloads, objects)
            self._short += int(np.count_nonzero(sizes != full)) - int(np.count_nonzero((old != full) & (old != 0)))
            self._lengths[idx] = sizes

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        with self._lock:
            arena = self._check_open()
            if not keys:
                return b""
            slots = self._index.lookup(keys)
            idx = np.asarray(slots, dtype=np.int64)
            lengths = self._lengths[idx]
            if (lengths == self.object_nbytes).all():
                return arena[idx].tobytes()
            return b"".join(arena[s, : int(n)].tobytes() for s, n in zip(slots, lengths))

    def read_into(self, keys: Sequence[str], out: memoryview) -> None:
        """Like ``get_concatenated`` but copies straight into ``out`` (one copy, no bytes object)."""
        with self._lock:
            arena = self._check_open()
            slots = self._index.lookup(keys)
            idx = np.asarray(slots, dtype=np.int64)
            dst = np.frombuffer(out, dtype=np.uint8)
            if self._short == 0:  # every stored object is full size: no per-object lengths to add up
                if len(idx) * self.object_nbytes != dst.nbytes:
                    raise CorruptObjectError(
                        f"{len(keys)} objects hold {len(idx) * self.object_nbytes} bytes; the reader expects {dst.nbytes}"
                    )
                np.take(arena, idx, axis=0, out=dst.reshape(len(idx), self.object_nbytes), mode="clip")
                return
            lengths = self._lengths[idx]
            if int(lengths.sum()) != dst.nbytes:
                raise CorruptObjectError(
                    f"{len(keys)} objects hold {int(lengths.sum())} bytes; the reader expects {dst.nbytes}"
                )
            if (lengths == self.object_nbytes).all():
                # mode="clip": indices are valid, and "raise" with out= copies through a temporary
                np.take(arena, idx, axis=0, out=dst.reshape(len(idx), self.object_nbytes), mode="clip")
            else:
                pos = 0
                for s, n in zip(slots, lengths.tolist()):
                    dst[pos : pos + n] = arena[s, :n]
                    pos += n

    def read_rows(self, keys: Sequence[str], dtype: np.dtype, shape: tuple[int, ...]) -> StoreRows | None:
        """The objects of ``keys`` as rows of ``shape`` (one block each) left in the arena, no copy.

        None when the objects are not exactly one block each (read them with ``read_into``). The
        slots stay out of reuse while the returned rows (or a slice of them) are alive, even if
        their keys are evicted meanwhile.
        """
        with self._lock:
            arena = self._check_open()
            if dtype.itemsize * math.prod(shape) != self.object_nbytes or not keys:
                return None
            slots = self._index.lookup(keys)
            idx = np.asarray(slots, dtype=np.int64)
            if self._short and np.count_nonzero(self._lengths[idx] != self.object_nbytes):
                return None
            # a fresh array over the arena per read: its lifetime is this read's (weakly tracked)
            src = np.frombuffer(arena.data, dtype=np.uint8).view(dtype).reshape(self.num_slots, *shape)
            self._fresh.append((weakref.ref(src), idx))
            if len(self._fresh) >= self._prune_at:
                self._fresh = _alive(self._fresh)
                self._prune_at = max(64, 2 * len(self._fresh))
            return StoreRows(src, idx)

    def _viewed(self, slots: list[int]) -> list[int]:
        """Those of ``slots`` some ``read_rows`` result still reads (asked when evicting)."""
        if not self._fresh and not self._counted:
            return []
        live = []
        for ref, idx in self._counted:
            if ref() is None:
                np.subtract.at(self._view_count, idx, 1)
            else:
                live.append((ref, idx))
        fresh = _alive(self._fresh)
        if fresh:
            np.add.at(self._view_count, np.concatenate([e[1] for e in fresh]), 1)
        self._counted, self._fresh = live + fresh, []
        if not self._counted:
            return []
        return [s for s, n in zip(slots, self._view_count[slots].tolist()) if n]

    def drain_lost(self) -> list[str]:
        """Keys evicted since the last call, for the scheduler's view of readable routes."""
        return self._index.drain_lost()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self._check_open()
            return self._index.contains(keys)

    def close(self) -> None:
        with self._lock:
            self._arena = None
            self._index.clear()

    # -- internals --------------------------------------------------------------------------
    def _check_open(self) -> np.ndarray:
        if self._arena is None:
            raise StoreClosedError("ArenaStore")
        return self._arena


def _alive(reads: list[tuple[weakref.ref[np.ndarray], np.ndarray]]) -> list[tuple[weakref.ref[np.ndarray], np.ndarray]]:
    """The reads whose rows someone still holds."""
    return [r for r in reads if r[0]() is not None]
