"""SharedMemoryStore across processes: reader process, concurrent writer process, SIGKILL sweep."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from auxout.errors import (
    BlockStoreError,
    InvariantError,
    ObjectMissingError,
    StoreCapacityError,
    StoreClosedError,
)
from auxout.stores.shm import SHM_DIR, SharedMemoryStore, sweep_stale

ONB = 16 * 48 * 8


def _payload(key: str, n: int = ONB) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return (seed * (n // 8 + 1))[:n]


def _child(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())


def test_segment_is_owner_only_and_unlinked_on_close() -> None:
    s = SharedMemoryStore(ONB * 4, ONB)
    path = os.path.join(SHM_DIR, s.name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert s.name.startswith(f"auxout-{os.getpid()}-")
    s.close()
    assert not os.path.exists(path)
    with pytest.raises(BlockStoreError, match="does not exist"):
        SharedMemoryStore.open(s.name)


def test_second_process_reads_routes() -> None:
    with SharedMemoryStore(ONB * 64, ONB) as s:
        keys = [f"k{i}" for i in range(40)]
        s.put([(k, _payload(k)) for k in keys[:-1]] + [(keys[-1], b"\x07" * 100)])
        child = _child(f"""
            import hashlib, sys
            from auxout.stores.shm import SharedMemoryStore
            from auxout.errors import ObjectMissingError
            r = SharedMemoryStore.open({s.name!r})
            keys = [f"k{{i}}" for i in range(40)]
            def payload(k):
                seed = hashlib.blake2b(k.encode(), digest_size=8).digest()
                return (seed * ({ONB} // 8 + 1))[:{ONB}]
            data = r.get_concatenated(keys[::-1])
            ok = data == b"\\x07" * 100 + b"".join(payload(k) for k in keys[-2::-1])
            try:
                r.get_concatenated(["k0", "nope"])
                missing = "no error"
            except ObjectMissingError as e:
                missing = ",".join(e.keys)
            try:
                r.put([("x", b"1")])
                ro = "writable"
            except Exception as e:
                ro = type(e).__name__
            print(ok, missing, r.contains(["k1", "nope"]), ro, r.object_nbytes)
            r.close()
        """)
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0
        assert out.split() == ["True", "nope", "[True,", "False]", "BlockStoreError", str(ONB)]


def test_reader_during_writes_from_another_process_never_sees_torn_or_recycled_data() -> None:
    """The writer recycles slots continuously (capacity 64, 96 distinct keys cycled, 16 per batch)."""
    child = _child(f"""
        import hashlib, sys, time
        from auxout.stores.shm import SharedMemoryStore
        def payload(k):
            seed = hashlib.blake2b(k.encode(), digest_size=8).digest()
            return (seed * ({ONB} // 8 + 1))[:{ONB}]
        s = SharedMemoryStore(64 * {ONB}, {ONB})
        s.put([(f"k{{i}}", payload(f"k{{i}}")) for i in range(16)])
        print(s.name, flush=True)
        sys.stdin.readline() if False else None
        deadline = time.monotonic() + 4.0
        i = 16
        while time.monotonic() < deadline:
            s.put([(f"k{{j % 96}}", payload(f"k{{j % 96}}")) for j in range(i, i + 16)])
            i += 16
        print(i, flush=True)
        s.close()
    """)
    assert child.stdout is not None
    name = child.stdout.readline().strip()
    r = SharedMemoryStore.open(name)
    rng = np.random.default_rng(0)
    hits = misses = 0
    try:
        while child.poll() is None:
            picks = [f"k{int(i)}" for i in rng.integers(0, 96, 2)]
            try:
                got = r.get_concatenated(picks)
            except ObjectMissingError as exc:
                assert set(exc.keys) <= set(picks)
                misses += 1
                continue
            except StoreClosedError:
                break
            assert got == b"".join(_payload(k) for k in picks), "reader saw bytes that are not the key's payload"
            hits += 1
            one = [f"k{int(rng.integers(0, 96))}"]
            try:
                assert r.get_concatenated(one) == _payload(one[0])
                hits += 1
            except (ObjectMissingError, StoreClosedError):
                misses += 1
    finally:
        r.close()
        child.wait(timeout=30)
    written = int(child.stdout.readline())
    assert written > 4000, "writer did not recycle slots"
    assert hits > 50 and misses > 50, (hits, misses)


def test_sigkilled_owner_segments_are_swept() -> None:
    child = _child(f"""
        import time
        from auxout.stores.shm import SharedMemoryStore
        s = SharedMemoryStore(8 * {ONB}, {ONB}); t = SharedMemoryStore(8 * {ONB}, {ONB})
        s.put([("a", b"1")])
        print(s.name, t.name, flush=True)
        time.sleep(60)
    """)
    assert child.stdout is not None
    names = child.stdout.readline().split()
    paths = [os.path.join(SHM_DIR, n) for n in names]
    assert len(names) == 2 and all(os.path.exists(p) for p in paths)
    live = SharedMemoryStore(ONB, ONB)  # a live owner's segment must survive the sweep
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    assert all(os.path.exists(p) for p in paths), "SIGKILL cannot run cleanup: segments stay until swept"
    removed = sweep_stale()
    assert sorted(names) <= sorted(removed)
    assert not any(os.path.exists(p) for p in paths)
    assert os.path.exists(os.path.join(SHM_DIR, live.name))
    live.close()


def test_sweep_detects_reused_pid_and_runs_on_construction() -> None:
    # a segment claiming to belong to this (alive) pid but recording another start time is stale
    fake = os.path.join(SHM_DIR, f"auxout-{os.getpid()}-fakereuse")
    head = np.zeros(512, dtype=np.uint64)
    head[0] = int.from_bytes(b"AUXSHM01", "little")
    head[3], head[4] = os.getpid(), 12345
    fd = os.open(fake, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    os.write(fd, head.tobytes())
    os.close(fd)
    dead = os.path.join(SHM_DIR, "auxout-999999999-deadowner")  # pid beyond pid_max: never alive
    open(dead, "wb").close()
    s = SharedMemoryStore(ONB, ONB)  # constructor sweeps
    assert not os.path.exists(fake) and not os.path.exists(dead)
    assert os.path.exists(os.path.join(SHM_DIR, s.name))
    s.close()


def test_lru_eviction_with_references() -> None:
    with SharedMemoryStore(4 * ONB, ONB) as s:
        s.put([("a", b"a"), ("b", b"b")], retain=["a", "b"])
        s.put([("c", b"c"), ("d", b"d")])
        s.get_concatenated(["c"])  # touch: d is now the oldest unreferenced
        s.put([("e", b"e")])
        assert s.contains(["a", "b", "c", "d", "e"]) == [True, True, True, False, True]
        with pytest.raises(StoreCapacityError):
            s.put([("x", b"x"), ("y", b"y"), ("z", b"z")], retain=["x", "y", "z"])
        assert s.contains(["x", "y", "z"]) == [False, False, False]  # rolled back whole
        s.put([], release=["x", "y", "z"])
        s.put([], release=["b", "a"])  # released keys move to the MRU end in order: b older than a
        s.put([("f", b"f"), ("g", b"g")])
        assert s.contains(["a", "b", "c", "e", "f", "g"]) == [True, True, False, False, True, True]
        s.put([("h", b"h")])  # tail-first release: b goes before a
        assert s.contains(["a", "b", "h"]) == [True, False, True]
        with pytest.raises(InvariantError):
            s.put([], release=["never"])
        r = SharedMemoryStore.open(s.name)
        assert r.get_concatenated(["g", "a", "h"]) == b"gah"
        with pytest.raises(ObjectMissingError):
            r.get_concatenated(["b"])
        r.close()
        with pytest.raises(StoreClosedError):
            r.contains(["a"])


def test_many_readers_and_writes_use_bounded_time() -> None:
    with SharedMemoryStore(20_000 * 64, 64) as s:
        keys = [f"k{i}" for i in range(20_000)]
        s.put([(k, _payload(k, 64)) for k in keys])
        r = SharedMemoryStore.open(s.name)
        t = time.perf_counter()
        assert r.get_concatenated(keys[::-1]) == b"".join(_payload(k, 64) for k in keys[::-1])
        assert time.perf_counter() - t < 2.0
        r.close()


def test_fixed_name_survives_a_sigkilled_owner_and_its_readers_follow_the_new_segment() -> None:
    """P/D peers name the prefill's segment (``shm_name``, ``read_from``): after a SIGKILL its
    restart must create the segment again, and the decode side must read the new one, not keep
    the deleted mapping (found by a probe: startup failed with FileExistsError, and after a manual
    unlink every later KV hit recomputed)."""
    from auxout.errors import BlockStoreError
    from auxout.stores import make_store

    name = f"auxout-fixed-{os.getpid()}-prefill"
    code = f"""
        import sys, time
        from auxout.stores.shm import SharedMemoryStore
        s = SharedMemoryStore(8 * {ONB}, {ONB}, name={name!r})
        s.put([(sys.argv[1], b"1" * {ONB})])
        print(s.name, flush=True)
        time.sleep(60)
    """
    decode = make_store("shm", max_bytes=8 * ONB, object_nbytes=ONB, background=False, read_from=[f"shm://{name}"])
    first = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), "old"], stdout=subprocess.PIPE, text=True)
    second = None
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == name
        with pytest.raises(BlockStoreError, match=f"in use by process {first.pid}"):
            SharedMemoryStore(8 * ONB, ONB, name=name)  # a live owner keeps its name
        assert decode.contains(["old", "new"]) == [True, False]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        assert os.path.exists(os.path.join(SHM_DIR, name)), "SIGKILL leaves the segment behind"
        second = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), "new"], stdout=subprocess.PIPE, text=True)
        assert second.stdout is not None and second.stdout.readline().strip() == name  # restarted under its name
        assert decode.contains(["old", "new"]) == [False, True]  # the new segment, not the deleted one
        assert decode.get_concatenated(["new"]) == b"1" * ONB
    finally:
        for child in (first, second):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait(timeout=10)
        decode.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    foreign = os.path.join(SHM_DIR, name)
    with open(foreign, "wb") as f:
        f.write(b"not a store" * 1000)
    try:
        with pytest.raises(BlockStoreError, match="not an auxout route store"):
            SharedMemoryStore(8 * ONB, ONB, name=name)
        assert os.path.exists(foreign)  # never removed
    finally:
        os.unlink(foreign)
