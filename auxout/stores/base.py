"""The one small protocol every route store implements.

Objects are immutable byte strings of at most ``object_nbytes`` (one hash block of routes,
or a shorter boundary piece); the first write of a key wins. ``retain``/``release`` carry
per-request reference counts for stores that evict locally; external stores ignore them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from auxout.errors import CorruptObjectError, ObjectMissingError

Buffer = bytes | bytearray | memoryview
StoreObject = tuple[str, Buffer]


class BlockObjects(list[StoreObject]):
    """Objects whose payloads are flat, contiguous byte memoryviews of exactly ``nbytes`` each.

    The worker builds these from its own arrays, so stores check the batch once instead of
    every payload (a prefill step publishes hundreds of blocks). Any other reader sees a list.
    """

    def __init__(self, items: Iterable[StoreObject] = (), *, nbytes: int) -> None:
        super().__init__(items)
        self.nbytes = nbytes


def drain(items: deque[str]) -> list[str]:
    """Everything in ``items``, removed in order (safe while another thread appends)."""
    out: list[str] = []
    pop = items.popleft
    try:
        while True:
            out.append(pop())
    except IndexError:
        return out


def trusted_batch(objects: Sequence[StoreObject], object_nbytes: int) -> bool:
    """Whether ``objects`` is a ``BlockObjects`` batch whose payloads fit ``object_nbytes``."""
    return isinstance(objects, BlockObjects) and 0 < objects.nbytes <= object_nbytes


@runtime_checkable
class BlockStore(Protocol):
    """Minimal store contract used by the worker connector and by ``auxout.fetch``."""

    object_nbytes: int

    def put(
        self,
        objects: Sequence[StoreObject],
        *,
        retain: Iterable[str] = (),
        release: Iterable[str] = (),
    ) -> None:
        """Apply retains, then releases, then write ``objects`` (first write wins)."""
        ...

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        """Payloads of ``keys`` in order, concatenated; raises ``ObjectMissingError`` on any miss."""
        ...

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is readable now."""
        ...

    def close(self) -> None:
        """Release resources; idempotent. Later calls raise ``StoreClosedError``."""
        ...


def check_payload(key: str, payload: Buffer, object_nbytes: int) -> memoryview:
    """Validate one object payload; returns it as a flat byte view."""
    if type(payload) is memoryview and payload.format == "B" and payload.ndim == 1 and payload.c_contiguous:
        view = payload  # already a flat byte view (the worker's blocks): no new object per payload
    else:
        view = memoryview(payload).cast("B")
    if not 0 < view.nbytes <= object_nbytes:
        raise ValueError(f"object {key!r} has {view.nbytes} bytes; expected 1..{object_nbytes}")
    return view


def read_into(store: BlockStore, keys: Sequence[str], out: memoryview) -> None:
    """Copy the payloads of ``keys`` into ``out``: the store's own ``read_into`` (one copy) when it
    has one, else ``get_concatenated`` plus a length check (a short or long payload never passes)."""
    reader = getattr(store, "read_into", None)
    if reader is not None:
        reader(keys, out)
        return
    blob = store.get_concatenated(keys)
    if len(blob) != out.nbytes:
        raise CorruptObjectError(f"{len(keys)} objects hold {len(blob)} bytes; the reader expects {out.nbytes}")
    out[:] = blob


def raise_missing(keys: Sequence[str], present: Sequence[bool], detail: str = "") -> None:
    """Raise ``ObjectMissingError`` naming every absent key (no-op if all present)."""
    missing = [k for k, ok in zip(keys, present) if not ok]
    if missing:
        raise ObjectMissingError(missing, detail)
