"""Route store in a Mooncake distributed store (``mooncake.store.MooncakeDistributedStore``).

Mooncake objects are immutable: a second put of a key keeps the old value, which is exactly
first-write-wins. Objects live in the memory segments the clients mount, and the master places
each one in any mounted segment, not only its writer's: an object vanishes when the client whose
segment holds it exits (a prefill engine's route may sit in a decode engine's segment). Every
client that mounts a segment must outlive the fetches of the routes it may hold (deployments
mount long-lived segments, e.g. a standalone Mooncake store service); a lost object is a clear
``ObjectMissingError``, never zeros. ``retain``/``release`` are ignored: retention belongs to the
deployment.

The native client reports failures as negative codes and reports a missing object and a
lost master alike as an empty value; an empty value is therefore checked with
``batch_is_exist`` (0 = missing -> ``ObjectMissingError``, negative -> ``MooncakeError``).
``setup`` retries for ~90 s when the master is down, so the constructor first checks that the
master's port answers within ``connect_timeout``. The native calls have no timeout argument and
wait 30-60 s for a hung master, so each call runs on one worker thread and the caller waits at
most ``op_timeout`` (then ``MooncakeError`` with ``code=None``; until the stuck call returns, later calls
fail at once).

The master takes no credentials: an address with user info (``user:secret@host:port``) is
refused, so none can reach a manifest, a log line or an error message.

``mooncake_master`` for tests and benchmarks: ``auxout.testing.servers.mooncake_master()``.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from auxout.errors import (
    BlockStoreError,
    CorruptObjectError,
    ObjectMissingError,
    StoreCapacityError,
    StoreClosedError,
    StoreUnavailableError,
)
from auxout.stores.base import StoreObject, check_payload

# codes from mooncake-store's ErrorCode (types.h), for messages only
_CODES = {
    -200: "NO_AVAILABLE_HANDLE (segments full)",
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -900: "RPC_FAIL (master unreachable)",
}
_NO_SPACE = -200
_RPC_FAIL = -900
MAX_BATCH_BYTES = 64 * 2**20
MASTER_ADDR_CREDENTIALS = (
    "the Mooncake master address carries user info ('...@host:port'): a Mooncake master takes no "
    "credentials, and the address goes into every keys-only manifest; give 'host:port'"
)
T = TypeVar("T")


class MooncakeError(BlockStoreError):
    """A failed Mooncake call; ``code`` is the native error code, None when the wait timed out."""

    def __init__(self, op: str, code: int | None, detail: str = "") -> None:
        self.code = code
        what = "timed out" if code is None else f"{code} {_CODES.get(code, '')}".rstrip()
        super().__init__(f"Mooncake {op} failed: {what}{f'; {detail}' if detail else ''}")


class MooncakeCapacityError(MooncakeError, StoreCapacityError):
    """Mooncake's segments have no room for the batch (code -200)."""


class MooncakeUnavailableError(MooncakeError, StoreUnavailableError):
    """The master did not answer (RPC failure or timeout): transient."""


def _error(op: str, code: int | None, detail: str = "") -> MooncakeError:
    """The error class that says what a caller can do about ``code``."""
    if code is None or code == _RPC_FAIL:
        return MooncakeUnavailableError(op, code, detail)
    if code == _NO_SPACE:
        return MooncakeCapacityError(op, code, detail)
    return MooncakeError(op, code, detail)


def _chunks(n: int, per: int) -> Iterator[slice]:
    for i in range(0, n, per):
        yield slice(i, min(n, i + per))


def _check_reachable(addr: str, timeout: float) -> None:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return
    except (OSError, ValueError) as exc:
        raise _error("connect", -900, f"master {addr} not reachable within {timeout}s: {exc}") from exc


