"""Cross-process route store in POSIX shared memory (``/dev/shm``), so a trainer on the same host
reads routes straight out of the engine's arena without going through the engine.

Layout of one segment (owner-only permissions, 0600)::

    header (4 KiB) | seq u64[N] | digest u64[N, 2] | length u64[N] | data u8[N, object_nbytes]

The owner (one process, the engine) keeps the LRU, reference counts and key -> slot map in
Python, like ``ArenaStore``; only the slot table is shared. A slot holds blake2b-128(key), the
payload length and the payload. Readers (``SharedMemoryStore.open(name)``, read-only mapping)
find slots by digest and validate every copy with a per-slot **seqlock**: the owner makes
``seq`` odd before it writes or recycles a slot and even afterwards; a reader copies
(seq, digest, length, data, seq) and accepts the copy only when both seq reads are equal and
even and the digest is the requested key's. So a reader never returns torn or recycled bytes:
it retries, or reports the key missing. Live objects never move, so a key that stays in the
store for the whole read is always found. The seqlock relies on the x86-64 (TSO) memory order;
on weakly ordered CPUs this store needs explicit fences and is not supported.

Readers do not touch the owner's LRU (their mapping is read-only). Segments are named
``auxout-<owner pid>-<random>``; ``sweep_stale()`` (also run by every owner constructor) unlinks
segments whose owner is dead (or whose pid was reused, detected by the process start time),
which is what is left behind after a SIGKILL; a custom ``name`` outside that pattern is never
swept, but an owner created under it takes it over from a dead owner, and readers
(``replaced()``, used by ``ReadThroughStore``) map the new segment. Linux only.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Iterable, Sequence

import numpy as np

from auxout.errors import (
    BlockStoreError,
    InvariantError,
    ObjectMissingError,
    StoreClosedError,
)
from auxout.stores.base import StoreObject
from auxout.stores.slots import SlotIndex, write_slots

SHM_DIR = "/dev/shm"
NAME_PREFIX = "auxout-"
_NAME_RE = re.compile(r"^auxout-(\d+)-[0-9a-zA-Z_.]+$")
_MAGIC = int.from_bytes(b"AUXSHM01", "little")
_HEADER = 4096
# header u64 fields
_H_MAGIC, _H_OBJ, _H_SLOTS, _H_PID, _H_START, _H_GEN, _H_CLOSED = range(7)
_READ_DEADLINE_S = 5.0


def _digests(keys: Sequence[str]) -> np.ndarray:
    """blake2b-128 of every key as an (n, 2) uint64 array (the shared-memory key identity)."""
    raw = b"".join(hashlib.blake2b(k.encode(), digest_size=16).digest() for k in keys)
    return np.frombuffer(raw, dtype=np.uint64).reshape(-1, 2)


def _proc_start_time(pid: int) -> int:
    """Kernel start time of ``pid`` in clock ticks (0 if unknown): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _layout(num_slots: int, object_nbytes: int) -> tuple[int, int, int, int, int]:
    seq_off = _HEADER
    dig_off = seq_off + 8 * num_slots
    len_off = dig_off + 16 * num_slots
    data_off = -(-(len_off + 8 * num_slots) // 4096) * 4096
    total = data_off + num_slots * object_nbytes
    return seq_off, dig_off, len_off, data_off, total


def _header_owner(path: str) -> tuple[int, int] | None:
    """``(pid, process start time)`` an auxout segment's header records; None if not one."""
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(64), dtype=np.uint64)
    if head.size < 5 or head[_H_MAGIC] != _MAGIC:
        return None
    return int(head[_H_PID]), int(head[_H_START])


def _owner_gone(pid: int, start: int) -> bool:
    """Whether the process that created a segment is dead (or its pid now names another process)."""
    return not _pid_alive(pid) or (start != 0 and start != _proc_start_time(pid))


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink ``auxout-<pid>-*`` segments whose owner process is gone; returns the names removed.

    A segment whose pid is alive is kept unless its header records a different process start
    time (the pid was reused by an unrelated process after the owner died).
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if m is None:
            continue
        pid = int(m.group(1))
        path = os.path.join(shm_dir, name)
        stale = not _pid_alive(pid)
        if not stale:
            try:
                owner = _header_owner(path)
            except OSError:
                continue
            stale = owner is not None and owner[0] == pid and _owner_gone(*owner)
        if stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(name)
    return removed


