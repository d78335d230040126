"""The decode lane: a batch that decodes one token per request per step, the same batch step after step.

Every request of the batch keeps an open tail block (one is opened as soon as the previous one
fills), and the step in which each tail fills is known in advance (``fills_at``), so a step
only queues its rows, without a check per request: they go into the tails, and the cursors
move, for several steps at once, when a tail fills, the window ends, the lane is left, or
something reads the cursors (every first fancy assignment after a forward costs ~20 us, cold).

The lane owns no publication: ``advance`` says which tails filled, ``take_filled`` hands their
pool blocks to the worker connector, which publishes (or stages) them, and ``reopen`` opens the
next tails. Any other step, batch or terminal event makes the worker ``leave`` the lane.

Writes held back are registered with the ``SlotTable`` (``defer_writes``): any access to the
cursors or tails runs them first, so nobody can read state that is behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from auxout.connector.slot_table import SlotTable
from auxout.connector.staging import StagingPool

_I64 = np.int64


@dataclass(slots=True)
class LaneStats:
    """How steady decode steps were committed (read by tests and benchmarks)."""

    steps: int = 0  # decode steps committed through the lane
    begins: int = 0  # begin_step calls that checked the emit starts against the lane's lists
    fused: int = 0  # of the lane steps, committed by commit_lane_step (one call for three)


@dataclass(slots=True)
class FilledTails:
    """Tail blocks that a lane step filled: the worker publishes (or stages) them."""

    batch_index: np.ndarray  # positions in the lane's batch
    slots: np.ndarray  # their request slots
    pool_blocks: list[int]  # the staging pool blocks holding the filled blocks
    block_index: list[int]  # which block of its request each one is


class DecodeLane:
    """One repeated decode batch, committed a window (one block's worth of steps) at a time."""

    def __init__(
        self, table: SlotTable, pool: StagingPool, block_size: int, slots: np.ndarray, positions: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> None:  # fmt: skip
        """Enter the lane after a decode step of request slots ``slots`` (the very array
        ``prepare_output`` hands out for the batch) that left every cursor at ``positions``:
        opens a tail where the previous one just filled."""
        self._table = table
        self._pool = pool
        self.block_size = bs = block_size
        self.slots = slots
        pos = positions % bs
        tail = table.tail[slots]
        need = np.flatnonzero(pos == 0)
        if len(need):
            fresh = pool.alloc(len(need))
            tail[need] = fresh
            table.tail[slots[need]] = fresh
        # lane step -> batch indices whose tail block fills in that step
        self.fills_at: dict[int, list[int]] = {}
        for i, wait in enumerate((bs - 1 - pos).tolist()):
            self.fills_at.setdefault(wait, []).append(i)
        # [[0], [1], ..., [block_size]]: a window's step offsets (a window is one block of steps)
        self._offsets = np.arange(bs + 1, dtype=_I64)[:, None]
        offsets = self._offsets
        # The window's steps, precomputed (a step then runs no ufunc: the first one after a
        # forward costs ~25 us, cold): ``positions[j]`` is every request's next position (its
        # capture, scheduled and emit cursors) before window step ``j``, ``pool_rows[j]`` the
        # staging pool token row its row of that step goes to.
        self.positions = positions + offsets  # [window + 1, batch]
        self.pool_rows = tail * bs + pos + offsets[:-1]  # [window, batch]
        self.window_step = 0  # this step's row in the window
        self.steps = 0  # lane steps taken
        q = query_start_loc
        n = len(slots)
        self.qsl_bytes = q.tobytes()  # the batch's query_start_loc (one row each) ...
        self.first_row = int(q[0])  # ... starting at this row (0: request i's row is rows[i])
        # every lane step's row spans (read only, shared by its outputs)
        self.lo, self.hi = q[:n].copy(), q[1 : n + 1].copy()
        self.lo.flags.writeable = self.hi.flags.writeable = False
        # ``positions`` in the metadata's request order, as lists (begin_step compares the
        # scheduler's emit starts with them without numpy): for the request slots
        # ``_meta_slots``, permuted by ``_meta_order``; None until first needed in a window
        self._meta_slots: np.ndarray | None = None
        self._meta_order: np.ndarray | None = None
        self._meta_positions: list[list[int]] | None = None
        self._positions_list: list[list[int]] | None = None  # ``positions`` as lists, in the batch's order
        self._qsl_list: list[int] = []
        # lane steps whose rows are not in the staging pool yet, as (window step, step rows):
        # written together when a tail fills, the window ends or the lane is left
        self._held_rows: list[tuple[int, np.ndarray]] = []
        self._write_held = self._write_held_back  # (bound once: registered every step)

    @property
    def next_positions(self) -> np.ndarray:
        """Every request's next position (its cursors once settled) before the next lane step."""
        return self.positions[self.window_step]

    # -- is this the lane's next step? ---------------------------------------------------------------
    def expects(self, token_starts: np.ndarray, query_start_loc: np.ndarray) -> bool:
        """Whether a step with these cursors (arrays) is the lane's next one."""
        return (
            token_starts.tobytes() == self.positions[self.window_step].tobytes()
            and query_start_loc.tobytes() == self.qsl_bytes
        )

    def expects_lists(self, token_starts: list[int], query_start_loc: list[int], num_rows: int) -> bool:
        """``expects`` for cursors as plain lists (no numpy: its first calls after a forward run cold)."""
        if self._positions_list is None:  # (once per window)
            self._positions_list = self.positions.tolist()
            self._qsl_list = np.frombuffer(self.qsl_bytes, dtype=_I64).tolist()
        q = self._qsl_list
        return token_starts == self._positions_list[self.window_step] and query_start_loc == q and num_rows >= q[-1]

    def emit_starts(self, meta_slots: np.ndarray) -> list[int] | None:
        """The batch's emit cursors in the order of ``meta_slots`` (its request slots as the
        metadata lists them), as a list; None if ``meta_slots`` is not the lane's batch. Built
        once per window."""
        if self._meta_slots is not meta_slots:
            where = {s: i for i, s in enumerate(self.slots.tolist())}
            order = [where.get(s, -1) for s in meta_slots.tolist()]
            if len(order) != len(where) or -1 in order:
                return None
            self._meta_slots, self._meta_order, self._meta_positions = meta_slots, np.array(order, dtype=_I64), None
        if self._meta_positions is None:
            self._meta_positions = self.positions[:, self._meta_order].tolist()
        return self._meta_positions[self.window_step]

    # -- moving ----------------------------------------------------------------------------------
    def advance(self, rows: np.ndarray) -> list[int] | None:
        """Commit the lane's next step (checked by the caller): hold its rows back, move the
        window. Returns the batch indices whose tail block filled in this step (None: none)."""
        j = self.window_step
        self._held_rows.append((j, rows))  # (into the pool later, several steps in one call)
        self._table.defer_writes(self._write_held)  # (so are the cursors: they are next_positions meanwhile)
        j = self.window_step = j + 1
        if j == len(self.pool_rows):  # the next window: rows go on where this one's went
            self.settle()  # (with this window's rows and cursors)
            offsets = self._offsets
            self.positions, self.pool_rows = self.positions[j] + offsets, self.pool_rows[j - 1] + 1 + offsets[:-1]
            self._meta_positions = self._positions_list = None
            self.window_step = 0
        due = self.fills_at.pop(self.steps, None)
        self.steps += 1
        return due

    def take_filled(self, due: list[int]) -> FilledTails:
        """The tails of batch indices ``due`` that just filled (their rows written first); the
        caller publishes or stages them, then calls ``reopen``."""
        self.settle()
        idx = np.array(due, dtype=_I64)
        full = self.slots[idx]
        block_index = (self.positions[self.window_step][idx] // self.block_size - 1).tolist()
        return FilledTails(idx, full, self._table.tail[full].tolist(), block_index)

    def reopen(self, filled: FilledTails) -> None:
        """Open the next tail of every request whose tail filled (``take_filled``)."""
        bs = self.block_size
        fresh = self._pool.alloc(len(filled.slots))
        self._table.tail[filled.slots] = fresh
        j = self.window_step
        self.pool_rows[j:, filled.batch_index] = fresh * bs + self._offsets[: len(self.pool_rows) - j]  # the rest of the window
        self.fills_at.setdefault(self.steps + bs - 1, []).extend(filled.batch_index.tolist())

    def settle(self) -> None:
        """Write what lane steps held back (a no-op when nothing is)."""
        self._table.settle()

    def leave(self) -> None:
        """Write what is held back; tails opened ahead (nothing written yet) go back to the pool."""
        self.settle()
        ahead = np.flatnonzero(self.positions[self.window_step] % self.block_size == 0)
        if len(ahead):
            slots = self.slots[ahead]
            tail = self._table.tail
            self._pool.free(tail[slots])
            tail[slots] = -1

    def _write_held_back(self) -> None:
        """The rows not in the staging pool yet (one call for all of them) and the batch's
        cursors (capture, scheduled and emit, in one call); run by the table before any access."""
        self._table.cursors[self.slots] = self.positions[self.window_step][:, None]
        held = self._held_rows
        if not held:
            return
        q0, n = self.first_row, len(self.slots)
        token_rows = self._pool.token_rows
        if len(held) == 1:
            j, rows = held[0]
            token_rows[self.pool_rows[j]] = rows.reshape(len(rows), -1)[q0 : q0 + n]
        else:
            steps = [j for j, _ in held]
            stacked = np.stack([r.reshape(len(r), -1)[q0 : q0 + n] for _, r in held])  # [steps, n, row]
            token_rows[self.pool_rows[steps]] = stacked
        held.clear()
