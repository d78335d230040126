"""Faults with real servers: a killed or hung server ends operations quickly with a clear
BlockStoreError (never a hang, never partial data) and new operations work after a restart.

Each test starts its own server: killing the shared session server would break other tests.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable

import pytest

from auxout.errors import BlockStoreError, ObjectMissingError
from auxout.stores.mooncake import MooncakeError, MooncakeStore
from auxout.stores.redis import RedisStore, StoreUnavailableError
from auxout.testing.servers import mooncake_master, pause, redis_server, resume

ONB = 6144


def _timed_error(call: Callable[[], object], limit: float) -> BaseException:
    t = time.monotonic()
    try:
        call()
    except BlockStoreError as exc:
        elapsed = time.monotonic() - t
        assert elapsed < limit, f"failure took {elapsed:.1f}s (limit {limit}s)"
        return exc
    raise AssertionError("operation against a dead server did not raise")


def _eventually(call: Callable[[], object], within: float) -> object:
    deadline = time.monotonic() + within
    while True:
        try:
            return call()
        except BlockStoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_redis_killed_then_restarted() -> None:
    with redis_server() as srv:
        store = RedisStore(srv.url, namespace=f"f-{uuid.uuid4().hex[:6]}", object_nbytes=ONB, timeout=2.0)
        store.put([("a", b"\x01" * ONB)])
        srv.kill()
        for call in (lambda: store.get_concatenated(["a"]), lambda: store.put([("b", b"\x02")]),
                     lambda: store.contains(["a"])):
            exc = _timed_error(call, 3.0)
            assert isinstance(exc, StoreUnavailableError)
            assert srv.url in str(exc)
        srv.start()  # same port, empty (no persistence): old objects are gone, new ones work
        with pytest.raises(ObjectMissingError):
            store.get_concatenated(["a"])
        store.put([("c", b"\x03" * 10)])
        assert store.get_concatenated(["c"]) == b"\x03" * 10
        store.close()


def test_redis_hung_server_times_out() -> None:
    with redis_server() as srv:
        # retry_after=0: every operation asks the server (recovers as soon as it answers)
        store = RedisStore(srv.url, namespace="hang", object_nbytes=ONB, timeout=0.5, retry_after=0)
        store.put([("a", b"\x01" * ONB)])
        pause(srv)
        try:
            exc = _timed_error(lambda: store.get_concatenated(["a"]), 3.0)
            assert "timeout 0.5s" in str(exc)
        finally:
            resume(srv)
        assert _eventually(lambda: store.get_concatenated(["a"]), 5.0) == b"\x01" * ONB
        store.close()


def test_redis_hung_server_costs_one_timeout_then_fails_at_once_until_retry_after() -> None:
    """A frozen Redis: the first operation waits out its timeout (once: no retry after a timeout),
    the next ones of any kind fail at once naming the option, and after ``retry_after`` one tries
    again and works once the server answers."""
    with redis_server() as srv:
        store = RedisStore(srv.url, namespace="hang2", object_nbytes=ONB, timeout=0.5, retry_after=1.5)
        store.put([("a", b"\x01" * ONB)])
        pause(srv)
        try:
            first = _timed_error(lambda: store.get_concatenated(["a"]), 3.0)
            assert isinstance(first, StoreUnavailableError) and "timeout 0.5s" in str(first)
            for call in (lambda: store.put([("b", b"\x02")]), lambda: store.contains(["a"]),
                         lambda: store.get_concatenated(["a"])):
                exc = _timed_error(call, 3.0)
                assert isinstance(exc, StoreUnavailableError)
                assert "did not answer within 0.5s" in str(exc) and "retry_after" in str(exc), exc
                assert srv.url in str(exc)
        finally:
            resume(srv)
        # still inside the quiet window: fails without asking the (now answering) server
        with pytest.raises(StoreUnavailableError, match="retry_after"):
            store.contains(["a"])
        time.sleep(1.6)
        assert store.get_concatenated(["a"]) == b"\x01" * ONB  # the first operation after it tries again
        assert store.contains(["a", "zz"]) == [True, False]
        store.close()


@pytest.mark.parametrize("bad", [{"timeout": 0}, {"timeout": "5"}, {"retry_after": -1}, {"retry_after": True}])
def test_redis_timeouts_are_checked(bad: dict[str, object]) -> None:
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=f"RedisStore {name} must be .* got {value!r}"):
        RedisStore("redis://127.0.0.1:1/0", namespace="x", object_nbytes=ONB, **bad)  # type: ignore[arg-type]


def test_redis_unreachable_at_start_fails_fast() -> None:
    with redis_server() as srv:
        url = srv.url
    store = RedisStore(url, namespace="x", object_nbytes=ONB, timeout=1.0)  # lazy: connects on first use
    _timed_error(lambda: store.put([("a", b"1")]), 3.0)
    store.close()


def test_mooncake_master_killed_then_restarted() -> None:
    with mooncake_master() as master:
        store = MooncakeStore(master.master_addr, object_nbytes=ONB, global_segment_size=32 * 2**20,
                              local_buffer_size=32 * 2**20)
        store.put([("a", b"\x01" * ONB)])
        assert store.get_concatenated(["a"]) == b"\x01" * ONB
        master.kill()
        exc = _timed_error(lambda: store.put([("b", b"\x02" * ONB)]), 10.0)
        assert isinstance(exc, MooncakeError) and exc.code is not None and exc.code < 0
        exc = _timed_error(lambda: store.get_concatenated(["a"]), 10.0)
        assert isinstance(exc, MooncakeError), exc  # not "missing": the master is unreachable
        master.start()
        # the client re-registers its segment with the new master after a few heartbeats
        _eventually(lambda: store.put([("c", b"\x03" * ONB)]), 20.0)
        assert store.get_concatenated(["c"]) == b"\x03" * ONB
        with pytest.raises(ObjectMissingError):  # the restarted master forgot the old objects
            store.get_concatenated(["a"])
        store.close()


def test_mooncake_hung_master_bounded_wait() -> None:
    """A SIGSTOPped master answers nothing; the native call would wait 30-60 s, the caller 1 s."""
    with mooncake_master() as master:
        store = MooncakeStore(master.master_addr, object_nbytes=ONB, global_segment_size=32 * 2**20,
                              local_buffer_size=32 * 2**20, op_timeout=1.0)
        store.put([("a", b"\x01" * ONB)])
        pause(master)
        try:
            exc = _timed_error(lambda: store.get_concatenated(["a"]), 3.0)
            assert isinstance(exc, MooncakeError) and exc.code is None and "within 1.0s" in str(exc)
            exc = _timed_error(lambda: store.put([("b", b"\x02")]), 0.5)  # fails at once: call still stuck
            assert "still unanswered" in str(exc)
        finally:
            resume(master)
        assert _eventually(lambda: store.get_concatenated(["a"]), 20.0) == b"\x01" * ONB
        store.close()


def test_mooncake_unreachable_master_fails_fast() -> None:
    with mooncake_master() as master:
        addr = master.master_addr
    t = time.monotonic()
    with pytest.raises(MooncakeError, match="not reachable"):
        MooncakeStore(addr, object_nbytes=ONB, connect_timeout=1.0)
    assert time.monotonic() - t < 3.0


def test_mooncake_objects_vanish_with_their_writer(mooncake_srv) -> None:  # type: ignore[no-untyped-def]
    """Documented Mooncake behaviour: a reader gets a clean miss once the writer client is closed."""
    w = MooncakeStore(mooncake_srv.master_addr, object_nbytes=ONB, global_segment_size=32 * 2**20,
                      local_buffer_size=32 * 2**20)
    r = MooncakeStore.from_address(f"mooncake://{mooncake_srv.master_addr}", object_nbytes=ONB)
    key = f"vanish/{uuid.uuid4().hex}"
    w.put([(key, b"\x05" * ONB)])
    assert r.get_concatenated([key]) == b"\x05" * ONB
    w.close()
    exc = _eventually(lambda: _expect_missing(r, key), 15.0)
    assert exc == [key]
    r.close()


def _expect_missing(store: MooncakeStore, key: str) -> list[str]:
    try:
        store.get_concatenated([key])
    except ObjectMissingError as exc:
        return exc.keys
    raise BlockStoreError("still readable")


def _gone_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_servers_die_with_a_sigkilled_test_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import signal
    import subprocess
    import sys

    code = (
        "import time\n"
        "from auxout.testing.servers import mooncake_master, redis_server\n"
        "with redis_server() as r, mooncake_master() as m:\n"
        "    print(r.proc.pid, m.proc.pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the killed child cannot remove its server dirs
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, env=env)
    assert child.stdout is not None
    pids = [int(p) for p in child.stdout.readline().split()]
    assert len(pids) == 2 and not any(_gone_or_zombie(p) for p in pids)
    os.kill(child.pid, signal.SIGKILL)  # no finally runs in the child
    child.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not all(_gone_or_zombie(p) for p in pids):
        assert time.monotonic() < deadline, f"servers {pids} outlived the process that started them"
        time.sleep(0.1)


def test_make_store_passes_every_redis_option_it_accepts() -> None:
    """Every option ``STORE_OPTIONS`` lists for Redis reaches the store (an accepted option that
    ``make_store`` dropped stopped the engine at startup)."""
    from auxout.stores import STORE_OPTIONS, make_store

    values = {"url": "redis://127.0.0.1:1/0", "namespace": "opts", "ttl": 30.0, "timeout": 0.5, "retry_after": 2.5}
    required, optional = STORE_OPTIONS["redis"]
    assert set(values) == set(required) | set(optional)
    store = make_store("redis", max_bytes=ONB, object_nbytes=ONB, background=False, **values)
    assert isinstance(store, RedisStore)  # (connects lazily: no server needed)
    assert (store.ttl, store.timeout, store.retry_after, store.namespace) == (30.0, 0.5, 2.5, "opts")
    store.close()


@pytest.mark.parametrize(
    ("name", "options", "needle"),
    [
        ("redis", {"url": "redis://h", "namespace": "n", "ttl": float("inf")}, "'ttl' must be positive finite seconds"),
        ("redis", {"url": "http://h:6379", "namespace": "n"}, "'url' must be a redis://, rediss:// or unix:// URL"),
        ("redis", {"url": 6379, "namespace": "n"}, "'url' must be a redis://"),
        ("redis", {"url": "redis://h", "namespace": "a b"}, "'namespace' must be a non-empty string without spaces"),
        ("redis", {"url": "redis://h", "namespace": ""}, "'namespace' must be a non-empty string"),
        ("mooncake", {"master_addr": "nohost"}, "'master_addr' must be a 'host:port' string"),
        ("mooncake", {"master_addr": 50051}, "'master_addr' must be a 'host:port' string"),
        ("shm", {"read_from": "shm://seg"}, "'read_from' must be a list of store addresses"),
        ("shm", {"shm_name": 3}, "'shm_name' must be a non-empty string"),
    ],
)
def test_store_options_are_checked_before_any_engine_starts(name: str, options: dict, needle: str) -> None:
    """Each used to pass ``engine_kwargs`` and fail in the engine's worker (an ``OverflowError``
    for an infinite TTL; a ``read_from`` string read as one address per character)."""
    from auxout.stores import check_store_options
    from auxout.vllm import engine_kwargs

    with pytest.raises(ValueError, match=re.escape(needle)):
        check_store_options(name, options)
    with pytest.raises(ValueError, match=re.escape(needle)):
        engine_kwargs(store=name, store_options=options)
    good = {"redis": {"url": "unix:///tmp/r.sock", "namespace": "n"}, "mooncake": {"master_addr": "127.0.0.1:50051"},
            "shm": {"read_from": ["shm://seg"], "shm_name": "seg2"}}[name]  # fmt: skip
    check_store_options(name, good)
