"""In-process route store: one preallocated arena of fixed-size slots.

Reference counts are held by live requests (a key is pinned while any request needs it, even
before its data exists); unreferenced objects age out LRU. Releases arrive tail-first, so the
tail of a finished chain is evicted before its head, mirroring the KV cache's free queue.
Everything fails closed: a batch that cannot fit is rejected whole (newly registered keys are
rolled back) and a read of a missing key raises, naming it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from auxout.errors import (
    CorruptObjectError,
    InvariantError,
    ObjectMissingError,
    StoreCapacityError,
    StoreClosedError,
)
from auxout.stores.base import StoreObject, check_payload
from auxout.stores.policy import EvictionPolicy

_UNWRITTEN = -1


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
        self._lru: OrderedDict[str, int] = OrderedDict()  # oldest first; value = slot
        self._refs: dict[str, int] = {}
        self._free: list[int] = []
        self._next_slot = 0
        self._policy = policy
        self._lock = threading.Lock()

    # -- introspection (tests, metrics) -------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def references(self, key: str) -> int:
        return self._refs.get(key, 0)

    @property
    def referenced_keys(self) -> dict[str, int]:
        return dict(self._refs)

    # -- protocol -------------------------------------------------------------------------
    def put(
        self, objects: Sequence[StoreObject], *, retain: Iterable[str] = (), release: Iterable[str] = ()
    ) -> None:
        with self._lock:
            arena = self._check_open()
            unique: dict[str, memoryview] = {}
            for key, payload in objects:
                if key not in unique:
                    unique[key] = check_payload(key, payload, self.object_nbytes)
            for key in retain:
                self._change_ref(key, +1)
            terminal: list[str] = []
            for key in release:
                if self._change_ref(key, -1) == 0:
                    terminal.append(key)
            lru = self._lru
            for key in unique:
                if key not in lru:
                    lru[key] = _UNWRITTEN
                else:
                    lru.move_to_end(key)
            for key in terminal:
                if key in lru:
                    lru.move_to_end(key)
            excess = len(lru) - self.num_slots
            if excess > 0:
                terminal_set = set(terminal)
                self._evict(excess, {k for k in unique if k not in terminal_set}, unique)
            new = [(k, v) for k, v in unique.items() if lru.get(k) == _UNWRITTEN]
            if not new:
                return  # all already stored (first write wins) or dropped as terminal victims
            slots = []
            for key, _ in new:
                slot = self._free.pop() if self._free else self._take_next_slot()
                lru[key] = slot
                slots.append(slot)
            idx = np.asarray(slots, dtype=np.int64)
            sizes = [v.nbytes for _, v in new]
            self._lengths[idx] = sizes
            if min(sizes) == self.object_nbytes:  # one gather of the payloads, one scatter
                arena[idx] = np.frombuffer(b"".join(v for _, v in new), dtype=np.uint8).reshape(len(new), -1)
            else:
                for slot, (_, v) in zip(slots, new):
                    arena[slot, : v.nbytes] = np.frombuffer(v, dtype=np.uint8)

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        with self._lock:
            arena = self._check_open()
            if not keys:
                return b""
            lru = self._lru
            slots = [lru.get(k, _UNWRITTEN) for k in keys]
            if _UNWRITTEN in slots:
                raise self._missing(keys, slots)
            idx = np.asarray(slots, dtype=np.int64)
            lengths = self._lengths[idx]
            if (lengths == self.object_nbytes).all():
                out = arena[idx].tobytes()
            else:
                out = b"".join(arena[s, : int(n)].tobytes() for s, n in zip(slots, lengths))
            for k in keys:
                lru.move_to_end(k)
            return out

    def read_into(self, keys: Sequence[str], out: memoryview) -> None:
        """Like ``get_concatenated`` but copies straight into ``out`` (one copy, no bytes object)."""
        with self._lock:
            arena = self._check_open()
            lru = self._lru
            slots = [lru.get(k, _UNWRITTEN) for k in keys]
            if _UNWRITTEN in slots:
                raise self._missing(keys, slots)
            idx = np.asarray(slots, dtype=np.int64)
            lengths = self._lengths[idx]
            dst = np.frombuffer(out, dtype=np.uint8)
            if int(lengths.sum()) != dst.nbytes:
                raise CorruptObjectError(f"{len(keys)} objects hold {int(lengths.sum())} bytes; the reader expects {dst.nbytes}")
            if (lengths == self.object_nbytes).all():
                # mode="clip": indices are valid, and "raise" with out= copies through a temporary
                np.take(arena, idx, axis=0, out=dst.reshape(len(idx), self.object_nbytes), mode="clip")
            else:
                pos = 0
                for s, n in zip(slots, lengths.tolist()):
                    dst[pos : pos + n] = arena[s, :n]
                    pos += n
            for k in keys:
                lru.move_to_end(k)

    def _missing(self, keys: Sequence[str], slots: list[int]) -> ObjectMissingError:
        missing = [k for k, s in zip(keys, slots) if s == _UNWRITTEN]
        return ObjectMissingError(
            missing,
            f"the object may have been evicted (used={len(self._lru)}, limit={self.num_slots} objects); "
            "increase the store's max_bytes when a KV cache hit requires it",
        )

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self._check_open()
            lru = self._lru
            return [lru.get(k, _UNWRITTEN) != _UNWRITTEN for k in keys]

    def close(self) -> None:
        with self._lock:
            self._arena = None
            self._lru.clear()
            self._refs.clear()

    # -- internals --------------------------------------------------------------------------
    def _check_open(self) -> np.ndarray:
        if self._arena is None:
            raise StoreClosedError("ArenaStore")
        return self._arena

    def _take_next_slot(self) -> int:
        slot = self._next_slot
        if slot >= self.num_slots:
            raise InvariantError("ArenaStore slot accounting broken: no free slot after eviction")
        self._next_slot += 1
        return slot

    def _change_ref(self, key: str, delta: int) -> int:
        old = self._refs.get(key, 0)
        new = old + delta
        if new < 0:
            raise InvariantError(f"ArenaStore release of {key!r} which no live request references")
        if new:
            self._refs[key] = new
        else:
            del self._refs[key]
        if self._policy is not None:
            self._policy.on_reference_change(key, old, new)
        return new

    def _evict(self, excess: int, protected: set[str], unique: dict[str, memoryview]) -> None:
        refs = self._refs
        lru = self._lru
        victims: list[str] = []
        if self._policy is None:
            for key in lru:
                if key not in refs and key not in protected:
                    victims.append(key)
                    if len(victims) == excess:
                        break
            ok = len(victims) == excess
        else:
            candidates = [k for k in lru if k not in refs and k not in protected]
            chosen = self._policy.select_victims(candidates, excess)
            cand = set(candidates)
            ok = (
                chosen is not None
                and len(chosen) == excess
                and len(set(chosen)) == excess
                and all(k in cand for k in chosen)
            )
            victims = list(chosen) if ok and chosen is not None else []
        if not ok:
            rolled = [k for k in unique if lru.get(k) == _UNWRITTEN]
            for k in rolled:
                del lru[k]
            if self._policy is not None and rolled:
                self._policy.on_remove(rolled, "rollback")
            raise StoreCapacityError(
                f"route store cannot retain the requested batch: limit={self.num_slots} objects, "
                f"{len(refs)} referenced by live requests; nothing from this batch was written "
                "(raise max_bytes, or lower max_num_seqs / KV cache size)"
            )
        for key in victims:
            slot = lru.pop(key)
            if slot != _UNWRITTEN:
                self._free.append(slot)
        if self._policy is not None:
            self._policy.on_remove(victims, "eviction")
