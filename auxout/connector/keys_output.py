"""Keys-only output: a request's response carries a small manifest instead of its route array.

Full hash blocks are named by their content keys (the worker already published them); the rows
after the last full block are published as boundary objects under fresh keys. A manifest is
returned only once every object it names is readable, so a trainer can ``fetch`` it at once.
This runs on the scheduler side, next to ``SchedulerConnector.take_output``, with its own
client of a store both sides can reach (shared memory, Redis, Mooncake).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from auxout.errors import BlockStoreError, ManifestUnavailableError, PublicationError
from auxout.keys import KeySpace
from auxout.manifest import RouteManifest, publish_manifest
from auxout.profile import RouteProfile
from auxout.stores.base import BlockStore


def store_address(store: BlockStore) -> str:
    """The address a reader opens (``local://`` for an in-process store: pass it to ``fetch``)."""
    inner = getattr(store, "inner", store)
    return str(getattr(inner, "address", "local://"))


class KeysPublisher:
    """Holds each keys-mode request's accepted rows until it finishes, then builds its manifest."""

    def __init__(
        self,
        store: BlockStore | Callable[[int], BlockStore],
        *,
        keyspace: KeySpace,
        block_size: int,
        profile: RouteProfile | None = None,
        address: str | None = None,
        readable_timeout: float = 10.0,
    ) -> None:
        """``store`` may be a factory taking the object size, for a side that learns the route
        shape only from the first rows it sees (an engine's scheduler process)."""
        self._store = store if not callable(store) else None
        self._factory = store if callable(store) else None
        self.profile = profile
        self.keyspace = keyspace
        self.block_size = block_size
        self._address = address
        self.readable_timeout = readable_timeout
        self._rows: dict[str, list[np.ndarray]] = {}
        self._start: dict[str, int] = {}
        self._like: dict[str, np.ndarray] = {}  # an empty row array per request: shape and dtype
        self._first: dict[str, int] = {}  # the manifest's first position (the request's prompt_start)

    @property
    def store(self) -> BlockStore:
        if self._store is None:
            raise PublicationError("keys-only output has no store yet: no routes were seen")
        return self._store

    @property
    def address(self) -> str:
        return self._address or store_address(self.store)

    def _ensure_store(self, rows: np.ndarray) -> None:
        if self._store is None and self._factory is not None:
            row_nbytes = rows.dtype.itemsize * int(np.prod(rows.shape[1:]))
            self._store = self._factory(self.block_size * row_nbytes)

    def expect(self, request_id: str, prompt_start: int) -> None:
        """A keys-mode request was admitted: its manifest starts at ``prompt_start``; the connector
        sends this publisher rows from the start of that position's block."""
        self._first[request_id] = prompt_start

    def add(self, request_id: str, token_start: int, rows: np.ndarray) -> None:
        """Accept one step's clipped rows (positions ``token_start ...``)."""
        chunks = self._rows.setdefault(request_id, [])
        if request_id not in self._start:
            self._start[request_id] = token_start
            self._like[request_id] = rows[:0]
            self._ensure_store(rows)
        if len(rows):
            chunks.append(rows)

    def finish(
        self, request_id: str, *, block_hashes: Sequence[bytes], generation: int, token_end: int
    ) -> RouteManifest:
        """Manifest of rows ``[first accepted position, token_end)``; publishes what is missing first."""
        start, first, held = self._pop(request_id, token_end)
        bs = self.block_size
        n_full = token_end // bs
        keys = self.keyspace.keys(list(block_hashes[:n_full]), generation)
        if len(keys) < n_full:
            raise PublicationError(f"request {request_id!r} has {len(keys)} block hashes; {n_full} full blocks")
        first_block = first // bs  # blocks the manifest names
        try:
            self._ensure_readable(keys[first_block:], held, start, first_block)
            full_end = n_full * bs
            if start > full_end:  # publish_manifest indexes the tail from full_end; those rows are skipped
                padded = np.concatenate([np.zeros((start - full_end, *held.shape[1:]), held.dtype), held])
                start_in_held = full_end
            else:
                padded, start_in_held = held, start
            tail = padded[full_end - start_in_held :]
            manifest = publish_manifest(
                self.store,
                address=self.address,
                block_keys=keys,
                tail_rows=tail,
                token_start=first,
                token_end=token_end,
                block_size=bs,
                namespace=self.keyspace.namespace,
            )
            touch = getattr(self.store, "touch", None)  # (a store with a TTL restarts it for the fetch)
            named = list(manifest.keys)
            if named and not all(touch(named) if touch is not None else self.store.contains(named)):
                raise PublicationError("the store evicted part of the manifest while publishing it (full?)")
            return manifest
        except BlockStoreError as exc:
            if first < start:  # rows before the held ones exist only in the store: nothing to fall back to
                raise
            reason = f"{type(exc).__name__}: {exc}"
            raise ManifestUnavailableError(request_id, reason, held[first - start :]) from exc

    def first(self, request_id: str) -> int:
        """The manifest's first position (the request's ``prompt_start``)."""
        return self._first.get(request_id, 0)

    def rewind(self, request_id: str) -> None:
        """Forget the rows held for a request, none of which it was returned (a reset before its
        prompt_start: the recompute's rows replace them)."""
        self._rows.pop(request_id, None)
        self._start.pop(request_id, None)

    def take_rows(self, request_id: str, token_end: int) -> np.ndarray:
        """The rows held for a request from its manifest's first position, to answer it inline."""
        start, first, held = self._pop(request_id, token_end)
        return held[first - start :]

    def _pop(self, request_id: str, token_end: int) -> tuple[int, int, np.ndarray]:
        """Forget a request: (first held position, the manifest's first position, the held rows)."""
        chunks = self._rows.pop(request_id, [])
        start = self._start.pop(request_id, token_end)
        first = min(max(self._first.pop(request_id, start), start), token_end)
        like = self._like.pop(request_id, None)
        if chunks:
            held = np.concatenate(chunks)
        elif like is not None:
            held = like
        elif self.profile is not None:
            held = self.profile.empty(0)
        else:
            raise PublicationError(f"keys-only output for {request_id!r} saw no rows (shape unknown)")
        if start + len(held) != token_end:
            raise PublicationError(
                f"keys-only output for {request_id!r} holds rows [{start}, {start + len(held)}) "
                f"but the request accepted [{start}, {token_end})"
            )
        return start, first, held

    def discard(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self._start.pop(request_id, None)
        self._like.pop(request_id, None)
        self._first.pop(request_id, None)

    def _ensure_readable(self, keys: list[str], held: np.ndarray, start: int, first_block: int) -> None:
        """Wait for the worker's publications; publish blocks it cannot have yet from held rows.

        The worker learns a decode block's hash one step late, so the last blocks of a finished
        request may not be stored yet; their bytes are identical under the same content key, so
        publishing them here is safe (first write wins) and avoids waiting on the engine loop.
        """
        if not keys:
            return
        bs = self.block_size
        present = self.store.contains(keys)
        missing = [i for i, ok in enumerate(present) if not ok]
        ours = [i for i in missing if (first_block + i) * bs >= start]  # fully inside held rows
        if ours:
            objs = []
            for i in ours:
                lo = (first_block + i) * bs - start
                block = np.ascontiguousarray(held[lo : lo + bs])
                objs.append((keys[i], memoryview(block.reshape(-1).view(np.uint8).data)))  # type: ignore[arg-type]
            self.store.put(objs)
            ours_keys = [keys[i] for i in ours]
            if not all(self.store.contains(ours_keys)):  # applied (reads see earlier writes) yet absent
                raise PublicationError(f"the store could not keep {len(ours_keys)} route object(s) (full?)")
        deadline = time.monotonic() + self.readable_timeout
        pending = [keys[i] for i in missing if i not in set(ours)]
        delay = 0.001
        while pending:
            ok = self.store.contains(pending)
            pending = [k for k, p in zip(pending, ok) if not p]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise PublicationError(
                    f"{len(pending)} route object(s) not readable after {self.readable_timeout}s: {pending[:3]}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
