"""Pluggable eviction for the arena store.

The default is plain LRU among unreferenced objects. A policy can align route retention with
a KV offload connector's own cache ("keep routes as long as their KV can still be reused").
It runs synchronously inside store operations (on the writer thread when wrapped): keep it
light and never call back into the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

RemoveReason = Literal["eviction", "rollback"]


class EvictionPolicy(Protocol):
    def on_reference_change(self, key: str, old: int, new: int) -> None:
        """A live request started or stopped needing ``key``."""
        ...

    def select_victims(self, candidates: Sequence[str], count: int) -> Sequence[str] | None:
        """Pick exactly ``count`` distinct keys from ``candidates`` (oldest first), or None to refuse."""
        ...

    def on_remove(self, keys: Sequence[str], reason: RemoveReason) -> None:
        """Keys left the store (evicted, or rolled back before their data was written)."""
        ...


class LRUPolicy:
    """The arena's default behaviour, spelled out as a policy (oldest candidates first)."""

    def on_reference_change(self, key: str, old: int, new: int) -> None:
        return None

    def select_victims(self, candidates: Sequence[str], count: int) -> Sequence[str] | None:
        return list(candidates[:count]) if len(candidates) >= count else None

    def on_remove(self, keys: Sequence[str], reason: RemoveReason) -> None:
        return None
