"""A store that writes to its own backend and also reads other instances' stores.

A shared-memory segment has one writer (the engine that created it), so two engines on one host
(a P/D pair) cannot publish into the same segment. Each writes its own; the decode engine reads
the prefill engine's segment through this wrapper: ``make_store("shm", shm_name=...,
read_from=["shm://<prefill segment>"])``. Keys are content keys, so an object found in any
source is the one asked for; the own store is asked first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

from auxout.errors import BlockStoreError, CorruptObjectError
from auxout.stores.base import BlockStore, StoreObject, raise_missing
from auxout.stores.open import open_store


class ReadThroughStore:
    """``put`` goes to ``primary``; reads fall back to ``readers`` (opened lazily by address)."""

    def __init__(self, primary: BlockStore, read_from: Sequence[str]) -> None:
        if not read_from:
            raise ValueError("ReadThroughStore needs at least one address to read from")
        self.primary = primary
        self.inner = primary  # what store_address() and metrics look through
        self.object_nbytes = primary.object_nbytes
        self.read_from = list(read_from)
        self._readers: dict[str, BlockStore] = {}

    def put(self, objects: Sequence[StoreObject], *, retain: Iterable[str] = (), release: Iterable[str] = ()) -> None:
        self.primary.put(objects, retain=retain, release=release)

    def drain_lost(self) -> list[str]:
        drain = getattr(self.primary, "drain_lost", None)
        return drain() if drain is not None else []

    def contains(self, keys: Sequence[str]) -> list[bool]:
        found = list(self.primary.contains(keys))
        for reader in self._open_readers():
            if all(found):
                break
            rest = [i for i, ok in enumerate(found) if not ok]
            for i, ok in zip(rest, reader.contains([keys[i] for i in rest])):
                found[i] = found[i] or ok
        return found

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        found = self.primary.contains(keys)
        if all(found):
            return self.primary.get_concatenated(keys)
        parts: list[bytes | None] = [None] * len(keys)
        own = [i for i, ok in enumerate(found) if ok]
        if own:
            self._split(self.primary.get_concatenated([keys[i] for i in own]), own, parts)
        for reader in self._open_readers():
            rest = [i for i, p in enumerate(parts) if p is None]
            if not rest:
                break
            have = [i for i, ok in zip(rest, reader.contains([keys[i] for i in rest])) if ok]
            if have:
                self._split(reader.get_concatenated([keys[i] for i in have]), have, parts)
        raise_missing(keys, [p is not None for p in parts], f"not in the own store nor in {self.read_from}")
        return b"".join(p for p in parts if p is not None)

    def close(self) -> None:
        for reader in self._readers.values():
            with contextlib.suppress(BlockStoreError):
                reader.close()
        self._readers.clear()
        self.primary.close()

    def _split(self, blob: bytes, idx: list[int], parts: list[bytes | None]) -> None:
        n = self.object_nbytes
        if len(blob) != n * len(idx):  # full blocks only: every object has the same size
            raise CorruptObjectError(f"{len(idx)} objects came back as {len(blob)} bytes")
        for j, i in enumerate(idx):
            parts[i] = blob[j * n : (j + 1) * n]

    def _open_readers(self) -> list[BlockStore]:
        opened = (_reader(self._readers, address, self.object_nbytes) for address in self.read_from)
        return [r for r in opened if r is not None]


def _reader(readers: dict[str, BlockStore], address: str, object_nbytes: int) -> BlockStore | None:
    """The open reader of a peer's store, reopened when the peer replaced it (a restarted engine
    creates its segment anew under the same name); None while it cannot be opened (the peer
    starts later, or is restarting: tried again on the next read)."""
    reader = readers.get(address)
    replaced = getattr(reader, "replaced", None)
    if reader is not None and replaced is not None and replaced():
        with contextlib.suppress(BlockStoreError):
            reader.close()
        del readers[address]
        reader = None
    if reader is None:
        try:
            reader = readers[address] = open_store(address, object_nbytes=object_nbytes)
        except (OSError, ValueError, BlockStoreError):
            return None
    return reader


def peers_contains(read_from: Sequence[str]) -> Callable[[Sequence[str]], list[bool]]:
    """``contains`` over other engines' stores only (a scheduler's view of its P/D peers)."""
    readers: dict[str, BlockStore] = {}

    def contains(keys: Sequence[str]) -> list[bool]:
        found = [False] * len(keys)
        for address in read_from:
            reader = _reader(readers, address, 1)  # (contains reads no payload)
            if reader is None:
                continue
            rest = [i for i, ok in enumerate(found) if not ok]
            if not rest:
                break
            for i, ok in zip(rest, reader.contains([keys[i] for i in rest])):
                found[i] = ok
        return found

    return contains
