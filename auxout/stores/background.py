"""Moves store mutations off the engine's step path onto one writer thread.

Back-pressure: at most ``max_pending`` batches wait; a producer blocks beyond that. A read
waits for the queue to drain only when one of its keys is still queued, so it observes every
earlier write of those keys (read-your-writes) without stalling behind unrelated work. A writer
failure is sticky: later batches are skipped (fail closed) and every later call raises. Two
exceptions: ``StoreCapacityError`` (the inner store rejected that batch whole and stayed
consistent) and ``StoreUnavailableError`` (a remote server is down or slow: transient). Such a
batch is counted in ``dropped_batches``; later reads of its keys fail closed, while everything
else keeps working and writes resume when the server is back.

``inline_below`` (bytes, default 0 = never): a smaller batch arriving while the writer is idle
is applied on the caller's thread. For an in-memory store that is cheaper than the hand-off: a
decode step's few blocks cost less to copy than to wake a thread and then wait for the GIL it
holds; large batches (prefill) still overlap with the engine. Never use it for network stores.
A batch releasing ``INLINE_MAX_RELEASES`` keys or more (a finished prefill's teardown) is queued
whatever its bytes: its index work is a prefill's, and nothing waits for a release
(the prefill replay of ``benchmarks/dataplane.py``: 12% less time on the step's thread,
paired A/B).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from auxout.errors import (
    BlockStoreError,
    PublicationError,
    StoreCapacityError,
    StoreClosedError,
    StoreUnavailableError,
)
from auxout.metrics import COUNTS, store_backend
from auxout.stores.base import (
    BlockStore,
    StoreObject,
    check_payload,
    drain,
    object_keys,
    read_into,
    trusted_batch,
)
from auxout.stores.rows import StoreRows

INLINE_MAX_RELEASES = 128
_Item = tuple[int, Sequence[StoreObject], tuple[str, ...], tuple[str, ...]]


class BackgroundStore:
    """Wraps any ``BlockStore``; payloads handed to ``put`` must not be mutated afterwards."""

    def __init__(self, inner: BlockStore, max_pending: int = 32, *, inline_below: int = 0) -> None:
        if max_pending <= 0:
            raise ValueError(f"BackgroundStore max_pending must be positive, got {max_pending!r}")
        if inline_below < 0:
            raise ValueError(f"BackgroundStore inline_below must be >= 0 bytes, got {inline_below!r}")
        self.inline_below = inline_below
        self._inline_lock = threading.Lock()
        self.inner = inner
        self.object_nbytes = inner.object_nbytes
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self.dropped_batches = 0
        self.last_drop: BlockStoreError | None = None
        self._lost: deque[str] = deque()  # keys of dropped batches not yet drained
        self._closed = False
        self._close_lock = threading.Lock()
        # (sequence number, keys) of queued batches that write objects, oldest first; batches apply
        # in order, so one is still pending iff its number is above ``_applied_seq``. A put only
        # appends its key list (a prefill batch has hundreds of keys); a read looks through the
        # pending batches, which are few, and only when any is pending.
        self._pending: deque[tuple[int, Sequence[str]]] = deque()
        self._queued_lock = threading.Lock()
        self._last_seq = 0  # batches queued (producer side)
        self._applied_seq = 0  # last batch the writer finished (applied, dropped or skipped)
        self._thread = threading.Thread(target=self._run, name="auxout-store-writer", daemon=True)
        self._thread.start()

    def put(
        self, objects: Sequence[StoreObject], *, retain: Iterable[str] = (), release: Iterable[str] = ()
    ) -> None:
        retain_t, release_t = tuple(retain), tuple(release)
        if not objects and not retain_t and not release_t:
            return
        if not trusted_batch(objects, self.object_nbytes):
            for key, payload in objects:  # a bad payload is the caller's error, not a writer failure
                check_payload(key, payload, self.object_nbytes)
        if self._closed:
            raise StoreClosedError("BackgroundStore")
        self._raise_if_failed()
        if (
            len(objects) * self.object_nbytes < self.inline_below
            and len(release_t) < INLINE_MAX_RELEASES
            and self._queue.unfinished_tasks == 0
        ):
            with self._inline_lock:
                # unfinished_tasks == 0 under the lock: the writer is idle, so nothing queued
                # earlier can be overtaken (the inner store serializes against other producers)
                if self._queue.unfinished_tasks == 0:
                    self._apply(objects, retain_t, release_t)
                    self._raise_if_failed()
                    return
        with self._queued_lock:
            self._last_seq += 1
            seq = self._last_seq
            if objects:
                pending, applied = self._pending, self._applied_seq
                while pending and pending[0][0] <= applied:
                    pending.popleft()
                pending.append((seq, object_keys(objects)))
            self._queue.put((seq, objects, retain_t, release_t))  # under the lock: numbers stay in queue order

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        self._drain_for(keys)
        return self.inner.get_concatenated(keys)

    def read_into(self, keys: Sequence[str], out: memoryview) -> None:
        """Copy payloads into ``out`` (inner ``read_into`` when it has one)."""
        self._drain_for(keys)
        read_into(self.inner, keys, out)

    def read_rows(self, keys: Sequence[str], dtype: np.dtype, shape: tuple[int, ...]) -> StoreRows | None:
        """The inner store's uncopied rows (``ArenaStore.read_rows``), None where it has none."""
        inner = getattr(self.inner, "read_rows", None)
        if inner is None:
            return None
        self._drain_for(keys)
        return inner(keys, dtype, shape)  # type: ignore[no-any-return]

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._drain_for(keys)
        return self.inner.contains(keys)

    def touch(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` that restarts the present keys' TTL where the inner store has one (Redis)."""
        self._drain_for(keys)
        touch = getattr(self.inner, "touch", None)
        return touch(keys) if touch is not None else self.inner.contains(keys)  # type: ignore[no-any-return]

    def drain_lost(self) -> list[str]:
        """Keys of dropped batches and of the inner store's evictions since the last call."""
        out = drain(self._lost)
        inner = getattr(self.inner, "drain_lost", None)
        if inner is not None:
            out.extend(inner())
        return out

    def flush(self) -> None:
        """Wait until every queued write has been applied; raise a writer failure."""
        self._drain()

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.join()
            self._queue.put(None)
            self._thread.join()
            self.inner.close()
        self._raise_if_failed()

    # -- internals ---------------------------------------------------------------------------
    def _drain(self) -> None:
        if self._closed:
            raise StoreClosedError("BackgroundStore")
        self._queue.join()
        self._raise_if_failed()

    def _drain_for(self, keys: Sequence[str]) -> None:
        if self._closed:
            raise StoreClosedError("BackgroundStore")
        applied = self._applied_seq
        if self._pending and applied < self._last_seq:
            with self._queued_lock:
                batches = [batch for seq, batch in self._pending if seq > applied]
            if batches:
                wanted = set(keys)
                if any(not wanted.isdisjoint(batch) for batch in batches):
                    self._queue.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PublicationError(f"route publication failed on the writer thread: {self._error}") from (
                self._error
            )

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                seq, objects, retain, release = item
                try:
                    self._apply(objects, retain, release)
                finally:
                    self._applied_seq = seq
            finally:
                self._queue.task_done()

    def _apply(self, objects: Sequence[StoreObject], retain: tuple[str, ...], release: tuple[str, ...]) -> None:
        """One batch into the inner store; failures are counted or made sticky, never raised here."""
        if self._error is not None:
            return
        try:
            self.inner.put(objects, retain=retain, release=release)
        except (StoreCapacityError, StoreUnavailableError) as exc:
            self.dropped_batches += 1
            self.last_drop = exc
            self._lost.extend(object_keys(objects))
            COUNTS.add("store_errors", 1, store_backend(self.inner), "write")
        except BaseException as exc:  # noqa: BLE001 - recorded and re-raised on the caller's side
            self._error = exc
