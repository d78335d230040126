"""The worker connector's traffic with the block store: publishing a step's blocks and reading
rows of earlier steps back.

Both sides reuse their row buffers (``BufferRecycler``): a fresh multi-megabyte array per step
costs page faults comparable to the copy itself.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import numpy as np

from auxout.connector.slot_table import SlotTable
from auxout.connector.staging import StagingPool
from auxout.errors import (
    BlockStoreError,
    InvariantError,
    ObjectMissingError,
    StoreCapacityError,
    StoreUnavailableError,
)
from auxout.metrics import COUNTS, store_backend
from auxout.profile import RouteProfile
from auxout.stores.base import BlockObjects, BlockStore, StoreObject, object_keys, read_into
from auxout.stores.rows import StoreRows

_I64 = np.int64


class BufferRecycler:
    """Output buffers for rows read back from the store, reused once nobody holds a view.

    A fresh multi-megabyte array costs page faults and kernel zeroing comparable to the copy
    itself, and far more when the kernel compacts memory for the transparent huge pages numpy
    asks for (measured: a cold multi-turn run 3x slower than a warm one). So buffers come in
    power-of-two sizes (interchangeable, at most 2x over) and live in one pool per process and
    row shape, which outlives any one connector (an engine rebuilds its connector on re-init).
    A buffer is handed out again only when its reference count shows that no view of it (a
    chunk the scheduler or frontend still holds) is alive.
    """

    _pools: dict[tuple[str, str, tuple[int, ...]], list[np.ndarray]] = {}
    _lock = threading.Lock()

    def __init__(self, profile: RouteProfile, keep: int = 4, kind: str = "out") -> None:
        self.profile = profile
        self.keep = keep
        with self._lock:
            self._buffers = self._pools.setdefault((kind, profile.dtype.str, profile.shape_per_token), [])

    def take(self, rows: int) -> np.ndarray:
        with self._lock:
            buffers = self._buffers
            for i in range(len(buffers)):
                # references: the list and getrefcount's argument (enumerate() would add its tuple)
                if len(buffers[i]) >= rows and sys.getrefcount(buffers[i]) <= 2:
                    buf = buffers.pop(i)
                    buffers.append(buf)  # most recently used last
                    return buf[:rows]
            buf = self.profile.empty(1 << max(rows - 1, 1023).bit_length())
            buffers.append(buf)
            if len(buffers) > self.keep:
                buffers.pop(0)
            return buf[:rows]


class StoreWriter:
    """Puts one batch per step into the store and keeps what the scheduler learns with the next
    output: the keys published and the keys lost (dropped, evicted or found missing) since the last."""

    def __init__(self, profile: RouteProfile, block_size: int, store: BlockStore, pool: StagingPool) -> None:
        self.profile = profile
        self.block_size = block_size
        self.store = store
        self.pool = pool
        self._block_nbytes = profile.block_nbytes(block_size)
        self.dropped_batches = 0  # publications the store rejected for capacity (reads then fail closed)
        self.published: list[str] = []  # keys put since the last output
        self.lost: list[str] = []  # keys dropped or found missing since the last output
        self._drain_lost = getattr(store, "drain_lost", None)
        self._backend = store_backend(store)
        # staged blocks copied out for publication: reused once the store dropped its views (a
        # queued batch holds them until the writer applied it)
        self._buffers = BufferRecycler(profile, keep=8, kind="publish")

    def put(self, objects: Sequence[StoreObject], retain: Sequence[str], release: Sequence[str]) -> None:
        """Publish; a batch the store cannot fit or reach is dropped whole (its keys then read as missing)."""
        try:
            self.store.put(objects, retain=retain, release=release)
        except (StoreCapacityError, StoreUnavailableError):
            self.dropped_batches += 1
            self.lost.extend(object_keys(objects))
            COUNTS.add("store_errors", 1, self._backend, "write")
            return
        if objects:
            self.published.extend(object_keys(objects))

    def events(self) -> tuple[list[str], list[str]]:
        """Keys published and lost since the last output (for the scheduler's ``RouteIndex``)."""
        published, self.published = self.published, []
        lost, self.lost = self.lost, []
        if self._drain_lost is not None:
            lost.extend(self._drain_lost())
        return published, lost

    def events_undrained(self) -> tuple[list[str], list[str]]:
        """``events`` without asking the store for its lost keys (a chain of calls that run cold):
        they wait for a later output."""
        published, self.published = self.published, []
        lost, self.lost = self.lost, []
        return published, lost

    def objects_from_pool(self, keys: list[str], pool_blocks: list[int]) -> BlockObjects:
        """Objects for complete pool blocks (one copy out of the pool, which reuses them)."""
        idx = np.asarray(pool_blocks, dtype=_I64)
        bs = self.block_size
        copy = self._buffers.take(len(idx) * bs).reshape(len(idx), bs, *self.profile.shape_per_token)
        np.take(self.pool.blocks, idx, axis=0, out=copy, mode="clip")  # one copy out of the reusable pool
        objects = BlockObjects(nbytes=self._block_nbytes)
        objects.add(keys, copy.reshape(len(idx), -1).view(np.uint8))
        return objects

    def publish(
        self,
        objects: BlockObjects | None,
        pool_keys: list[str],
        pool_blocks: list[int],
        retain: list[str],
        release: list[str],
    ) -> None:
        """One store batch: ``objects`` plus completed pool blocks (copied out, then freed)."""
        if pool_blocks:
            pooled = self.objects_from_pool(pool_keys, pool_blocks)
            if objects:
                objects.extend(pooled)
            else:
                objects = pooled
        if objects or retain or release:
            self.put(objects or (), retain, release)
        if pool_blocks:
            self.pool.free(pool_blocks)


class StoreReader:
    """Reads rows captured in earlier steps back: whole keyed blocks from the store, the rest
    (open tails, complete blocks still waiting for their keys) from the staging pool."""

    def __init__(self, profile: RouteProfile, block_size: int, store: BlockStore, table: SlotTable, pool: StagingPool) -> None:
        self.profile = profile
        self.block_size = block_size
        self.store = store
        self._table = table
        self.pool = pool
        self._block_shape = (block_size, *profile.shape_per_token)
        self._out_buffers = BufferRecycler(profile)
        # prefix reads left in an in-process store's arena (None: the store copies them out)
        self._read_rows = getattr(store, "read_rows", None)
        self._backend = store_backend(store)  # (the label of this store's counters in auxout.metrics)

    def read_heads(
        self, slots: np.ndarray, emit: np.ndarray, cap: np.ndarray, slow: np.ndarray
    ) -> tuple[list[tuple[int, np.ndarray | StoreRows]], list[tuple[int, int, str, list[str]]]]:
        """Rows ``[emit, cap)`` of the batch indices ``slow`` (request slots ``slots``):
        ``(i, head rows)`` per success, ``(i, request slot, error, keys lost)`` per failure.

        Heads made only of whole stored blocks (a prefix hit: the common case) are read with one
        store call for the step: left in the arena of an in-process store (``StoreRows``, copied
        once, by whoever joins them), else copied into one buffer. The rest (a head starting
        mid-block, rows still staged) is read one request at a time.
        """
        bs = self.block_size
        keys = self._table.keys
        s_slow = slots[slow]
        e_slow, c_slow = emit[slow], cap[slow]
        stored = np.minimum(self._table.nkeys[s_slow], self._table.capture[s_slow] // bs) * bs
        whole = (e_slow % bs == 0) & (c_slow % bs == 0) & (c_slow <= stored)
        order = np.concatenate([np.flatnonzero(whole), np.flatnonzero(~whole)])  # whole heads first
        n_before = (c_slow - e_slow)[order]
        ends = np.cumsum(n_before)
        # per head, in read order: its request's index and request slot, rows [e, c) and place [a, b) in the read
        idx, sl, e, c = slow[order].tolist(), s_slow[order].tolist(), e_slow[order].tolist(), c_slow[order].tolist()
        a_, b_ = (ends - n_before).tolist(), ends.tolist()
        n_whole = int(np.count_nonzero(whole))
        done: list[tuple[int, np.ndarray | StoreRows]] = []
        failed: list[tuple[int, int, str, list[str]]] = []
        first = 0  # heads before this one were read in one batch
        if n_whole:
            batch: list[str] = []
            for j in range(n_whole):
                batch.extend(keys[sl[j]][e[j] // bs : c[j] // bs])
            try:
                got = None if self._read_rows is None else self._read_rows(batch, self.profile.dtype, self._block_shape)
                if got is not None:
                    done = [(idx[j], got[a_[j] : b_[j]]) for j in range(n_whole)]
                    first = n_whole
                elif n_whole > 1:
                    out = self._out_buffers.take(b_[n_whole - 1])
                    self._store_read(batch, out)
                    done = [(idx[j], out[a_[j] : b_[j]]) for j in range(n_whole)]
                    first = n_whole
                if first:
                    self._count_read(len(batch))
            except BlockStoreError:
                pass  # (rare) find out which requests failed: read them one by one below
        if first < len(idx):
            out = self._out_buffers.take(b_[-1] - a_[first])
            base = a_[first]
        for j in range(first, len(idx)):
            s = sl[j]
            head = out[a_[j] - base : b_[j] - base]
            stored_end = min(c[j], min(len(keys[s]), int(self._table.capture[s]) // bs) * bs)
            n_read = -(-stored_end // bs) - e[j] // bs if e[j] < stored_end else 0  # (as _read_into reads)
            try:
                self._read_into(s, e[j], c[j], head)
            except BlockStoreError as exc:
                missing = getattr(exc, "keys", None)
                self._count_read(n_read, exc)
                failed.append((idx[j], s, f"{type(exc).__name__}: {exc}", missing if missing else keys[s][: c[j] // bs]))
                continue
            self._count_read(n_read)
            done.append((idx[j], head))
        return done, failed


    def _count_read(self, n: int, exc: BaseException | None = None) -> None:
        """Count ``n`` objects read back (``auxout.metrics``): found, missing (``exc`` names the
        missing keys) or failed (the store could not be read)."""
        if n <= 0:
            return
        COUNTS.add("store_reads", n, self._backend)
        if exc is None:
            COUNTS.add("store_hits", n, self._backend)
        elif isinstance(exc, ObjectMissingError):
            missing = len(getattr(exc, "keys", None) or ()) or n
            COUNTS.add("store_misses", min(missing, n), self._backend)
            COUNTS.add("store_hits", n - min(missing, n), self._backend)
        else:
            COUNTS.add("store_errors", 1, self._backend, "read")

    def _read_into(self, s: int, t0: int, t1: int, out: np.ndarray) -> None:
        """Copy rows ``[t0, t1)`` of request slot ``s`` (captured in earlier steps) into ``out``.

        Complete keyed blocks come from the store, the rest from the staging pool.
        """
        bs = self.block_size
        keys = self._table.keys[s]
        stored_end = min(t1, min(len(keys), int(self._table.capture[s]) // bs) * bs)
        pos = t0
        if t0 < stored_end:
            b0, b1 = t0 // bs, -(-stored_end // bs)
            if t0 % bs == 0 and stored_end % bs == 0:  # aligned: the store writes into `out` directly
                self._store_read(keys[b0:b1], out[: stored_end - t0])
            else:
                tmp = self.profile.empty((b1 - b0) * bs)
                self._store_read(keys[b0:b1], tmp)
                out[: stored_end - t0] = tmp[t0 - b0 * bs : stored_end - b0 * bs]
            pos = stored_end
        tail_blk = int(self._table.capture[s]) // bs if self._table.tail[s] >= 0 else -1
        while pos < t1:
            b = pos // bs
            block = self._table.staged[s].get(b, -1)
            if block < 0 and b == tail_blk:
                block = int(self._table.tail[s])
            if block < 0:
                raise InvariantError(f"rows [{pos}, {t1}) of request {self._table.rid[s]!r} are neither stored nor staged")
            hi = min(t1, (b + 1) * bs)
            out[pos - t0 : hi - t0] = self.pool.blocks[block, pos - b * bs : hi - b * bs]
            pos = hi

    def _store_read(self, keys: list[str], out: np.ndarray) -> None:
        """Fill ``out`` (C-contiguous rows) with the payloads of ``keys``, checking the length."""
        read_into(self.store, keys, memoryview(out.reshape(-1).view(np.uint8).data))  # type: ignore[arg-type]
