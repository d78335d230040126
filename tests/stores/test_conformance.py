"""Every backend passes the same conformance suite (real redis-server and mooncake_master)."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence

import pytest

from auxout.errors import StoreClosedError
from auxout.stores.arena import ArenaStore
from auxout.stores.background import BackgroundStore
from auxout.stores.base import BlockStore, StoreObject, check_payload, raise_missing
from auxout.stores.mooncake import MooncakeStore
from auxout.stores.redis import RedisStore
from auxout.stores.shm import SharedMemoryStore
from auxout.testing.servers import MooncakeMaster, RedisServer
from auxout.testing.store_conformance import StoreConformance, conformance_checks, run_conformance

MakeStore = Callable[[int, int], BlockStore]


@pytest.fixture
def stores() -> Iterator[list[BlockStore]]:
    made: list[BlockStore] = []
    yield made
    for s in made:
        with contextlib.suppress(Exception):  # an asynchronous store may re-raise its writer failure
            s.close()


class TestArena(StoreConformance):
    @pytest.fixture
    def make_store(self, stores: list[BlockStore]) -> MakeStore:
        def make(object_nbytes: int, capacity: int) -> BlockStore:
            stores.append(ArenaStore(object_nbytes * capacity, object_nbytes))
            return stores[-1]

        return make


class TestBackgroundArena(StoreConformance):
    @pytest.fixture
    def make_store(self, stores: list[BlockStore]) -> MakeStore:
        def make(object_nbytes: int, capacity: int) -> BlockStore:
            stores.append(BackgroundStore(ArenaStore(object_nbytes * capacity, object_nbytes), max_pending=8))
            return stores[-1]

        return make


class TestSharedMemory(StoreConformance):
    @pytest.fixture
    def make_store(self, stores: list[BlockStore]) -> MakeStore:
        def make(object_nbytes: int, capacity: int) -> BlockStore:
            stores.append(SharedMemoryStore(object_nbytes * capacity, object_nbytes))
            return stores[-1]

        return make


class TestRedis(StoreConformance):
    @pytest.fixture
    def make_store(self, stores: list[BlockStore], redis_srv: RedisServer) -> MakeStore:
        def make(object_nbytes: int, capacity: int) -> BlockStore:
            ns = f"conf-{uuid.uuid4().hex[:8]}"
            stores.append(RedisStore(redis_srv.url, namespace=ns, object_nbytes=object_nbytes, timeout=5))
            return stores[-1]

        return make


class TestMooncake(StoreConformance):
    @pytest.fixture
    def make_store(self, stores: list[BlockStore], mooncake_srv: MooncakeMaster) -> MakeStore:
        def make(object_nbytes: int, capacity: int) -> BlockStore:
            seg = max(64 * 2**20, 2 * object_nbytes * capacity)
            stores.append(
                MooncakeStore(mooncake_srv.master_addr, object_nbytes=object_nbytes,
                              global_segment_size=seg, local_buffer_size=seg)
            )
            return stores[-1]

        return make


class DictStore:
    """A third party's store, written only against the protocol (shows the suite is reusable)."""

    def __init__(self, object_nbytes: int) -> None:
        self.object_nbytes = object_nbytes
        self._d: dict[str, bytes] | None = {}
        self._lock = threading.Lock()

    def _live(self) -> dict[str, bytes]:
        if self._d is None:
            raise StoreClosedError("DictStore")
        return self._d

    def put(self, objects: Sequence[StoreObject], *, retain: Iterable[str] = (), release: Iterable[str] = ()) -> None:
        with self._lock:
            d = self._live()
            views = [(k, check_payload(k, p, self.object_nbytes)) for k, p in objects]
            for k, v in views:
                d.setdefault(k, v.tobytes())

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        with self._lock:
            d = self._live()
            raise_missing(keys, [k in d for k in keys])
            return b"".join(d[k] for k in keys)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            d = self._live()
            return [k in d for k in keys]

    def close(self) -> None:
        self._d = None


class TestThirdPartyStore(StoreConformance):
    @pytest.fixture
    def make_store(self) -> MakeStore:
        return lambda object_nbytes, capacity: DictStore(object_nbytes)


def test_run_conformance_without_pytest() -> None:
    assert run_conformance(lambda onb, cap: DictStore(onb)) == conformance_checks()


def test_run_conformance_reports_a_broken_store() -> None:
    class ZeroFilling(DictStore):
        def get_concatenated(self, keys: Sequence[str]) -> bytes:
            d = self._live()
            return b"".join(d.get(k, b"\0" * self.object_nbytes) for k in keys)

    with pytest.raises(AssertionError, match="test_missing_keys_fail_closed"):
        run_conformance(lambda onb, cap: ZeroFilling(onb))
