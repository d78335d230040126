"""A step the worker connector registered (``PendingStep``) and the checks and cuts made on it.

Most of a step commits as one batch. A request whose rows cannot continue its capture (capture
moved backwards, a gap no rejected draft explains, a first capture off a hash-block boundary) or
that holds rows no router can produce is committed apart: ``without`` cuts it out of the step,
the rest commits as usual, and ``rejoin`` puts the batch's output back in the step's order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from auxout.connector.messages import StepOutput
from auxout.errors import InvariantError

_I64 = np.int64


@dataclass(slots=True)
class PendingStep:
    """One executed step whose output has not been processed yet (explicit handles only)."""

    seq: int
    req_ids: list[str]
    slots: np.ndarray  # the requests' request slots (``SlotTable``)
    token_starts: np.ndarray
    query_start_loc: np.ndarray
    rows: np.ndarray
    impossible: np.ndarray | None = None  # rows no router can produce (``row_check``): their requests fail


def row_ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flattened ``(segment index, offset)`` for segments ``[starts[i], starts[i]+counts[i])``."""
    total = int(counts.sum())
    if total == len(counts) and np.count_nonzero(counts == 1) == total:  # decode: one row per segment
        return np.arange(total, dtype=_I64), np.zeros(total, dtype=_I64)
    before = np.zeros(len(counts), dtype=_I64)  # (exclusive cumulative sum)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=before[1:])
    seg = np.repeat(np.arange(len(counts), dtype=_I64), counts)
    off = np.arange(total, dtype=_I64) - np.repeat(before, counts)
    return seg, off


def check_counts(p: PendingStep, n_exec: np.ndarray, rejected: np.ndarray) -> None:
    """Every request executed a positive number of tokens and rejected at most that many."""
    # np.count_nonzero, not .any(): a quarter of the cost on a step-sized array
    if not np.count_nonzero((n_exec <= 0) | (rejected < 0) | (rejected > n_exec)):
        return
    bad = n_exec <= 0
    if bad.any():
        i = int(np.argmax(bad))
        raise InvariantError(f"request {p.req_ids[i]!r} executed {int(n_exec[i])} tokens; must be positive")
    bad = (rejected < 0) | (rejected > n_exec)
    if bad.any():
        i = int(np.argmax(bad))
        raise InvariantError(
            f"rejected-token count {int(rejected[i])} is invalid for request {p.req_ids[i]!r} "
            f"which executed {int(n_exec[i])} tokens"
        )


def broken_capture_reasons(
    p: PendingStep, broken: np.ndarray, fresh: np.ndarray, cur: np.ndarray, block_size: int
) -> dict[int, str]:
    """Why each request ``broken`` cannot continue its capture (``cur``: its capture cursor)."""
    reasons: dict[int, str] = {}
    ts = p.token_starts
    for i in np.flatnonzero(broken).tolist():
        t, c = int(ts[i]), int(cur[i])
        if t < c:
            why = f"capture moved backwards: step starts at {t}, rows up to {c} were already captured"
        elif fresh[i]:
            why = f"capture is not contiguous: first rows start at {t}, not a multiple of the hash block size {block_size}"
        else:
            why = f"capture has an unbacked token gap: step starts at {t}, capture cursor {c} is not inside a rejected draft range"
        reasons[i] = f"InvariantError: {why}"
    return reasons


def impossible_reasons(p: PendingStep, reason: Callable[[np.ndarray, int], str]) -> dict[int, str]:
    """The requests holding rows flagged in ``p.impossible``, each with its first bad row's
    ``reason(rows, row)`` (``RowCheck.reason``)."""
    assert p.impossible is not None
    q = p.query_start_loc
    n = len(p.req_ids)
    bad_rows = np.flatnonzero(p.impossible[: int(q[n])])
    owner = np.searchsorted(q[1 : n + 1], bad_rows, side="right")  # request of each bad row
    reasons: dict[int, str] = {}
    for row, i in zip(bad_rows.tolist(), owner.tolist()):
        if i not in reasons:
            position = int(p.token_starts[i]) + row - int(q[i])
            reasons[i] = (
                f"impossible routes at capture (token position {position}): "
                f"{reason(p.rows, row)}; not stored, not returned"
            )
    return reasons


def without(p: PendingStep, keep: np.ndarray) -> PendingStep:
    """The step cut down to the requests ``keep`` (indices, in order): their rows copied together."""
    qs = p.query_start_loc[:-1][keep]
    counts = p.query_start_loc[1:][keep] - qs
    seg, off = row_ranges(qs, counts)
    return PendingStep(
        p.seq, [p.req_ids[i] for i in keep.tolist()], p.slots[keep], p.token_starts[keep],
        np.concatenate([[0], np.cumsum(counts)]).astype(_I64), p.rows[qs[seg] + off],
    )  # fmt: skip


def rejoin(p: PendingStep, keep: np.ndarray, out: StepOutput | None, errors: dict[str, str]) -> StepOutput:
    """The whole step's output from the output of ``without(p, keep)`` (None: nothing kept) and
    the errors of the requests committed apart (they emit nothing)."""
    n = len(p.req_ids)
    lo = np.full(n, -1, dtype=_I64)
    hi = np.full(n, -1, dtype=_I64)
    starts = p.token_starts.copy()
    if out is None:
        return StepOutput(list(p.req_ids), starts, lo, hi, p.rows[:0], errors)
    starts[keep], lo[keep], hi[keep] = out.token_starts, out.lo, out.hi
    return StepOutput(
        list(p.req_ids), starts, lo, hi, out.rows, {**out.errors, **errors}, out.published, out.lost, out.heads
    )
