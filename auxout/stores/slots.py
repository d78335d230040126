"""Reference counts, LRU order and slot allocation of a fixed-slot store (arena, shared memory).

Keys are pinned by live requests (possibly before their data exists); unreferenced keys age
out LRU. Released keys move to the recent end in release order, so a chain released tail-first
loses its tail first, as the KV cache's free queue does. Only the order of unreferenced keys
is observable: a referenced key cannot be evicted and moves to the recent end when released.
A batch that cannot fit is rejected whole: keys it registered are rolled back and
``StoreCapacityError`` is raised.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import filterfalse, islice, repeat

import numpy as np

from auxout.errors import InvariantError, ObjectMissingError, StoreCapacityError
from auxout.metrics import COUNTS
from auxout.stores.base import BlockObjects, StoreObject, check_payload, drain, trusted_batch
from auxout.stores.policy import EvictionPolicy

UNWRITTEN = -1
# Batches of fewer objects are copied payload by payload: a joined temporary of ~100 KB is
# allocated and freed every decode step, and glibc hands its pages back to the kernel each time
# (measured 60 us for 16 objects vs 25 us copying each one).
_JOIN_MIN = 64


class SlotIndex:
    """Which key lives in which slot, who pins it, and what to evict; no payload bytes."""

    def __init__(self, num_slots: int, owner: str, policy: EvictionPolicy | None = None, backend: str = "") -> None:
        self.num_slots = num_slots
        self.owner = owner
        self.backend = backend  # the metrics label its evictions are counted under ("": not counted)
        self.policy = policy
        self.lru: OrderedDict[str, int] = OrderedDict()  # oldest first; value = slot
        self.refs: dict[str, int] = {}
        self.free: list[int] = []
        self.next_slot = 0
        self.lost: deque[str] = deque()  # evicted keys not yet drained (see ``drain_lost``)
        # slots a reader still views uncopied (``ArenaStore.read_rows``): an evicted key's slot
        # waits in ``quarantine`` until nobody reads it, instead of going to ``free``
        self.viewed: Callable[[list[int]], list[int]] | None = None
        self.quarantine: list[int] = []

    def plan_put(
        self, objects: Sequence[StoreObject], retain: Iterable[str], release: Iterable[str], object_nbytes: int
    ) -> tuple[list[str], list[memoryview] | None, list[int], list[int]]:
        """Apply retains, releases and recency; evict to fit.

        Returns ``(new_keys, payloads, slots, freed)``: the keys to write with their payloads and
        freshly assigned slots, and the slots of evicted objects (the caller invalidates them).
        ``payloads`` is None when ``objects`` is a ``BlockObjects`` batch written whole, in order:
        the caller copies its arrays (``write_slots``).
        """
        if self.quarantine:
            self._reclaim()
        trusted = trusted_batch(objects, object_nbytes)
        unique: dict[str, memoryview | None]
        if trusted:
            unique = dict.fromkeys(objects.keys)  # type: ignore[attr-defined]  # checked as a batch
        else:
            unique = {}
            for key, payload in objects:
                if key not in unique:
                    unique[key] = check_payload(key, payload, object_nbytes)
        if self.policy is None:
            terminal = self._apply_refs(retain, release)
        else:
            for key in retain:
                self._change_ref(key, +1)
            terminal = [key for key in release if self._change_ref(key, -1) == 0]
        lru = self.lru
        # objects are immutable: a re-put only refreshes recency; new keys join at the recent end
        # in batch order (per-key work through map/update, which run in C)
        fresh = list(filterfalse(lru.__contains__, unique))
        if len(fresh) == len(unique) and self.policy is None and all(map(self.refs.__contains__, fresh)):
            return self._planned(objects, trusted, unique, fresh, *self._plan_pinned(fresh, terminal))
        if len(fresh) == len(unique):
            lru.update(dict.fromkeys(fresh, UNWRITTEN))
        else:  # some are stored already: keep batch order across moved and new keys
            for key in unique:
                if key in lru:
                    lru.move_to_end(key)
                else:
                    lru[key] = UNWRITTEN
        if terminal:
            _to_recent_end(lru, terminal)
        freed: list[int] = []
        all_fresh = len(fresh) == len(unique)
        excess = len(lru) + len(self.quarantine) - self.num_slots
        if excess > 0:
            terminal_set = set(terminal)
            freed = self._evict(excess, unique.keys() - terminal_set, unique)
            all_fresh = all_fresh and terminal_set.isdisjoint(unique)  # else a new key may be a victim
        new = fresh if all_fresh else [k for k in unique if lru.get(k) == UNWRITTEN]
        slots = self._take_slots(len(new))
        lru.update(zip(new, slots))
        return self._planned(objects, trusted, unique, new, slots, freed)

    def _plan_pinned(self, fresh: list[str], terminal: list[str]) -> tuple[list[int], list[int]]:
        """``plan_put`` for the engine's common batch: every key new and pinned by a live request.

        A pinned key cannot be evicted, and it moves to the recent end when its last holder
        releases it, so where it joins the LRU order is never observable: eviction runs first
        (over the same candidates, in the same order) and each key joins once, with its slot.
        """
        lru = self.lru
        if terminal:
            _to_recent_end(lru, terminal)
        freed: list[int] = []
        excess = len(lru) + len(fresh) + len(self.quarantine) - self.num_slots
        if excess > 0:
            freed = self._evict(excess, set(), {})  # the new keys are not in the LRU yet
        slots = self._take_slots(len(fresh))
        lru.update(zip(fresh, slots))
        return slots, freed

    def _planned(
        self,
        objects: Sequence[StoreObject],
        trusted: bool,
        unique: dict[str, memoryview | None],
        new: list[str],
        slots: list[int],
        freed: list[int],
    ) -> tuple[list[str], list[memoryview] | None, list[int], list[int]]:
        """``plan_put``'s result: payloads None when the whole ``BlockObjects`` batch is written."""
        if not trusted:
            return new, [unique[k] for k in new], slots, freed  # type: ignore[misc]  # all checked views
        if len(new) == len(objects):
            return new, None, slots, freed
        views: dict[str, memoryview] = {}
        for key, view in zip(objects.keys, objects.payloads()):  # type: ignore[attr-defined]
            views.setdefault(key, view)  # first write wins inside a batch too
        return new, [views[k] for k in new], slots, freed

    def lookup(self, keys: Sequence[str]) -> list[int]:
        """Slots of ``keys`` (touching them in the LRU order); ``ObjectMissingError`` naming every absent key.

        The per-key work runs in C (``map``): a multi-turn prefix read touches hundreds of keys;
        the explanation of a miss is built only when there is one. The touch is skipped when
        every key is pinned (the worker's prefix reads): a referenced key's place in the order is
        never observable, since it moves to the recent end when its last holder releases it.
        """
        lru = self.lru
        try:
            slots = list(map(lru.__getitem__, keys))
        except KeyError:
            slots = [lru.get(k, UNWRITTEN) for k in keys]
        if UNWRITTEN in slots:
            raise ObjectMissingError(
                [k for k, s in zip(keys, slots) if s == UNWRITTEN],
                f"the object may have been evicted (used={len(lru)}, limit={self.num_slots} objects); "
                "engines recompute a prefix hit whose routes are gone; a keys-only manifest must be fetched "
                "before later requests evict it (or raise max_bytes)",
            )
        if not all(map(self.refs.__contains__, keys)):  # (a pinned key's place is not observable)
            deque(map(lru.move_to_end, keys), 0)
        return slots

    def contains(self, keys: Sequence[str]) -> list[bool]:
        lru = self.lru
        return [lru.get(k, UNWRITTEN) != UNWRITTEN for k in keys]

    def clear(self) -> None:
        self.lru.clear()
        self.refs.clear()
        self.lost.clear()
        self.quarantine.clear()

    def _apply_refs(self, retain: Iterable[str], release: Iterable[str]) -> list[str]:
        """Retains, then releases, without a policy to notify; returns keys released to zero.

        Same semantics as ``_change_ref`` per key. A new turn of a long conversation retains (and
        later releases) its whole history, one key per block, and a prefill step hundreds of new
        blocks: the common batch (keys new to ``refs``, or each released by its last holder, no
        key twice) runs through ``map``/``update`` in C, after the pairs a next turn brings (its
        history retained as the previous turn releases it) cancel out; anything else takes the
        per-key loop.
        """
        refs = self.refs
        get = refs.get
        retain = list(retain)
        release = list(release)
        if retain and release:
            retain, release = _cancel_pairs(refs, retain, release)
        if retain:
            once = dict.fromkeys(retain, 1)
            if len(once) == len(retain) and refs.keys().isdisjoint(once):
                refs.update(once)
            else:
                for key in retain:
                    refs[key] = get(key, 0) + 1
        if not release:
            return []
        # one pass for the common batch (each key released by its last holder): pop them all,
        # then put back what was not a last reference (0: missing, or a key repeated in the list)
        held = list(map(refs.pop, release, repeat(0)))
        if held.count(1) == len(held):
            return release
        for key, n in zip(release, held):
            if n:
                refs[key] = n  # (a repeated key's first pop holds its count; the later ones 0)
        terminal: list[str] = []
        for key in release:
            n = get(key, 0) - 1
            if n > 0:
                refs[key] = n
            elif n == 0:
                del refs[key]
                terminal.append(key)
            else:
                raise InvariantError(f"{self.owner} release of {key!r} which no live request references")
        return terminal

    def drain_lost(self) -> list[str]:
        """Keys evicted since the last call (thread-safe against the evicting thread)."""
        return drain(self.lost)

    def _take_slots(self, n: int) -> list[int]:
        """``n`` slots: freed ones first (most recently freed first), then never-used ones."""
        free = self.free
        k = min(n, len(free))
        out = free[len(free) - k :][::-1]
        del free[len(free) - k :]
        rest = n - k
        if rest:
            if self.next_slot + rest > self.num_slots:
                raise InvariantError(f"{self.owner} slot accounting broken: no free slot after eviction")
            out.extend(range(self.next_slot, self.next_slot + rest))
            self.next_slot += rest
        return out

    def _change_ref(self, key: str, delta: int) -> int:
        old = self.refs.get(key, 0)
        new = old + delta
        if new < 0:
            raise InvariantError(f"{self.owner} release of {key!r} which no live request references")
        if new:
            self.refs[key] = new
        else:
            del self.refs[key]
        if self.policy is not None:
            self.policy.on_reference_change(key, old, new)
        return new

    def _oldest_unreferenced(self, excess: int, protected: set[str]) -> list[str]:
        """Up to ``excess`` victims: the oldest unreferenced, unprotected keys (filtered in C).

        Referenced keys scanned past move to the recent end: their place in the order is not
        observable, and the pins of long-running requests would otherwise sit at the old end and
        be scanned again by every eviction (a decode step's put took 41-48 ms behind 100k pinned
        blocks). The scan window grows geometrically, so a batch examines
        about twice the keys it evicts once the pins are out of the way.
        """
        refs, lru = self.refs, self.lru
        window = 2 * excess + 64
        while True:
            head = list(islice(lru, window))
            scan = filterfalse(protected.__contains__, head) if protected else head
            victims = list(islice(filterfalse(refs.__contains__, scan), excess))
            if len(victims) == excess or len(head) < window:
                break
            window *= 4
        if len(victims) == excess and victims:
            passed = list(filter(refs.__contains__, islice(head, head.index(victims[-1]))))
            deque(map(lru.move_to_end, passed), 0)
        return victims

    def _evict(self, excess: int, protected: set[str], unique: dict[str, memoryview | None]) -> list[int]:
        refs, lru = self.refs, self.lru
        victims: list[str] = []
        if self.policy is None:
            victims = self._oldest_unreferenced(excess, protected)
            ok = len(victims) == excess
        else:
            candidates = [k for k in lru if k not in refs and k not in protected]
            chosen = self.policy.select_victims(candidates, excess)
            cand = set(candidates)
            ok = (
                chosen is not None
                and len(chosen) == excess
                and len(set(chosen)) == excess
                and all(k in cand for k in chosen)
            )
            victims = list(chosen) if ok and chosen is not None else []
        if not ok:
            rolled = [k for k in unique if lru.get(k) == UNWRITTEN]
            for k in rolled:
                del lru[k]
            if self.policy is not None and rolled:
                self.policy.on_remove(rolled, "rollback")
            raise StoreCapacityError(
                f"{self.owner} cannot retain the requested batch: limit={self.num_slots} objects, "
                f"{len(refs)} referenced by live requests; nothing from this batch was written "
                "(raise max_bytes, or lower max_num_seqs / KV cache size)"
            )
        freed = [s for s in map(lru.pop, victims) if s != UNWRITTEN]
        self.lost.extend(victims)
        if self.backend and victims:
            COUNTS.add("store_evictions", len(victims), self.backend)
        if self.policy is not None:
            self.policy.on_remove(victims, "eviction")
        held = self.viewed(freed) if self.viewed is not None and freed else None
        if held:
            # still read through a view: the slot cannot take new data yet, so evict one more
            busy = set(held)
            freed = [s for s in freed if s not in busy]
            self.quarantine.extend(held)
            self.free.extend(freed)
            return freed + self._evict(len(held), protected, unique)
        self.free.extend(freed)
        return freed

    def _reclaim(self) -> None:
        """Quarantined slots nobody views any more become free."""
        busy = set(self.viewed(self.quarantine)) if self.viewed is not None else set()
        self.free.extend(s for s in self.quarantine if s not in busy)
        self.quarantine = [s for s in self.quarantine if s in busy]


