"""The one small protocol every route store implements.

Objects are immutable byte strings of at most ``object_nbytes`` (one hash block of routes,
or a shorter boundary piece); the first write of a key wins. ``retain``/``release`` carry
per-request reference counts for stores that evict locally; external stores ignore them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, overload, runtime_checkable

import numpy as np

from auxout.errors import CorruptObjectError, ObjectMissingError

Buffer = bytes | bytearray | memoryview
StoreObject = tuple[str, Buffer]


class BlockObjects(Sequence[StoreObject]):
    """Objects the worker publishes: keys plus 2-D uint8 arrays holding one payload per row.

    The worker builds these from its own arrays (no per-block object), so stores check the
    batch once instead of every payload, and a slot store copies each array into its slots in
    one numpy call (a prefill step publishes hundreds of blocks). Any other reader iterates
    ``(key, flat byte view)`` pairs, made on demand.
    """

    __slots__ = ("keys", "chunks", "nbytes")

    def __init__(self, *, nbytes: int) -> None:
        self.keys: list[str] = []
        self.chunks: list[np.ndarray] = []  # C-contiguous uint8 [n_i, nbytes]; sum(n_i) == len(keys)
        self.nbytes = nbytes

    def add(self, keys: Sequence[str], blocks: np.ndarray) -> None:
        """Append ``keys`` whose payloads are the rows of ``blocks`` (not copied: never mutate it)."""
        if blocks.dtype != np.uint8 or blocks.shape != (len(keys), self.nbytes) or not blocks.flags.c_contiguous:
            raise ValueError(
                f"BlockObjects needs C-contiguous uint8 [{len(keys)}, {self.nbytes}] blocks, "
                f"got {blocks.dtype}{list(blocks.shape)}"
            )
        if len(keys):
            self.keys.extend(keys)
            self.chunks.append(blocks)

    def extend(self, other: BlockObjects) -> None:
        if other.nbytes != self.nbytes:
            raise ValueError(f"cannot join BlockObjects of {other.nbytes} and {self.nbytes} bytes per object")
        self.keys.extend(other.keys)
        self.chunks.extend(other.chunks)

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[StoreObject]:
        return zip(self.keys, self.payloads())

    @overload
    def __getitem__(self, i: int) -> StoreObject: ...
    @overload
    def __getitem__(self, i: slice) -> list[StoreObject]: ...
    def __getitem__(self, i: int | slice) -> StoreObject | list[StoreObject]:
        return list(self)[i]

    def payloads(self) -> Iterator[memoryview]:
        """Flat byte views of the payloads, in key order."""
        n = self.nbytes
        for arr in self.chunks:
            flat = memoryview(arr.reshape(-1).data)  # type: ignore[arg-type]
            yield from map(flat.__getitem__, map(slice, range(0, len(arr) * n, n), range(n, len(arr) * n + n, n)))


def drain(items: deque[str]) -> list[str]:
    """Everything in ``items``, removed in order (safe while another thread appends)."""
    if not items:  # the common case: no exception raised and caught
        return []
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


def object_keys(objects: Sequence[StoreObject]) -> list[str]:
    """The keys of a batch (a ``BlockObjects`` has them as a list already)."""
    return objects.keys if isinstance(objects, BlockObjects) else [k for k, _ in objects]


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


def check_seconds(what: str, value: object, *, positive: bool = True) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``value`` is a number of seconds (> 0, or >= 0)."""
    if (
        isinstance(value, bool) or not isinstance(value, (int, float))
        or not (value > 0 if positive else value >= 0) or value == float("inf")
    ):  # fmt: skip
        raise ValueError(f"{what} must be {'positive' if positive else 'non-negative'} finite seconds, got {value!r}")


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
