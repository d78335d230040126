"""Scheduler-side view of which route objects the worker can read, so prefix hits can be clipped.

The scheduler decides how much of a prompt a prefix hit (local KV cache or a KV connector) skips,
but the routes of the skipped tokens live in the worker's store, which the scheduler process may
not see (an in-process arena). The worker therefore reports, with every step output, the keys it
published and the keys the store lost (evicted, dropped for capacity or an outage, found missing
on a read); this index mirrors them. A hit is clipped to the longest prefix whose blocks are

- not known lost, and
- known published, or inside the *local* KV hit (published this very step by the request that
  computes it, or just finished: the worker publishes before any read), or
- readable in a shared store the scheduler can ask (other instances' routes: P/D, replicas,
  restarts), with one batched ``contains`` call.

Reports lag the writer thread, so the view can be optimistic for a moment; the worker's read then
fails and the engine recomputes (see ``SchedulerConnector.begin_output``). Memory is bounded: both
sets are LRU-capped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

ContainsFn = Callable[[Sequence[str]], Sequence[bool]]


class RouteIndex:
    """Published and lost route keys, as reported by the worker (LRU-capped)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity <= 0:
            raise ValueError(f"RouteIndex capacity must be positive, got {capacity!r}")
        self.capacity = capacity
        self._published: OrderedDict[str, None] = OrderedDict()
        self._lost: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._published)

    def apply(self, published: Sequence[str], lost: Sequence[str]) -> None:
        """One step's reports. A key in both lists counts as lost: publications are reported when
        issued and losses when the store applies them, so within one window the loss is later
        (the rarer opposite order only costs a recompute)."""
        pub, gone = self._published, self._lost
        for k in published:
            gone.pop(k, None)
            pub[k] = None
            pub.move_to_end(k)
        for k in lost:
            pub.pop(k, None)
            gone[k] = None
            gone.move_to_end(k)
        cap = self.capacity
        while len(pub) > cap:
            pub.popitem(last=False)
        while len(gone) > cap:
            gone.popitem(last=False)

    def mark_lost(self, keys: Sequence[str]) -> None:
        self.apply((), keys)

    def is_lost(self, key: str) -> bool:
        return key in self._lost

    def readable_blocks(self, keys: Sequence[str], num_local: int, contains: ContainsFn | None = None) -> int:
        """How many leading ``keys`` are readable; the first ``num_local`` are local KV hits."""
        pub, gone = self._published, self._lost
        n = len(keys)
        for i, k in enumerate(keys):
            if k in gone:
                return i
            if k in pub or i < num_local:
                continue
            if contains is None:
                return i
            rest = list(keys[i:])
            try:
                found = contains(rest)
            except Exception:  # an unreachable shared store: nothing beyond here is readable
                return i
            for j, ok in enumerate(found):
                if not ok:
                    return i + j
            return n
        return n

    def clear(self) -> None:
        self._published.clear()
        self._lost.clear()
