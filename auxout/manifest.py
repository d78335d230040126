"""Keys-only route output: a small JSON manifest instead of the route array itself.

An engine response for a long trajectory would otherwise carry megabytes of routes
(32k tokens x 48 layers x top-8 = 12 MiB). A ``RouteManifest`` names the ordered store keys
that hold rows ``[token_start, token_start + num_rows)`` plus the shape/dtype to rebuild
them; the trainer calls ``fetch(manifest)`` and gets the exact array.

Object layout the manifest relies on: every object except the last holds ``block_size``
rows; the last holds ``last_object_rows`` (1..block_size). The first object may start
before ``token_start`` (a shared full block), hence ``row_offset``. Rows past the last full
hashed block ("boundary"/tail rows) are published by ``publish_manifest`` as their own objects
under fresh random keys, and **before** the manifest is returned: a manifest never names an
object that is not readable yet. Payloads are raw C-order bytes; nothing is ever unpickled.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from auxout.credentials import (
    PASSWORD_ENV,
    REDIS_URL_ENV,
    STORE_URL_ENV,
    USERNAME_ENV,
    has_credentials,
    redact,
)
from auxout.errors import (
    CorruptObjectError,
    PublicationError,
    StoreAuthError,
    StoreClosedError,
    StoreUnavailableError,
)
from auxout.keys import KEY_PREFIX
from auxout.profile import dtype_name, parse_dtype_name, split_rows
from auxout.stores.base import BlockStore
from auxout.stores.open import open_store

MANIFEST_VERSION = 1
_SCHEMES = ("shm://", "redis://", "rediss://", "unix://", "mooncake://", "local://")


@dataclass(frozen=True)
class RouteManifest:
    """Where the routes of one request live and how to rebuild them; JSON round-trips exactly."""

    keys: tuple[str, ...]
    token_start: int
    num_rows: int
    row_offset: int
    last_object_rows: int
    block_size: int
    shape_per_token: tuple[int, ...]
    dtype: str
    store: str
    version: int = field(default=MANIFEST_VERSION)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "shape_per_token", tuple(int(x) for x in self.shape_per_token))
        self.validate()

    # -- derived sizes ---------------------------------------------------------------------------
    @property
    def row_dtype(self) -> np.dtype:
        """The stored item dtype: ids, or (id, float32 weight) slots (``dtype`` ends in ``+w<f4``)."""
        return parse_dtype_name(self.dtype) if isinstance(self.dtype, str) else np.dtype(self.dtype)

    @property
    def has_weights(self) -> bool:
        return self.row_dtype.names is not None

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.shape_per_token) * self.row_dtype.itemsize

    @property
    def object_nbytes(self) -> int:
        return self.block_size * self.row_nbytes

    @property
    def stored_rows(self) -> int:
        """Rows held by the named objects together."""
        return 0 if not self.keys else (len(self.keys) - 1) * self.block_size + self.last_object_rows

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_rows, *self.shape_per_token)

    def validate(self) -> None:
        """Reject manifests that cannot describe a readable array (raises ``ValueError``)."""

        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid route manifest: {msg}")

        if self.version != MANIFEST_VERSION:
            raise bad(f"unsupported version {self.version!r} (this auxout reads {MANIFEST_VERSION})")
        for name in ("token_start", "num_rows", "row_offset", "last_object_rows", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise bad(f"{name}={v!r} must be a non-negative int")
        if self.block_size <= 0:
            raise bad("block_size must be positive")
        if not self.shape_per_token or any(d <= 0 for d in self.shape_per_token):
            raise bad(f"shape_per_token={self.shape_per_token!r} must be non-empty and positive")
        try:
            dt = self.row_dtype
        except TypeError as exc:
            raise bad(f"dtype={self.dtype!r} is not a numpy dtype") from exc
        if dt.names is not None:
            dt = dt["id"]
        if dt.kind not in "iub" or dt.byteorder == ">":
            raise bad(f"dtype={self.dtype!r} must be a little-endian/native integer type")
        if any(not isinstance(k, str) or not k for k in self.keys):
            raise bad("keys must be non-empty strings")
        if not isinstance(self.store, str) or not self.store.startswith(_SCHEMES):
            raise bad(f"store={redact(self.store)!r} must be an address starting with one of {_SCHEMES}")
        if has_credentials(self.store):
            raise bad(
                f"store={redact(self.store)!r} carries credentials: a manifest names its store without them "
                "(the reader brings its own: fetch(manifest, password=...))"
            )
        if self.num_rows == 0:
            if self.keys or self.row_offset or self.last_object_rows:
                raise bad("an empty manifest has no keys, row_offset or last_object_rows")
            return
        if not self.keys:
            raise bad(f"num_rows={self.num_rows} but no keys")
        if not 1 <= self.last_object_rows <= self.block_size:
            raise bad(f"last_object_rows={self.last_object_rows} must be in 1..block_size={self.block_size}")
        first_rows = self.block_size if len(self.keys) > 1 else self.last_object_rows
        if self.row_offset >= first_rows:
            raise bad(f"row_offset={self.row_offset} must be smaller than the first object's {first_rows} rows")
        end = self.row_offset + self.num_rows
        if end > self.stored_rows:
            raise bad(f"rows end at {end} but the {len(self.keys)} objects hold {self.stored_rows} rows")
        if end <= self.stored_rows - self.last_object_rows:
            raise bad("the last object lies entirely after the requested rows")

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["keys"] = list(self.keys)
        d["shape_per_token"] = list(self.shape_per_token)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RouteManifest:
        if not isinstance(d, dict):
            raise ValueError(f"invalid route manifest: expected a JSON object, got {type(d).__name__}")
        names = {f for f in cls.__dataclass_fields__}
        unknown, missing = set(d) - names, names - set(d) - {"version"}
        if unknown or missing:
            raise ValueError(f"invalid route manifest: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
        if not isinstance(d["keys"], list) or not isinstance(d["shape_per_token"], list):
            raise ValueError("invalid route manifest: keys and shape_per_token must be lists")
        return cls(**{**d, "keys": tuple(d["keys"]), "shape_per_token": tuple(d["shape_per_token"])})

    @classmethod
    def from_json(cls, text: str | bytes) -> RouteManifest:
        return cls.from_dict(json.loads(text))


def boundary_keys(namespace: str, n: int) -> list[str]:
    """Fresh random keys for boundary objects (never shared, so first-write-wins cannot bite)."""
    return [f"{KEY_PREFIX}/{namespace}/boundary/{uuid.uuid4().hex}" for _ in range(n)]


def publish_boundary(store: BlockStore, rows: np.ndarray, *, block_size: int, namespace: str) -> list[str]:
    """Write ``rows`` as objects of at most ``block_size`` rows under fresh keys; return the keys.

    Returns only after every object is readable (``contains`` drains an asynchronous store and
    confirms), so the keys can go into a manifest right away.
    """
    if rows.shape[0] == 0:
        return []
    data = np.ascontiguousarray(rows)
    per = data[0].nbytes * block_size
    if per > store.object_nbytes:
        raise ValueError(f"{block_size} rows of {data[0].nbytes} bytes exceed the store's {store.object_nbytes}-byte objects")
    flat = data.reshape(-1).view(np.uint8).data
    keys = boundary_keys(namespace, -(-rows.shape[0] // block_size))
    store.put([(k, flat[i * per : (i + 1) * per]) for i, k in enumerate(keys)])
    present = store.contains(keys)
    if not all(present):
        raise PublicationError(f"boundary objects not readable after publication: {[k for k, p in zip(keys, present) if not p][:4]}")
    return keys


def publish_manifest(
    store: BlockStore,
    *,
    address: str,
    block_keys: Sequence[str],
    tail_rows: np.ndarray,
    token_start: int,
    token_end: int,
    block_size: int,
    namespace: str,
) -> RouteManifest:
    """Publish the boundary rows and return the manifest of rows ``[token_start, token_end)``.

    ``block_keys[i]`` holds rows ``[i*block_size, (i+1)*block_size)`` of the sequence (already in
    ``store``); ``tail_rows`` are the rows from ``len(block_keys)*block_size`` on, not stored yet
    (shape ``(n, *shape_per_token)``). Rows covered by a full block are never republished.
    """
    if not 0 <= token_start <= token_end:
        raise ValueError(f"bad row range [{token_start}, {token_end})")
    full_end = len(block_keys) * block_size
    if token_end > full_end + tail_rows.shape[0]:
        raise ValueError(f"rows up to {token_end} requested but only {full_end + tail_rows.shape[0]} exist")
    shape, dtype = tuple(tail_rows.shape[1:]), dtype_name(tail_rows.dtype)
    num_rows = token_end - token_start
    if num_rows == 0:
        return RouteManifest((), token_start, 0, 0, 0, block_size, shape, dtype, address)
    keys: list[str] = []
    row_offset = last = 0
    if token_start < full_end:
        keys += block_keys[token_start // block_size : -(-min(token_end, full_end) // block_size)]
        row_offset = token_start % block_size
        last = block_size
    if token_end > full_end:
        t0 = max(token_start, full_end) - full_end
        tail = tail_rows[t0 : token_end - full_end]
        keys += publish_boundary(store, tail, block_size=block_size, namespace=namespace)
        if token_start >= full_end:
            row_offset = 0
        last = tail.shape[0] - (-(-tail.shape[0] // block_size) - 1) * block_size
    return RouteManifest(tuple(keys), token_start, num_rows, row_offset, last, block_size, shape, dtype, address)


_readers: dict[tuple[Any, ...], BlockStore] = {}
_readers_lock = threading.Lock()


def _reader(address: str, object_nbytes: int, username: str | None, password: str | None) -> tuple[tuple[Any, ...], BlockStore]:
    """This process's reading client for ``address``, opened on first use and kept.

    Opening costs more than a read: a Mooncake client sets up a transfer engine and registers
    its buffer (~1 s), a Redis client connects (and authenticates) per call. The key holds the
    credentials given and those the environment offers (hashed), so a change to either opens a
    new client; and the process id, so a forked child opens its own."""
    secrets = (username, password, *(os.environ.get(v) for v in (STORE_URL_ENV, REDIS_URL_ENV, USERNAME_ENV, PASSWORD_ENV)))
    key = (os.getpid(), address, object_nbytes, hashlib.sha256(repr(secrets).encode()).hexdigest())
    with _readers_lock:
        store = _readers.get(key)
        if store is None:
            store = _readers[key] = open_store(address, object_nbytes=object_nbytes, username=username, password=password)
    return key, store


def _drop_reader(key: tuple[Any, ...], store: BlockStore) -> None:
    with _readers_lock:
        if _readers.get(key) is store:
            del _readers[key]
    store.close()


def close_readers() -> None:
    """Close the reading clients :func:`fetch` opened and kept (also done at interpreter exit)."""
    with _readers_lock:
        stores = [s for k, s in _readers.items() if k[0] == os.getpid()]
        _readers.clear()
    for store in stores:
        store.close()


atexit.register(close_readers)


def fetch(
    manifest: RouteManifest,
    store: BlockStore | None = None,
    *,
    weights: bool = False,
    username: str | None = None,
    password: str | None = None,
) -> Any:
    """The exact route array ``(num_rows, *shape_per_token)`` a manifest names (read-only view).

    Missing (evicted, expired) objects raise ``ObjectMissingError`` naming them; a payload of the
    wrong length raises ``CorruptObjectError``. Opens a client when ``store`` is None and keeps it
    for this process's later fetches from the same store (:func:`close_readers` closes them; one
    that failed to reach or authenticate is closed at once),
    with ``username``/``password`` when the store needs credentials (else from the environment:
    ``AUXOUT_STORE_URL`` or ``REDIS_URL`` naming the same server, or ``AUXOUT_STORE_PASSWORD``;
    a store that refuses raises ``StoreAuthError`` saying so). The expert ids always;
    ``weights=True`` returns ``(ids, routing weights)`` (float32, same shape), for manifests of
    an engine that captures them.
    """
    if weights and not manifest.has_weights:
        raise ValueError("this manifest's routes hold no routing weights: the engine did not capture them")
    ids, w = split_rows(fetch_rows(manifest, store, username=username, password=password))
    return (ids, w) if weights else ids


def fetch_rows(
    manifest: RouteManifest,
    store: BlockStore | None = None,
    *,
    username: str | None = None,
    password: str | None = None,
) -> np.ndarray:
    """The stored rows a manifest names, as stored (structured (id, weight) slots with weights)."""
    m = manifest
    if m.num_rows == 0:
        return np.empty(m.shape, dtype=m.row_dtype)
    if store is not None:
        raw = store.get_concatenated(list(m.keys))
    else:
        key, st = _reader(m.store, m.object_nbytes, username, password)
        try:
            raw = st.get_concatenated(list(m.keys))
        except (StoreAuthError, StoreClosedError, StoreUnavailableError):
            _drop_reader(key, st)  # (the next fetch opens a fresh client)
            raise
    expected = m.stored_rows * m.row_nbytes
    if len(raw) != expected:
        raise CorruptObjectError(
            f"route objects hold {len(raw)} bytes; the manifest expects {expected} "
            f"({len(m.keys)} objects, {m.stored_rows} rows of {m.row_nbytes} bytes)"
        )
    arr = np.frombuffer(raw, dtype=m.row_dtype).reshape(-1, *m.shape_per_token)
    return arr[m.row_offset : m.row_offset + m.num_rows]
