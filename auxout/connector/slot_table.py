"""The worker connector's per-request state: one row (a *request slot*) per request incarnation.

The state lives in numpy arrays indexed by the request slot, so a step's bookkeeping is a
handful of vectorized calls over the batch's slots instead of a Python loop over requests. A
request finished while a step output covering it is in flight and then announced again gets a
new request slot; the in-flight step still refers to the old one.

Other indices into other tables are named for what they index: a *pool block* is a block of
the ``StagingPool`` (``tail`` and ``staged`` hold pool blocks), a *block index* counts hash
blocks along a request's token positions (``keys[s][b]`` is block ``b``'s key).

Reads of the cursors (and of ``tail``, the only way to find a request's rows in the staging
pool) first run the flush a decode lane registered while it holds writes back
(``defer_writes``): a caller cannot see cursors or staged rows that are behind.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from auxout.keys import PackedHashes

_I64 = np.int64


class SlotTable:
    """Request slots: cursors, staging and keys of every tracked request incarnation."""

    def __init__(self, n: int) -> None:
        self.slot_of: dict[str, int] = {}  # live request id -> its request slot
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
        grown = SlotTable(2 * old)
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
        return s

    def free(self, s: int) -> None:
        """Give request slot ``s`` back (its keys and pool blocks released by the caller)."""
        assert self._flush is None, "a decode lane still holds writes: leave it before freeing request slots"
        self._clear(s)
        self._free.append(s)

    def _clear(self, s: int) -> None:
        self._tail[s] = -1
        self.nkeys[s] = 0
        self.pinned[s] = 0
        self.keys[s] = []
        self.hashes[s] = []
        self.staged[s] = {}