class _Mapping:
    """numpy views over one mapped segment; ``release()`` drops them so the mmap can close."""

    def __init__(self, mm: mmap.mmap, num_slots: int, object_nbytes: int, writable: bool) -> None:
        seq_off, dig_off, len_off, data_off, _ = _layout(num_slots, object_nbytes)
        buf = memoryview(mm) if writable else memoryview(mm).toreadonly()
        self.mm = mm
        self.buf = buf
        self.header = np.frombuffer(buf, dtype=np.uint64, count=8)
        self.seq = np.frombuffer(buf, dtype=np.uint64, count=num_slots, offset=seq_off)
        self.dig = np.frombuffer(buf, dtype=np.uint64, count=2 * num_slots, offset=dig_off).reshape(-1, 2)
        self.lens = np.frombuffer(buf, dtype=np.uint64, count=num_slots, offset=len_off)
        self.data = np.frombuffer(buf, dtype=np.uint8, count=num_slots * object_nbytes, offset=data_off).reshape(
            num_slots, object_nbytes
        )

    def release(self) -> None:
        del self.header, self.seq, self.dig, self.lens, self.data
        self.buf.release()
        self.mm.close()


def _concat(block: np.ndarray, lens: np.ndarray, object_nbytes: int) -> bytes:
    """Payload bytes of each row of ``block`` (row i has ``lens[i]`` bytes), concatenated."""
    if (lens == object_nbytes).all():
        return block.tobytes()
    mask = np.arange(object_nbytes, dtype=np.uint64)[None, :] < lens[:, None]
    return block[mask].tobytes()


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedMemoryStore:
    """``BlockStore`` over a POSIX shared-memory arena; the creating process owns and writes it.

    ``SharedMemoryStore(max_bytes, object_nbytes)`` creates a segment (``.name``, ``.address``);
    ``SharedMemoryStore.open(name)`` maps it read-only in any process of the same user. Eviction
    is LRU among unreferenced objects, with ``retain``/``release`` reference counts as in
    ``ArenaStore``; a batch that cannot fit raises ``StoreCapacityError`` and writes nothing.
    """

    def __init__(self, max_bytes: int, object_nbytes: int, *, name: str | None = None) -> None:
        if not isinstance(object_nbytes, int) or object_nbytes <= 0:
            raise ValueError(f"SharedMemoryStore object_nbytes must be a positive int, got {object_nbytes!r}")
        if not isinstance(max_bytes, int) or max_bytes < object_nbytes:
            raise ValueError(
                f"SharedMemoryStore max_bytes={max_bytes!r} must fit at least one object of {object_nbytes} bytes"
            )
        sweep_stale()
        pid = os.getpid()
        if name is None:
            name = f"{NAME_PREFIX}{pid}-{secrets.token_hex(6)}"
        elif "/" in name or not name.startswith(NAME_PREFIX):
            raise ValueError(f"shared-memory store name {name!r} must start with {NAME_PREFIX!r} and have no '/'")
        self.name = name
        self.object_nbytes = object_nbytes
        self.num_slots = max_bytes // object_nbytes
        self.readonly = False
        self._path = os.path.join(SHM_DIR, name)
        self._ino = 0  # (readers: the inode they mapped, see replaced())
        total = _layout(self.num_slots, object_nbytes)[4]
        self._take_over_stale(self._path)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink_quietly(self._path)
            raise
        os.close(fd)
        self._map: _Mapping | None = _Mapping(mm, self.num_slots, object_nbytes, writable=True)
        h = self._map.header
        h[_H_OBJ], h[_H_SLOTS], h[_H_PID] = object_nbytes, self.num_slots, pid
        h[_H_START], h[_H_GEN], h[_H_CLOSED] = _proc_start_time(pid), 0, 0
        h[_H_MAGIC] = _MAGIC  # last: readers check it
        self._slots = SlotIndex(self.num_slots, "shared-memory route store", backend="shm")
        self._lock = threading.Lock()
        # unlink on normal interpreter exit too; SIGKILL leaves it for sweep_stale()
        self._finalizer = weakref.finalize(self, _unlink_quietly, self._path)
        atexit.register(self._finalizer)
        # reader-side index cache (unused by the owner)
        self._index_gen = -1
        self._sorted_lo = np.empty(0, dtype=np.uint64)
        self._order = np.empty(0, dtype=np.int64)

    @staticmethod
    def _take_over_stale(path: str) -> None:
        """A fixed name (``shm_name``: P/D peers name it in ``read_from``) left by an owner that
        died (SIGKILL skips the unlink) is removed, so a restarted engine can create it again; one
        whose owner is alive, or a file that is not an auxout segment, is an error naming it."""
        try:
            owner = _header_owner(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise BlockStoreError(f"shared-memory store {path!r} exists and cannot be read: {exc}") from exc
        if owner is None:
            raise BlockStoreError(f"{path!r} exists and is not an auxout route store: choose another shm_name")
        if not _owner_gone(*owner):
            raise BlockStoreError(
                f"shared-memory store {path!r} is in use by process {owner[0]} (another engine with the same "
                "shm_name?): give each engine its own shm_name"
            )
        _unlink_quietly(path)

    @classmethod
    def open(cls, name: str) -> SharedMemoryStore:
        """Map an existing segment read-only (another process of the same user)."""
        if "/" in name:
            raise ValueError(f"invalid shared-memory store name {name!r}")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise BlockStoreError(f"shared-memory route store {name!r} does not exist (owner closed or gone)") from exc
        try:
            stat = os.fstat(fd)
            size = stat.st_size
            if size < _HEADER:
                raise BlockStoreError(f"shared-memory segment {name!r} is not an auxout store (size {size})")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        head = np.frombuffer(mm, dtype=np.uint64, count=8).copy()
        obj, slots = int(head[_H_OBJ]), int(head[_H_SLOTS])
        if head[_H_MAGIC] != _MAGIC or obj <= 0 or _layout(slots, obj)[4] != size:
            mm.close()
            raise BlockStoreError(f"shared-memory segment {name!r} is not an auxout store (bad header)")
        self = cls.__new__(cls)
        self.name, self.object_nbytes, self.num_slots, self.readonly = name, obj, slots, True
        self._slots = SlotIndex(0, "shared-memory route store reader")
        self._path = path
        self._ino = stat.st_ino
        self._map = _Mapping(mm, slots, obj, writable=False)
        self._lock = threading.Lock()
        self._index_gen = -1
        self._sorted_lo = np.empty(0, dtype=np.uint64)
        self._order = np.empty(0, dtype=np.int64)
        return self

    def replaced(self) -> bool:
        """Reader: whether the segment mapped here is gone (closed, or unlinked; a restarted owner
        may have created another under the same name). An owner's store is never replaced."""
        m = self._map
        if not self.readonly:
            return False
        if m is None or m.header[_H_CLOSED]:
            return True
        try:
            return os.stat(self._path).st_ino != self._ino
        except FileNotFoundError:
            return True

    @property
    def address(self) -> str:
        return f"shm://{self.name}"

    def __len__(self) -> int:
        return len(self._slots.lru) if not self.readonly else int(np.count_nonzero(self._live().lens))

    def references(self, key: str) -> int:
        return self._slots.refs.get(key, 0)

    # -- protocol ------------------------------------------------------------------------------
    def put(
        self, objects: Sequence[StoreObject], *, retain: Iterable[str] = (), release: Iterable[str] = ()
    ) -> None:
        with self._lock:
            m = self._live()
            if self.readonly:
                raise BlockStoreError(f"shared-memory store {self.name!r} is opened read-only; only its owner writes")
            new, payloads, slots, freed = self._slots.plan_put(objects, retain, release, self.object_nbytes)
            if freed:
                idx = np.asarray(freed, dtype=np.int64)
                m.seq[idx] += 1  # odd: readers discard any copy that overlaps
                m.dig[idx] = 0
                m.lens[idx] = 0
                m.seq[idx] += 1
            if new:
                self._write(m, new, payloads, slots, objects)
            m.header[_H_GEN] += 1

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        with self._lock:
            m = self._live()
            if not keys:
                return b""
            if self.readonly:
                return self._reader_get(m, keys)
            slots = self._slots.lookup(keys)
            idx = np.asarray(slots, dtype=np.int64)
            return _concat(m.data[idx], m.lens[idx], self.object_nbytes)

    def drain_lost(self) -> list[str]:
        """Keys evicted since the last call, for the scheduler's view of readable routes."""
        return self._slots.drain_lost()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            m = self._live()
            if not self.readonly:
                return self._slots.contains(keys)
            if not keys:
                return []
            want = _digests(keys)
            slots = self._lookup(m, want)
            ok = slots >= 0
            s = slots[ok]
            seq = m.seq[s]
            good = (seq % 2 == 0) & (m.dig[s] == want[ok]).all(axis=1)
            ok[ok] = good
            return ok.tolist()

    def close(self) -> None:
        """Owner: unlink the segment (readers' existing mappings stay valid but report closed)."""
        with self._lock:
            m = self._map
            if m is None:
                return
            self._map = None
            if not self.readonly:
                m.header[_H_CLOSED] = 1
                self._slots.clear()
                _unlink_quietly(self._path)
                self._finalizer.detach()
                atexit.unregister(self._finalizer)
            m.release()

    def __enter__(self) -> SharedMemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- owner internals --------------------------------------------------------------------------
    def _live(self) -> _Mapping:
        m = self._map
        if m is None:
            raise StoreClosedError(f"SharedMemoryStore {self.name!r}")
        if self.readonly and m.header[_H_CLOSED]:
            raise StoreClosedError(f"SharedMemoryStore {self.name!r} (its owner closed it)")
        return m

    def _write(
        self, m: _Mapping, keys: list[str], views: list[memoryview] | None, slots: list[int], objects: Sequence[StoreObject]
    ) -> None:
        idx = np.asarray(slots, dtype=np.int64)
        m.seq[idx] += 1  # odd: slot being (re)written
        m.dig[idx] = _digests(keys)
        m.lens[idx] = write_slots(m.data, slots, views, objects)
        m.seq[idx] += 1

    # -- reader internals -------------------------------------------------------------------------
    def _lookup(self, m: _Mapping, want: np.ndarray, *, refresh: bool = False) -> np.ndarray:
        """Slot of each digest (or -1), via a sorted snapshot of the digest table's low words.

        Candidates whose high word does not match (stale snapshot, or a 64-bit prefix collision)
        are resolved by an exact scan of the live table.
        """
        gen = int(m.header[_H_GEN])
        if refresh or gen != self._index_gen:
            lo = m.dig[:, 0].copy()
            self._order = np.argsort(lo, kind="stable")
            self._sorted_lo = lo[self._order]
            self._index_gen = gen
        if self._sorted_lo.size == 0:
            return np.full(len(want), -1, dtype=np.int64)
        pos = np.searchsorted(self._sorted_lo, want[:, 0]).clip(0, self._sorted_lo.size - 1)
        slots = self._order[pos].astype(np.int64)
        slots[self._sorted_lo[pos] != want[:, 0]] = -1
        found = slots >= 0
        wrong = np.zeros_like(found)
        wrong[found] = m.dig[slots[found], 1] != want[found, 1]
        for i in np.flatnonzero(wrong):
            hit = np.flatnonzero((m.dig[:, 0] == want[i, 0]) & (m.dig[:, 1] == want[i, 1]))
            slots[i] = hit[0] if hit.size else -1
        return slots

    def _reader_get(self, m: _Mapping, keys: Sequence[str]) -> bytes:
        want = _digests(keys)
        refresh = False
        deadline = time.monotonic() + _READ_DEADLINE_S
        for attempt in itertools.count():
            if attempt >= 8:  # heavy churn on these slots: let the writer finish its batch
                if time.monotonic() > deadline:
                    break
                time.sleep(1e-4)
            slots = self._lookup(m, want, refresh=refresh)
            found = slots >= 0
            if not found.all():
                if refresh:
                    raise ObjectMissingError(
                        [k for k, f in zip(keys, found) if not f],
                        f"not in shared-memory store {self.name!r} (evicted or never written)",
                    )
                refresh = True
                continue
            s1 = m.seq[slots].copy()
            dig = m.dig[slots].copy()
            lens = m.lens[slots].copy()
            block = m.data[slots].copy()
            s2 = m.seq[slots].copy()
            if ((s1 == s2) & (s1 % 2 == 0)).all() and (dig == want).all():
                if ((lens == 0) | (lens > self.object_nbytes)).any():
                    raise InvariantError(f"shared-memory store {self.name!r} holds an invalid slot length")
                return _concat(block, lens, self.object_nbytes)
            refresh = True  # a slot was being written or recycled: look everything up again
        raise BlockStoreError(f"shared-memory store {self.name!r}: reads kept racing with writes; retry later")
