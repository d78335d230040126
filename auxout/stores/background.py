"""Moves store mutations off the engine's step path onto one writer thread.

Back-pressure: at most ``max_pending`` batches wait; a producer blocks beyond that. Reads
drain the queue first, so they observe every earlier write (read-your-writes). A writer
failure is sticky: later batches are skipped (fail closed) and every later call raises. The one
exception is ``StoreCapacityError``: the inner store rejected that batch whole and stayed
consistent, so the batch is counted in ``dropped_batches`` and later reads of its keys fail
closed with ``ObjectMissingError``, while everything else keeps working.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Sequence

from auxout.errors import PublicationError, StoreCapacityError, StoreClosedError
from auxout.stores.base import BlockStore, StoreObject

_Item = tuple[Sequence[StoreObject], tuple[str, ...], tuple[str, ...]]


class BackgroundStore:
    """Wraps any ``BlockStore``; payloads handed to ``put`` must not be mutated afterwards."""

    def __init__(self, inner: BlockStore, max_pending: int = 32) -> None:
        if max_pending <= 0:
            raise ValueError(f"BackgroundStore max_pending must be positive, got {max_pending!r}")
        self.inner = inner
        self.object_nbytes = inner.object_nbytes
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self.dropped_batches = 0
        self.last_drop: StoreCapacityError | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="auxout-store-writer", daemon=True)
        self._thread.start()

    def put(
        self, objects: Sequence[StoreObject], *, retain: Iterable[str] = (), release: Iterable[str] = ()
    ) -> None:
        retain_t, release_t = tuple(retain), tuple(release)
        if not objects and not retain_t and not release_t:
            return
        if self._closed:
            raise StoreClosedError("BackgroundStore")
        self._raise_if_failed()
        self._queue.put((objects, retain_t, release_t))

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        self._drain()
        return self.inner.get_concatenated(keys)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._drain()
        return self.inner.contains(keys)

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
                if self._error is None:
                    objects, retain, release = item
                    self.inner.put(objects, retain=retain, release=release)
            except StoreCapacityError as exc:
                self.dropped_batches += 1
                self.last_drop = exc
            except BaseException as exc:  # noqa: BLE001 - recorded and re-raised on the caller's side
                self._error = exc
            finally:
                self._queue.task_done()
