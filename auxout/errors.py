"""Every error auxout raises, in one place, so integrators can catch by kind.

Store errors fail closed: a caller gets an exception naming the keys, never partial or
zero-filled routes. Invariant errors mean the engine integration broke a contract of the
connectors; they are raised explicitly (not with ``assert``) so ``python -O`` keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence


class AuxOutError(Exception):
    """Base class of every auxout error."""


class RequestValidationError(AuxOutError, ValueError):
    """A request carries a bad routed-experts option; rejected at admission (HTTP 400)."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"invalid {field}={value!r}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, object, str]]:
        return (type(self), (self.field, self.value, self.reason))


class InvariantError(AuxOutError, RuntimeError):
    """The engine integration violated a connector contract (a bug, not bad input)."""


class PoolExhaustedError(InvariantError):
    """The staging pool has no free slot: it was sized for fewer requests or batches than ran."""


class BlockStoreError(AuxOutError, RuntimeError):
    """Base class of store failures."""


class StoreClosedError(BlockStoreError):
    """An operation reached a store after ``close()``."""

    def __init__(self, what: str = "block store") -> None:
        self.what = what
        super().__init__(f"{what} is closed")

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (self.what,))


class StoreCapacityError(BlockStoreError):
    """A batch cannot fit even after evicting every eligible object; nothing was written."""


class ObjectMissingError(BlockStoreError):
    """Objects a read needs are absent (never written, evicted or expired)."""

    def __init__(self, keys: Sequence[str], detail: str = "") -> None:
        self.keys = list(keys)
        shown = ", ".join(self.keys[:4]) + (f" (+{len(self.keys) - 4} more)" if len(self.keys) > 4 else "")
        msg = f"route object(s) missing from the store: {shown}"
        self.detail = detail
        super().__init__(msg + (f"; {detail}" if detail else ""))

    def __reduce__(self) -> tuple[type, tuple[list[str], str]]:
        return (type(self), (self.keys, self.detail))


class StoreUnavailableError(BlockStoreError):
    """The store server could not be reached or timed out; nothing was returned or confirmed.

    Transient: a publication that fails this way is dropped (its keys then read as missing)
    and the store is used again once the server is back.
    """


class StoreAuthError(StoreUnavailableError):
    """The store refused the client's credentials (none given, or wrong ones). To an engine it is
    an unavailable store (publications dropped, reads recompute); to ``fetch``, a clear error
    saying where credentials go. The message never shows them."""


class CorruptObjectError(BlockStoreError):
    """A stored payload has the wrong length: truncated or foreign data is never returned."""


class PublicationError(BlockStoreError):
    """The background writer failed; every later operation fails closed with this error."""


class RoutesUnavailableError(BlockStoreError):
    """One request's routes could not be assembled; that request fails, the engine keeps serving."""

    def __init__(self, request_id: str, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"routes for request {request_id!r} are unavailable: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.request_id, self.reason))


class ManifestUnavailableError(BlockStoreError):
    """A keys-only request's manifest could not be published (store full or down).

    Carries the request's exact rows, so the engine returns them inline instead: the client
    gets its routes either way, and ``reason`` says why they came inline.
    """

    def __init__(self, request_id: str, reason: str, rows: object) -> None:
        self.request_id = request_id
        self.reason = reason
        self.rows = rows
        super().__init__(f"keys-only output for request {request_id!r} fell back to inline rows: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str, object]]:
        return (type(self), (self.request_id, self.reason, self.rows))
