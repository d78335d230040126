"""Open a store by the address a manifest names (``redis://``, ``mooncake://``, ``shm://``): the
reading side of :func:`auxout.stores.make_store`, for fetches and P/D peers."""

from __future__ import annotations

from auxout.credentials import redact
from auxout.stores.base import BlockStore


def open_store(
    address: str, *, object_nbytes: int, username: str | None = None, password: str | None = None
) -> BlockStore:
    """Open a reading client for a manifest's ``store`` address.

    ``username``/``password``: the store's credentials (Redis), else found as
    :func:`auxout.credentials.resolve_credentials` says (environment); a manifest never holds them.
    """
    if address.startswith("shm://"):
        from auxout.stores.shm import SharedMemoryStore

        store: BlockStore = SharedMemoryStore.open(address.removeprefix("shm://"))
    elif address.startswith(("redis://", "rediss://", "unix://")):
        from auxout.stores.redis import RedisStore

        store = RedisStore.from_address(address, object_nbytes=object_nbytes, username=username, password=password)
    elif address.startswith("mooncake://"):
        from auxout.stores.mooncake import MooncakeStore

        if username is not None or password is not None:
            raise ValueError("a Mooncake master takes no credentials: fetch its manifests without username/password")
        store = MooncakeStore.from_address(address, object_nbytes=object_nbytes)
    elif address.startswith("local://"):
        raise ValueError("the manifest names an in-process store (local://): pass it as fetch(manifest, store=...)")
    else:
        raise ValueError(f"unknown route store address {redact(address)!r}")
    if store.object_nbytes < object_nbytes:
        store.close()
        raise ValueError(f"store {redact(address)} holds {store.object_nbytes}-byte objects; manifest needs {object_nbytes}")
    return store
