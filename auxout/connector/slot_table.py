"""The worker connector's per-request state: one row (a *request slot*) per request incarnation.

The state lives in numpy arrays indexed by the request slot, so a step's bookkeeping is a
handful of vectorized calls over the batch's slots instead of a Python loop over requests. A
request finished while a step output covering it is in flight and then announced again gets a
new request slot; the in-flight step still refers to the old one.

Other indices into other tables are named for what they index: a *pool block* is a block of
the ``StagingPool`` (``tail`` and ``staged`` hold pool blocks), a *block index* counts hash
blocks along a request's token positions (``keys[s][b]`` is block ``b``'s key).

Each request holds a store reference ("pin") on the leading keys it may still read
(``sync_pins``); freeing its slot returns them for release.

Reads of the cursors (and of ``tail``, the only way to find a request's rows in the staging
pool) first run the flush a decode lane registered while it holds writes back
(``defer_writes``): a caller cannot see cursors or staged rows that are behind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from auxout.keys import PackedHashes

_I64 = np.int64
_NO_LIMIT = (1 << 62) - 1


class SlotTable:
    """Request slots: cursors, staging, keys and pins of every tracked request incarnation."""

    def __init__(self, n: int, block_size: int) -> None:
        self.block_size = block_size
        self.slot_of: dict[str, int] = {}  # live request id -> its request slot
        self.pin_floor: dict[int, int] = {}  # finished request slot -> leading pins handed to a next turn
        # bumped whenever a request slot is taken or freed: a batch's slots looked up under one
        # epoch stay valid while it does not change (a decode step repeats its batch)
        self.epoch = 0
        self._flush: Callable[[], None] | None = None
        self._alloc(n)

    def _alloc(self, n: int) -> None:
        # The three cursors are columns of one array: a decode lane step moves all three in one call.
        #   capture: next position expected from capture; -1 = none captured yet
        #   sched:   end of the last executed (scheduled) range
        #   emit:    first position not emitted yet (NO_EMIT: this incarnation emits nothing more)
        self._cursors = np.zeros((n, 3), dtype=_I64)
        self._cursors[:, 0] = -1
        self._tail = np.full(n, -1, dtype=_I64)  # pool block of the open (incomplete) tail block; -1 none
        self.nkeys = np.zeros(n, dtype=_I64)  # len(keys[s])
        self.pinned = np.zeros(n, dtype=_I64)  # leading keys this request holds a store reference on
        self.keys: list[list[str]] = [[] for _ in range(n)]  # block index -> key
        self.hashes: list[list[PackedHashes]] = [[] for _ in range(n)]  # the packs ``keys`` came from
        self.staged: list[dict[int, int]] = [{} for _ in range(n)]  # block index -> pool block (complete, unkeyed)
        self.rid: list[str] = [""] * n
        self._free = list(range(n - 1, -1, -1))  # pop() hands out slot 0 first

    def _grow(self) -> None:
        old = len(self._tail)
        grown = SlotTable(2 * old, self.block_size)
        grown._cursors[:old] = self._cursors
        grown._tail[:old], grown.nkeys[:old], grown.pinned[:old] = self._tail, self.nkeys, self.pinned
        grown.keys[:old], grown.hashes[:old] = self.keys, self.hashes
        grown.staged[:old], grown.rid[:old] = self.staged, self.rid
        self._cursors, self._tail, self.nkeys, self.pinned = grown._cursors, grown._tail, grown.nkeys, grown.pinned
        self.keys, self.hashes, self.staged, self.rid = grown.keys, grown.hashes, grown.staged, grown.rid
        self._free = grown._free[:old] + self._free  # the new slots, then the free old ones

    def __len__(self) -> int:
        return len(self._tail)

    # -- cursors and tails: settled on every access --------------------------------------------
    def defer_writes(self, flush: Callable[[], None]) -> None:
        """``flush`` holds writes to the cursors and to the rows of tail blocks: run it (once)
        before anything reads or writes either."""
        self._flush = flush

    def settle(self) -> None:
        flush, self._flush = self._flush, None
        if flush is not None:
            flush()

    @property
    def cursors(self) -> np.ndarray:
        """``[slots, 3]``: the columns ``capture``, ``sched`` and ``emit``."""
        if self._flush is not None:
            self.settle()
        return self._cursors

    @property
    def capture(self) -> np.ndarray:
        if self._flush is not None:
            self.settle()
        return self._cursors[:, 0]

    @property
    def sched(self) -> np.ndarray:
        if self._flush is not None:
            self.settle()
        return self._cursors[:, 1]

    @property
    def emit(self) -> np.ndarray:
        if self._flush is not None:
            self.settle()
        return self._cursors[:, 2]

    @property
    def tail(self) -> np.ndarray:
        if self._flush is not None:
            self.settle()
        return self._tail

    # -- request slots ---------------------------------------------------------------------------
    def new(self, rid: str, emit_start: int) -> int:
        """A request slot for a new incarnation of ``rid``, emitting from ``emit_start``."""
        if not self._free:
            self._grow()
        s = self._free.pop()
        self._cursors[s] = (-1, 0, emit_start)
        self.rid[s] = rid
        self._clear(s)
        self.slot_of[rid] = s
        self.epoch += 1
        if self.pin_floor:  # (only a begin_step that failed half-way leaves an entry behind)
            self.pin_floor.pop(s, None)
        return s

    def free(self, slots: Sequence[int]) -> tuple[list[str], list[int]]:
        """Give request slots back: returns the keys they pinned, in release order (each chain
        tail-first), and the pool blocks they held."""
        assert self._flush is None, "a decode lane still holds writes: leave it before freeing request slots"
        keys, pinned, staged, tail = self.keys, self.pinned, self.staged, self._tail
        release: list[str] = []
        pool_blocks: list[int] = []
        floor = self.pin_floor
        self.epoch += 1
        for s in slots:
            release.extend(reversed(keys[s][floor.pop(s, 0) if floor else 0 : pinned[s]]))
            pool_blocks.extend(staged[s].values())
            if tail[s] >= 0:
                pool_blocks.append(int(tail[s]))
            self._clear(s)
            self._free.append(s)
        return release, pool_blocks

    def _clear(self, s: int) -> None:
        self._tail[s] = -1
        self.nkeys[s] = 0
        self.pinned[s] = 0
        self.keys[s] = []
        self.hashes[s] = []
        self.staged[s] = {}

    # -- keys and pins ---------------------------------------------------------------------------
    def add_keys(self, slots: list[int], keys: list[list[str]]) -> np.ndarray:
        """Append each request's new keys; returns ``slots`` as an array (for ``sync_pins``)."""
        for s, new in zip(slots, keys):
            self.keys[s].extend(new)
        idx = np.array(slots, dtype=_I64)
        self.nkeys[idx] = [len(self.keys[s]) for s in slots]
        return idx

    def sync_pins(self, slots: np.ndarray, retain: list[str], release: list[str]) -> None:
        """Hold references on exactly the keys each request may still read (distinct slots, in order).

        Before its first capture a request pins all its keys (a prefix hit will read them);
        afterwards only complete blocks below its capture cursor: blocks it will compute itself
        need no pin (the store may still hold them from an earlier request, and pinning those
        would let live requests hold more objects than the KV cache has blocks). One pass of
        numpy calls for the whole step; a Python loop only over the requests whose pins changed.
        """
        nkeys = self.nkeys[slots]
        # no capture yet (-1, so cap // bs == -1): the mask turns -1 into a limit above any key count
        target = np.minimum(nkeys, (self.capture[slots] // self.block_size) & _NO_LIMIT)
        have = self.pinned[slots]
        changed = np.flatnonzero(target != have)  # integer indices: cheaper to gather than a mask
        if not len(changed):
            return
        target, moved = target[changed], slots[changed]
        for s, t, h in zip(moved.tolist(), target.tolist(), have[changed].tolist()):
            keys = self.keys[s]
            if t > h:
                retain.extend(keys[h:t])
            else:
                release.extend(reversed(keys[t:h]))
        self.pinned[moved] = target

    def inherit_pins(self, hashed: list[int], sources: list[tuple[list[str], int] | None], done: list[int]) -> None:
        """A next turn admitted in the step its previous turn ends takes over that turn's pins
        on their shared history instead of retaining what the other releases in the same batch:
        +1 and -1 on a key that stays referenced change nothing the store can show, and a long
        conversation's history is thousands of keys per turn. ``sources[i]``: the finished key
        list request ``hashed[i]``'s keys came from, and how many; ``done``: the finished slots."""
        keys, pinned = self.keys, self.pinned
        donors = {id(keys[d]): d for d in done}
        for s, src in zip(hashed, sources):
            if src is None:
                continue
            d = donors.get(id(src[0]))
            # (the heir is new: this pack is its first, nothing captured or pinned yet)
            if d is None or len(self.hashes[s]) != 1 or self.capture[s] >= 0 or pinned[s]:
                continue
            del donors[id(src[0])]  # one heir per finished turn
            m = min(src[1], int(pinned[d]))
            pinned[s] = m
            self.pin_floor[d] = m  # the finished turn releases only what it keeps

    def take_keyed_staged(self, slots: Sequence[int]) -> tuple[list[str], list[int]]:
        """Staged blocks of ``slots`` whose keys are known now: their keys and pool blocks (no
        longer staged: the caller publishes and frees them)."""
        keys: list[str] = []
        pool_blocks: list[int] = []
        for s in slots:
            staged = self.staged[s]
            nkeys = len(self.keys[s])
            for b in [b for b in staged if b < nkeys]:
                keys.append(self.keys[s][b])
                pool_blocks.append(staged.pop(b))
        return keys, pool_blocks