class MooncakeStore:
    """``BlockStore`` over one Mooncake client (tcp transport, P2P handshake by default)."""

    def __init__(
        self,
        master_addr: str,
        *,
        object_nbytes: int,
        global_segment_size: int = 512 * 2**20,
        local_buffer_size: int = 128 * 2**20,
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        max_batch_bytes: int = MAX_BATCH_BYTES,
        connect_timeout: float = 5.0,
        op_timeout: float | None = 10.0,
        native: Any = None,
    ) -> None:
        if not isinstance(object_nbytes, int) or object_nbytes <= 0:
            raise ValueError(f"MooncakeStore object_nbytes must be a positive int, got {object_nbytes!r}")
        if "@" in master_addr:  # (the address is shown in messages and manifests: never with a secret)
            raise ValueError(MASTER_ADDR_CREDENTIALS)
        max_batch_bytes = min(max_batch_bytes, local_buffer_size) if local_buffer_size else max_batch_bytes
        if not 0 < object_nbytes <= max_batch_bytes:
            raise ValueError(f"MooncakeStore needs 0 < object_nbytes={object_nbytes} <= max_batch_bytes={max_batch_bytes}")
        self.master_addr = master_addr
        self.object_nbytes = object_nbytes
        self._per_batch = max_batch_bytes // object_nbytes
        self._lock = threading.Lock()
        if native is None:
            _check_reachable(master_addr, connect_timeout)
            from mooncake.store import MooncakeDistributedStore

            native = MooncakeDistributedStore()
            rc = native.setup(
                local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol, "", master_addr
            )
            if rc != 0:
                try:
                    native.close()
                finally:
                    raise _error("setup", rc, f"master {master_addr}")
        self._native: Any = native
        self.op_timeout = op_timeout
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="auxout-mooncake") if op_timeout else None
        self._stuck: Future[Any] | None = None

    @property
    def address(self) -> str:
        return f"mooncake://{self.master_addr}"

    @classmethod
    def from_address(cls, address: str, *, object_nbytes: int, **kw: Any) -> MooncakeStore:
        """A reading client (contributes no memory) for ``mooncake://host:port``."""
        if not address.startswith("mooncake://"):
            raise ValueError(f"not a mooncake store address: {address!r}")
        kw.setdefault("global_segment_size", 0)
        return cls(address.removeprefix("mooncake://").rstrip("/"), object_nbytes=object_nbytes, **kw)

    # -- protocol ------------------------------------------------------------------------------
    def put(
        self, objects: Sequence[StoreObject], *, retain: Iterable[str] = (), release: Iterable[str] = ()
    ) -> None:
        """``put_batch`` in bounded batches; existing keys keep their first value."""
        native = self._live()
        unique: dict[str, memoryview] = {}
        for key, payload in objects:
            if key not in unique:
                unique[key] = check_payload(key, payload, self.object_nbytes)
        keys = list(unique)
        values = list(unique.values())
        for sl in _chunks(len(keys), self._per_batch):
            rc = self._call("publication", native.put_batch, keys[sl], values[sl])
            if rc != 0:
                raise _error("publication", rc, f"{sl.stop - sl.start} objects, first {keys[sl.start]!r}")

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        """``get_batch`` in bounded batches; missing keys raise naming all of them."""
        native = self._live()
        if not keys:
            return b""
        # get_batch returns wrong bytes for a key repeated within one call (0.3.13): ask once per key
        order = list(keys)
        keys = list(dict.fromkeys(order))
        values: list[bytes] = []
        for sl in _chunks(len(keys), self._per_batch):
            values.extend(self._call("get", native.get_batch, keys[sl]))
        if not all(values):
            self._resolve_empty(native, keys, values, [i for i, v in enumerate(values) if not v])
        onb = self.object_nbytes
        if max(map(len, values)) > onb:
            bad = [k for k, v in zip(keys, values) if len(v) > onb]
            raise CorruptObjectError(f"Mooncake object(s) longer than {onb} bytes: {bad[:4]}")
        if len(keys) == len(order):
            return b"".join(values)
        by_key = dict(zip(keys, values))
        return b"".join([by_key[k] for k in order])

    def contains(self, keys: Sequence[str]) -> list[bool]:
        native = self._live()
        if not keys:
            return []
        out: list[bool] = []
        for sl in _chunks(len(keys), self._per_batch):
            codes = self._call("exists", native.batch_is_exist, list(keys[sl]))
            neg = [c for c in codes if c < 0]
            if neg:
                raise _error("exists", int(neg[0]))
            out.extend(c == 1 for c in codes)
        return out

    def close(self) -> None:
        with self._lock:
            native, self._native = self._native, None
        if native is not None:
            if self._pool is not None:
                self._pool.shutdown(wait=self._stuck is None or self._stuck.done())
            if self._stuck is None or self._stuck.done():
                native.close()  # a stuck native call still uses the client: leave it to the process exit

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------
    def _call(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        """Run one native call, waiting at most ``op_timeout`` (the native RPC timeouts are 30-60 s).

        A call that times out keeps running on the worker thread; until it returns, later calls
        fail at once instead of queueing behind it.
        """
        if self._pool is None:
            return fn(*args)
        stuck = self._stuck
        if stuck is not None:
            if not stuck.done():
                raise _error(op, None, f"an earlier call to master {self.master_addr} is still unanswered")
            self._stuck = None
        fut = self._pool.submit(fn, *args)
        try:
            return fut.result(timeout=self.op_timeout)
        except FutureTimeout:
            self._stuck = fut
            raise _error(
                op, None, f"no answer from master {self.master_addr} within {self.op_timeout}s"
            ) from None

    def _live(self) -> Any:
        native = self._native
        if native is None:
            raise StoreClosedError(f"MooncakeStore {self.master_addr}")
        return native

    def _resolve_empty(self, native: Any, keys: list[str], values: list[bytes], empty: list[int]) -> None:
        """Empty reads are missing keys or failures; a key written meanwhile is read again."""
        for _ in range(3):
            codes = self._call("get", native.batch_is_exist, [keys[i] for i in empty])
            neg = [int(c) for c in codes if c < 0]
            if neg:
                raise _error("get", neg[0], f"{len(empty)} object(s) unreadable, first {keys[empty[0]]!r}")
            missing = [keys[i] for i, c in zip(empty, codes) if c == 0]
            if missing:
                raise ObjectMissingError(missing, f"absent from Mooncake master {self.master_addr}")
            again = self._call("get", native.get_batch, [keys[i] for i in empty])
            for i, v in zip(empty, again):
                values[i] = v
            empty = [i for i in empty if not values[i]]
            if not empty:
                return
        # exists, yet reads keep returning nothing: a transfer failure, never partial data
        raise _error("get", -1, f"objects exist but could not be read, first {keys[empty[0]]!r}")