def _cancel_pairs(refs: dict[str, int], retain: list[str], release: list[str]) -> tuple[list[str], list[str]]:
    """Drop keys both retained and released in one batch when that changes nothing observable.

    A conversation's next turn pins the history its previous turn releases in the same step:
    thousands of keys whose counts go +1 then -1. For a key already referenced that is a no-op
    (it stays referenced, so it is neither terminal nor moved in the LRU order), and without the
    pairs both lists take the fast paths of ``_apply_refs``. Keys repeated within a list, or a
    pair on an unreferenced key (retain then release makes it terminal), keep the lists as given;
    so do pairs a sample of every 8th release misses (a few stray keys: the per-key loop is exact).
    """
    if set(release[::8]).isdisjoint(retain):  # pairs come as whole chains: every 8th release finds them
        return retain, release
    once = dict.fromkeys(retain)
    both = once.keys() & release  # (set operations and filterfalse run in C)
    if not both or len(once) != len(retain) or len(set(release)) != len(release):
        return retain, release
    if not all(map(refs.__contains__, both)):
        return retain, release
    return list(filterfalse(both.__contains__, retain)), list(filterfalse(both.__contains__, release))


def write_slots(
    data: np.ndarray, slots: Sequence[int] | np.ndarray, payloads: Sequence[memoryview] | None, objects: Sequence[StoreObject]
) -> np.ndarray:
    """Copy the new objects of a planned put into ``data`` rows ``slots``; returns their lengths.

    ``payloads`` None (a ``BlockObjects`` batch written whole) copies each of the worker's block
    arrays with one numpy call, straight from its rows: no joined temporary, no object per block.
    """
    idx = np.asarray(slots, dtype=np.int64)
    if payloads is None:
        assert isinstance(objects, BlockObjects)
        nb = objects.nbytes
        pos = 0
        for arr in objects.chunks:
            data[idx[pos : pos + len(arr)], :nb] = arr
            pos += len(arr)
        return np.full(len(idx), nb, dtype=np.int64)
    sizes = np.fromiter((v.nbytes for v in payloads), dtype=np.int64, count=len(payloads))
    if len(idx) >= _JOIN_MIN and (sizes == data.shape[1]).all():  # one gather, one scatter
        data[idx] = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(len(idx), -1)
    else:  # a few objects: straight into their slots (see _JOIN_MIN)
        for slot, v in zip(slots, payloads):
            data[slot, : v.nbytes] = np.frombuffer(v, dtype=np.uint8)
    return sizes


def _to_recent_end(lru: OrderedDict[str, int], keys: list[str]) -> None:
    """Move ``keys`` that are in ``lru`` to its recent end, in order (one C-level pass when all are:
    a retry after a missing key moves the earlier ones again, in the same order)."""
    try:
        deque(map(lru.move_to_end, keys), 0)
    except KeyError:
        deque(map(lru.move_to_end, filter(lru.__contains__, keys)), 0)
