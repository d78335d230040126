"""Route stores behind the ``BlockStore`` protocol."""

from __future__ import annotations

from typing import Any

from auxout.stores.arena import ArenaStore
from auxout.stores.background import BackgroundStore
from auxout.stores.base import BlockStore
from auxout.stores.policy import EvictionPolicy, LRUPolicy

__all__ = ["ArenaStore", "BackgroundStore", "BlockStore", "EvictionPolicy", "LRUPolicy", "make_store"]


def make_store(name: str, *, max_bytes: int, object_nbytes: int, background: bool = True, **kw: Any) -> BlockStore:
    """Build a store by backend name; ``arena`` (default) is the in-process store."""
    if name == "arena":
        inner: BlockStore = ArenaStore(max_bytes, object_nbytes, policy=kw.pop("policy", None))
    else:
        raise ValueError(f"unknown route store backend {name!r}; known: 'arena'")
    if kw:
        raise TypeError(f"unexpected options for store {name!r}: {sorted(kw)}")
    return BackgroundStore(inner, max_pending=64) if background else inner
