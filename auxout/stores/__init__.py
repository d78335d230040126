"""Route stores behind the ``BlockStore`` protocol."""

from __future__ import annotations

from typing import Any

from auxout.credentials import redact
from auxout.stores.arena import ArenaStore
from auxout.stores.background import BackgroundStore
from auxout.stores.base import BlockStore, check_seconds
from auxout.stores.open import open_store
from auxout.stores.policy import EvictionPolicy, LRUPolicy

__all__ = [
    "ArenaStore",
    "BackgroundStore",
    "BlockStore",
    "EvictionPolicy",
    "LRUPolicy",
    "MooncakeStore",
    "RedisStore",
    "SharedMemoryStore",
    "STORE_OPTIONS",
    "check_store_options",
    "make_store",
    "open_store",
    "sweep_stale",
]

# Redis and Mooncake clients are optional dependencies: import them on first use.
_LAZY = {
    "SharedMemoryStore": "auxout.stores.shm",
    "sweep_stale": "auxout.stores.shm",
    "RedisStore": "auxout.stores.redis",
    "MooncakeStore": "auxout.stores.mooncake",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'auxout.stores' has no attribute {name!r}")


INLINE_BELOW_BYTES = 512 * 1024
"""Batches below this size go straight into an in-memory store when its writer thread is idle."""


STORE_OPTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "arena": ((), ("policy",)),
    "shm": ((), ("shm_name", "read_from")),
    "redis": (("url", "namespace"), ("ttl", "timeout", "retry_after")),
    "mooncake": (("master_addr",), ()),
}
"""Per backend, the ``make_store`` keyword options it requires and the ones it accepts besides."""


_SECONDS = {"ttl": True, "timeout": True, "retry_after": False}  # option -> must be > 0 (else >= 0)


def check_store_options(name: str, options: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming a missing or unknown option before any store (or engine) starts."""
    if name not in STORE_OPTIONS:
        raise ValueError(f"unknown route store backend {name!r}; known: {sorted(STORE_OPTIONS)}")
    required, optional = STORE_OPTIONS[name]
    missing = [key for key in required if key not in options]
    if missing:
        raise ValueError(f"store {name!r} needs store option(s) {missing} (required: {list(required)})")
    unknown = sorted(set(options) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for store {name!r}; known: {sorted(required + optional)}")
    for key, positive in _SECONDS.items():  # (checked again by the store; here before any engine starts)
        if key in options and not (key == "ttl" and options[key] is None):
            check_seconds(f"store {name!r} option {key!r}", options[key], positive=positive)
    for key, value in options.items():
        check = _CHECKS.get(key)
        if check is not None:
            problem = check(value)
            if problem:  # (redacted: a URL's or an address's credentials never reach a message)
                raise ValueError(f"store {name!r} option {key!r} {problem}, got {redact(value)}")


def _url(value: object) -> str:
    from urllib.parse import urlsplit

    if not isinstance(value, str) or urlsplit(value).scheme not in ("redis", "rediss", "unix"):
        return "must be a redis://, rediss:// or unix:// URL string"
    return ""


def _name(value: object) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        return "must be a non-empty string without spaces"
    return ""


def _host_port(value: object) -> str:
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if "@" in host:  # (user info: Mooncake takes none, and the address is shown everywhere)
        return "must be a 'host:port' string without user info (a Mooncake master takes no credentials)"
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "must be a 'host:port' string"
    return ""


def _addresses(value: object) -> str:
    if not isinstance(value, (list, tuple)) or not all(isinstance(a, str) and "://" in a for a in value):
        return "must be a list of store addresses (e.g. ['shm://<segment>'])"
    return ""


# (the stores check again; here, a wrong value fails before any engine starts, not in its worker)
_CHECKS = {"url": _url, "namespace": _name, "shm_name": _name, "master_addr": _host_port, "read_from": _addresses}


def make_store(name: str, *, max_bytes: int, object_nbytes: int, background: bool = True, **kw: Any) -> BlockStore:
    """Build a store by backend name: ``arena`` (in-process, default), ``shm``, ``redis``, ``mooncake``."""
    inner: BlockStore
    if name == "arena":
        inner = ArenaStore(max_bytes, object_nbytes, policy=kw.pop("policy", None))
    elif name == "shm":
        from auxout.stores.shm import SharedMemoryStore

        inner = SharedMemoryStore(max_bytes, object_nbytes, name=kw.pop("shm_name", None))
        read_from = kw.pop("read_from", None)
        if read_from:  # other engines' segments on this host (P/D): read through to them
            from auxout.stores.read_through import ReadThroughStore

            inner = ReadThroughStore(inner, [str(a) for a in read_from])
    elif name == "redis":
        from auxout.stores.redis import RedisStore

        inner = RedisStore(
            kw.pop("url"),
            namespace=kw.pop("namespace"),
            object_nbytes=object_nbytes,
            ttl=kw.pop("ttl", None),
            timeout=kw.pop("timeout", 5.0),
            retry_after=kw.pop("retry_after", 10.0),
        )
    elif name == "mooncake":
        from auxout.stores.mooncake import MooncakeStore

        inner = MooncakeStore(kw.pop("master_addr"), object_nbytes=object_nbytes)
    else:
        raise ValueError(f"unknown route store backend {name!r}; known: 'arena', 'shm', 'redis', 'mooncake'")
    if kw:
        raise TypeError(f"unexpected options for store {name!r}: {sorted(kw)}")
    if not background:
        return inner
    # in-memory stores: small batches on an idle writer are cheaper applied in place (see BackgroundStore)
    inline = INLINE_BELOW_BYTES if name in ("arena", "shm") else 0
    return BackgroundStore(inner, max_pending=64, inline_below=inline)
