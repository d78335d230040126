"""Route store in Redis or Valkey (same protocol), for trainers on other hosts.

Objects are raw payload bytes (no header, nothing pickled) under ``<namespace>/<key>``.
``SET NX`` makes the first write win; an optional TTL (``PX``) bounds retention, since an
external store ignores retain/release (releasing a request never deletes shared objects).
Writes are pipelined and reads use ``MGET``, both in bounded batches. Every socket operation
has a timeout and a connection failure surfaces as ``StoreUnavailableError`` naming the
server, so an engine never hangs on a dead store. A server that stops answering (frozen, or a
network that drops packets) costs one timeout: for ``retry_after`` seconds after it, every
operation fails at once instead of each waiting out its own timeout (the engine's callers then
recompute, as for any unavailable store), and the first operation after that tries again. The
TTL starts at the first write: putting an existing key again neither overwrites it nor extends
its lifetime. A keys-only manifest restarts the TTL of every object it names when it is returned
(``touch``), so size the TTL to cover the trainer's fetch after the response.

Credentials (a password, an ACL user) never leave the client: ``url`` and ``address`` are
written without them, every message shows the URL without them, and a reader opening a
manifest's address takes them from its caller (:mod:`auxout.credentials`); a server that
refuses the credentials (or needs some) fails with ``StoreAuthError`` saying where they go.
Valkey speaks the same protocol (not in Debian 12 apt, so tests use redis-server).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from auxout.credentials import PASSWORD_ENV, REDIS_URL_ENV, STORE_URL_ENV, redact, resolve_credentials
from auxout.errors import (
    BlockStoreError,
    CorruptObjectError,
    ObjectMissingError,
    StoreAuthError,
    StoreClosedError,
    StoreUnavailableError,
)
from auxout.stores.base import StoreObject, check_payload, check_seconds

_BATCH_BYTES = 32 * 2**20
_BATCH_KEYS = 4096




def _url(scheme: str, netloc: str, path: str, query: str) -> str:
    """A URL from its parts (``urlunsplit`` drops the ``//`` of a ``unix://`` URL's empty host)."""
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")


def _chunks(n: int, per: int) -> Iterator[slice]:
    for i in range(0, n, per):
        yield slice(i, min(n, i + per))


class RedisStore:
    """``BlockStore`` over redis-py (hiredis parser when installed)."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        object_nbytes: int,
        ttl: float | None = None,
        timeout: float = 5.0,
        retry_after: float = 10.0,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        """``timeout``: seconds any one socket operation may wait; ``retry_after``: seconds after a
        timeout during which operations fail at once (0: each waits out its own timeout);
        ``username``/``password``: the server's credentials, else those in ``url``, else from the
        environment (:func:`auxout.credentials.resolve_credentials`)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if not isinstance(object_nbytes, int) or object_nbytes <= 0:
            raise ValueError(f"RedisStore object_nbytes must be a positive int, got {object_nbytes!r}")
        if not namespace or any(c.isspace() for c in namespace):
            raise ValueError(f"RedisStore namespace must be non-empty without spaces, got {namespace!r}")
        if ttl is not None and ttl <= 0:
            raise ValueError(f"RedisStore ttl must be positive seconds or None, got {ttl!r}")
        check_seconds("RedisStore timeout", timeout)
        check_seconds("RedisStore retry_after", retry_after, positive=False)
        url, username, password = resolve_credentials(url, username=username, password=password)
        self.url = url  # (without credentials: shown in messages and in the address)
        self.authenticated = password is not None
        self.namespace = namespace
        self.object_nbytes = object_nbytes
        self.ttl = ttl
        self.timeout = timeout
        self.retry_after = retry_after
        self._unanswered_at: float | None = None  # when an operation last timed out (monotonic)
        self._prefix = f"{namespace}/"
        self._px = None if ttl is None else max(1, int(ttl * 1000))
        self._errors: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError)
        self._timeout_error: type[BaseException] = redis.TimeoutError
        self._redis_error: type[BaseException] = redis.RedisError
        self._auth_error: type[BaseException] = redis.AuthenticationError
        # one quick reconnect absorbs a stale pooled socket after a server restart; no long backoff,
        # and no retry after a timeout (a server that did not answer in time would cost two)
        self._client: Any = redis.Redis.from_url(
            url,
            username=username,
            password=password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            health_check_interval=0,
        )
        self._closed = False
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        """``redis://host:port/db?namespace=<ns>``: enough for ``auxout.fetch`` to reopen it (never
        with the credentials: the reader brings its own)."""
        parts = urlsplit(self.url)
        query = parse_qs(parts.query)
        query["namespace"] = [self.namespace]
        return _url(parts.scheme, parts.netloc, parts.path, urlencode(query, doseq=True))

    @classmethod
    def from_address(
        cls, address: str, *, object_nbytes: int, timeout: float = 5.0, username: str | None = None,
        password: str | None = None,
    ) -> RedisStore:
        """A client for ``address`` (as ``address`` writes it), with the caller's credentials."""
        parts = urlsplit(address)
        query = parse_qs(parts.query)
        ns = query.pop("namespace", [None])[0]
        if not ns:
            raise ValueError(f"redis store address {redact(address)!r} has no namespace= query parameter")
        url = _url(parts.scheme, parts.netloc, parts.path, urlencode(query, doseq=True))
        return cls(url, namespace=ns, object_nbytes=object_nbytes, timeout=timeout, username=username, password=password)

    # -- protocol ------------------------------------------------------------------------------
    def put(
        self, objects: Sequence[StoreObject], *, retain: Iterable[str] = (), release: Iterable[str] = ()
    ) -> None:
        """Write new objects with ``SET NX`` (first write wins); retain/release are ignored."""
        self._check_open()
        unique: dict[str, memoryview] = {}
        for key, payload in objects:
            if key not in unique:
                unique[key] = check_payload(key, payload, self.object_nbytes)
        if not unique:
            return
        items = list(unique.items())
        per = max(1, min(_BATCH_KEYS, _BATCH_BYTES // self.object_nbytes))
        p, px = self._prefix, self._px
        with self._guard("put"):
            for sl in _chunks(len(items), per):
                pipe = self._client.pipeline(transaction=False)
                for key, view in items[sl]:
                    pipe.set(p + key, view, nx=True, px=px)
                pipe.execute()

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        """``MGET`` in batches; any absent key raises naming all absent keys; lengths checked."""
        self._check_open()
        if not keys:
            return b""
        p = self._prefix
        names = [p + k for k in keys]
        per = max(1, min(_BATCH_KEYS, _BATCH_BYTES // self.object_nbytes))
        values: list[bytes | None] = []
        with self._guard("get"):
            for sl in _chunks(len(names), per):
                values.extend(self._client.mget(names[sl]))
        if None in values:
            raise ObjectMissingError(
                [k for k, v in zip(keys, values) if v is None],
                f"absent from redis namespace {self.namespace!r} (never written, expired or evicted)",
            )
        onb = self.object_nbytes
        lens = list(map(len, values))  # type: ignore[arg-type]
        if min(lens) == 0 or max(lens) > onb:
            bad = [k for k, n in zip(keys, lens) if not 0 < n <= onb]
            raise CorruptObjectError(
                f"redis object(s) with impossible length (expected 1..{onb} bytes): {bad[:4]}"
                + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "")
            )
        out = b"".join(values)  # type: ignore[arg-type]
        return out

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        if not keys:
            return []
        p = self._prefix
        out: list[bool] = []
        with self._guard("contains"):
            for sl in _chunks(len(keys), _BATCH_KEYS):
                pipe = self._client.pipeline(transaction=False)
                for k in keys[sl]:
                    pipe.exists(p + k)
                out.extend(bool(x) for x in pipe.execute())
        return out

    def touch(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` that also restarts each present key's TTL (``PEXPIRE``), in one round trip.

        A manifest names blocks a hot prefix wrote long ago; without this they could expire
        right after the manifest is returned, before the trainer fetches them."""
        if self._px is None:
            return self.contains(keys)
        self._check_open()
        p, px = self._prefix, self._px
        out: list[bool] = []
        with self._guard("touch"):
            for sl in _chunks(len(keys), _BATCH_KEYS):
                pipe = self._client.pipeline(transaction=False)
                for k in keys[sl]:
                    pipe.pexpire(p + k, px)
                out.extend(bool(x) for x in pipe.execute())
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"RedisStore {self.url}")

    def _guard(self, op: str) -> _ErrorMap:
        return _ErrorMap(self, op)


class _ErrorMap:
    """Turns redis-py errors into auxout errors with the server and operation named."""

    def __init__(self, store: RedisStore, op: str) -> None:
        self.store, self.op = store, op

    def __enter__(self) -> None:
        s = self.store
        since = s._unanswered_at
        if since is not None:
            ago = time.monotonic() - since
            if ago < s.retry_after:
                raise StoreUnavailableError(
                    f"redis store {s.url} did not answer within {s.timeout}s {ago:.1f}s ago: {self.op} fails at "
                    f"once until {s.retry_after}s have passed (store option retry_after), then tries again"
                )
            s._unanswered_at = None
        return None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or isinstance(exc, BlockStoreError):
            return
        s = self.store
        if isinstance(exc, s._auth_error):
            raise StoreAuthError(
                f"redis store {s.url} refused {self.op}: {exc} "
                + ("(the password given was not accepted)" if s.authenticated else "(no password was given)")
                + f". Pass the credentials to auxout.fetch(manifest, password=..., username=...), or set {PASSWORD_ENV}, "
                f"or {STORE_URL_ENV} / {REDIS_URL_ENV} to a URL of this server with them"
            ) from exc
        if isinstance(exc, s._timeout_error) and s.retry_after > 0:
            s._unanswered_at = time.monotonic()
        if isinstance(exc, s._errors):
            raise StoreUnavailableError(
                f"redis store {s.url} unavailable during {self.op} (timeout {s.timeout}s): {exc}"
            ) from exc
        if isinstance(exc, s._redis_error):
            raise BlockStoreError(f"redis store {s.url} failed during {self.op}: {exc}") from exc
