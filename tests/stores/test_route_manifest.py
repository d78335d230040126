"""Keys-only output: manifest JSON round trip, fetch == inline array, misses and corruption."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from auxout.errors import CorruptObjectError, ObjectMissingError
from auxout.manifest import RouteManifest, fetch, publish_manifest
from auxout.stores.arena import ArenaStore
from auxout.stores.base import BlockStore
from auxout.stores.mooncake import MooncakeStore
from auxout.stores.redis import RedisStore
from auxout.stores.shm import SharedMemoryStore
from auxout.testing.servers import MooncakeMaster, RedisServer

BS, LAYERS, TOPK = 16, 4, 8
ONB = BS * LAYERS * TOPK


def _sequence(num_tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 64, size=(num_tokens, LAYERS, TOPK), dtype=np.uint8)


def _store_full_blocks(store: BlockStore, routes: np.ndarray) -> list[str]:
    """What the worker does: every complete hash block becomes one object under its block key."""
    n_full = routes.shape[0] // BS
    keys = [f"auxout/r3/test/g0/{uuid.uuid4().hex}" for _ in range(n_full)]
    store.put([(k, routes[i * BS : (i + 1) * BS].tobytes()) for i, k in enumerate(keys)])
    return keys


CASES = [  # (num_tokens in the sequence, token_start, token_end)
    (100, 0, 99), (100, 5, 99), (100, 37, 64), (100, 64, 99), (100, 97, 99), (100, 20, 20),
    (96, 0, 95), (96, 16, 96), (33, 0, 32), (7, 0, 6), (7, 3, 6), (160, 150, 159), (48, 47, 48),
]


@pytest.mark.parametrize(("num_tokens", "start", "end"), CASES)
def test_manifest_fetch_equals_inline_array(num_tokens: int, start: int, end: int) -> None:
    routes = _sequence(num_tokens, seed=num_tokens + start)
    store = ArenaStore(ONB * 64, ONB)
    block_keys = _store_full_blocks(store, routes)
    tail = routes[len(block_keys) * BS :]
    m = publish_manifest(store, address="shm://auxout-1-test", block_keys=block_keys, tail_rows=tail,
                         token_start=start, token_end=end, block_size=BS, namespace="test")
    assert m.shape == (end - start, LAYERS, TOPK)
    again = RouteManifest.from_json(m.to_json())
    assert again == m
    got = fetch(again, store)
    np.testing.assert_array_equal(got, routes[start:end])
    assert got.dtype == np.uint8
    # a full block is never republished: every key of a fully covered block is the block's key
    covered = set(block_keys[start // BS : end // BS])
    assert covered <= set(m.keys)
    store.close()


def test_manifest_rejects_invalid_fields() -> None:
    good = RouteManifest(("a", "b"), 3, 20, 3, 7, 16, (4, 8), "|u1", "shm://auxout-1-x")
    assert good.stored_rows == 23
    for bad in (
        dict(row_offset=16), dict(num_rows=21), dict(last_object_rows=0), dict(last_object_rows=17),
        dict(dtype="float32"), dict(dtype="object"), dict(shape_per_token=(4, 0)), dict(store="http://x"),
        dict(keys=()), dict(version=2), dict(num_rows=-1), dict(num_rows=12),  # 12 rows end before key b
    ):
        with pytest.raises(ValueError, match="invalid route manifest"):
            RouteManifest(**{**good.to_dict(), **bad})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown fields"):
        RouteManifest.from_json(good.to_json()[:-1] + ',"pickle":"x"}')
    with pytest.raises(ValueError):
        RouteManifest.from_json("[1,2]")


def test_fetch_missing_keys_are_named() -> None:
    routes = _sequence(64)
    store = ArenaStore(ONB * 3, ONB)  # room for 3 objects: the 4th block evicts the first
    keys = [f"auxout/r3/test/g0/{uuid.uuid4().hex}" for _ in range(4)]
    for i, k in enumerate(keys):
        store.put([(k, routes[i * BS : (i + 1) * BS].tobytes())])
    m = publish_manifest(store, address="shm://auxout-1-x", block_keys=keys, tail_rows=routes[64:],
                         token_start=0, token_end=64, block_size=BS, namespace="t")
    with pytest.raises(ObjectMissingError) as ei:
        fetch(m, store)
    assert ei.value.keys == [keys[0]]
    assert keys[0] in str(ei.value)


def test_fetch_rejects_truncated_payload() -> None:
    routes = _sequence(40)
    store = ArenaStore(ONB * 8, ONB)
    keys = _store_full_blocks(store, routes)
    short = f"auxout/r3/test/g0/{uuid.uuid4().hex}"
    store.put([(short, routes[32:39].tobytes())])  # 7 rows where the manifest says 8
    m = RouteManifest((*keys, short), 0, 40, 0, 8, BS, (LAYERS, TOPK), "|u1", "shm://auxout-1-x")
    with pytest.raises(CorruptObjectError, match="expects"):
        fetch(m, store)


def test_redis_manifest_fetch_opens_store_from_address(redis_srv: RedisServer) -> None:
    routes = _sequence(100, seed=9)
    with RedisStore(redis_srv.url, namespace=f"m-{uuid.uuid4().hex[:6]}", object_nbytes=ONB) as store:
        keys = _store_full_blocks(store, routes)
        m = publish_manifest(store, address=store.address, block_keys=keys, tail_rows=routes[96:],
                             token_start=10, token_end=99, block_size=BS, namespace="t")
        np.testing.assert_array_equal(fetch(RouteManifest.from_json(m.to_json())), routes[10:99])


def test_fetch_keeps_one_reading_client_per_store(redis_srv: RedisServer) -> None:
    """fetch(manifest) without a store reuses the client it opened: one connection for many
    fetches (the server counts them), a new one after close_readers()."""
    import redis

    from auxout.manifest import close_readers

    routes = _sequence(70, seed=11)
    probe = redis.Redis.from_url(redis_srv.url)
    with RedisStore(redis_srv.url, namespace=f"r-{uuid.uuid4().hex[:6]}", object_nbytes=ONB) as store:
        m = publish_manifest(store, address=store.address, block_keys=_store_full_blocks(store, routes),
                             tail_rows=routes[64:], token_start=5, token_end=69, block_size=BS, namespace="t")
        close_readers()

        def opened() -> int:
            before = probe.info("stats")["total_connections_received"]
            for _ in range(5):
                np.testing.assert_array_equal(fetch(m), routes[5:69])
            return probe.info("stats")["total_connections_received"] - before

        assert opened() == 1
        assert opened() == 0
        close_readers()
        assert opened() == 1
    probe.close()


def test_redis_ttl_expiry_names_keys(redis_srv: RedisServer) -> None:
    routes = _sequence(40, seed=3)
    with RedisStore(redis_srv.url, namespace=f"ttl-{uuid.uuid4().hex[:6]}", object_nbytes=ONB, ttl=0.3) as store:
        keys = _store_full_blocks(store, routes)
        m = publish_manifest(store, address=store.address, block_keys=keys, tail_rows=routes[32:],
                             token_start=0, token_end=39, block_size=BS, namespace="t")
        np.testing.assert_array_equal(fetch(m), routes[:39])
        time.sleep(0.6)
        with pytest.raises(ObjectMissingError) as ei:
            fetch(m)
        assert sorted(ei.value.keys) == sorted(m.keys)


def test_redis_corrupt_payload_rejected(redis_srv: RedisServer) -> None:
    import redis

    ns = f"bad-{uuid.uuid4().hex[:6]}"
    with RedisStore(redis_srv.url, namespace=ns, object_nbytes=ONB) as store:
        keys = _store_full_blocks(store, _sequence(32))
        raw = redis.Redis.from_url(redis_srv.url)
        raw.set(f"{ns}/{keys[1]}", b"\x01" * (ONB + 5))  # foreign writer: oversized value
        with pytest.raises(CorruptObjectError, match="impossible length"):
            store.get_concatenated(keys)
        raw.set(f"{ns}/{keys[1]}", b"\x01" * (ONB - 5))  # truncated full block
        m = RouteManifest(tuple(keys), 0, 32, 0, 16, BS, (LAYERS, TOPK), "|u1", store.address)
        with pytest.raises(CorruptObjectError):
            fetch(m, store)
        raw.close()


def test_mooncake_manifest_fetch_from_second_client(mooncake_srv: MooncakeMaster) -> None:
    routes = _sequence(80, seed=4)
    with MooncakeStore(mooncake_srv.master_addr, object_nbytes=ONB, global_segment_size=32 * 2**20,
                       local_buffer_size=32 * 2**20) as store:
        keys = _store_full_blocks(store, routes)
        m = publish_manifest(store, address=store.address, block_keys=keys, tail_rows=routes[80:],
                             token_start=3, token_end=79, block_size=BS, namespace="t")
        # store=None: fetch opens its own reading client from the address (contributes no memory)
        np.testing.assert_array_equal(fetch(RouteManifest.from_json(m.to_json())), routes[3:79])


def test_shm_manifest_fetch_by_address() -> None:
    routes = _sequence(50, seed=5)
    with SharedMemoryStore(ONB * 16, ONB) as store:
        keys = _store_full_blocks(store, routes)
        m = publish_manifest(store, address=store.address, block_keys=keys, tail_rows=routes[48:],
                             token_start=1, token_end=49, block_size=BS, namespace="t")
        np.testing.assert_array_equal(fetch(m), routes[1:49])


def test_boundary_objects_are_readable_before_the_manifest_returns() -> None:
    """With an asynchronous writer the manifest still only names objects already in the store."""
    from auxout.stores.background import BackgroundStore

    routes = _sequence(90, seed=6)
    inner = ArenaStore(ONB * 64, ONB)
    store = BackgroundStore(inner, max_pending=4)
    keys = _store_full_blocks(store, routes)
    m = publish_manifest(store, address="shm://auxout-1-x", block_keys=keys, tail_rows=routes[80:],
                         token_start=0, token_end=89, block_size=BS, namespace="t")
    assert all(inner.contains(list(m.keys)))  # the unwrapped store already holds every named object
    boundary = [k for k in m.keys if "/boundary/" in k]
    assert len(boundary) == 1 and boundary[0].startswith("auxout/r3/t/boundary/")
    np.testing.assert_array_equal(fetch(m, inner), routes[:89])
    store.close()


def test_failed_boundary_publication_returns_no_manifest() -> None:
    from auxout.errors import StoreCapacityError

    routes = _sequence(40, seed=7)
    store = ArenaStore(ONB * 2, ONB)
    keys = _store_full_blocks(store, routes)
    store.put([], retain=keys)  # both slots pinned: the boundary object cannot be stored
    with pytest.raises(StoreCapacityError):
        publish_manifest(store, address="shm://auxout-1-x", block_keys=keys, tail_rows=routes[32:],
                         token_start=0, token_end=39, block_size=BS, namespace="t")
