"""The two messages between the payload-free scheduler side and the worker data plane."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from auxout.keys import PackedHashes

NO_EMIT = 1 << 62
"""Emit start of a request that opted out: its rows are captured and published, never emitted."""


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """Scheduler → worker, once per engine step (picklable, no payloads).

    ``requests`` maps every scheduled request to its emit start; ``block_hashes`` carries only
    hashes the worker has not seen (also for tracked requests not scheduled this step);
    ``finished`` lists terminal events (finish, abort, preemption), each delivered once.
    """

    generation: int
    requests: dict[str, int]
    block_hashes: dict[str, PackedHashes] = field(default_factory=dict)
    finished: tuple[str, ...] = ()


@dataclass(slots=True)
class StepOutput:
    """Worker → scheduler, once per executed step: one rows array plus per-request spans.

    Request ``req_ids[i]`` emitted ``rows[lo[i]:hi[i]]`` for positions starting at
    ``token_starts[i]``; ``lo[i] == -1`` means it emitted nothing this step. ``errors`` holds
    a message for requests whose routes could not be assembled (e.g. evicted prefix objects).
    """

    req_ids: list[str]
    token_starts: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    rows: np.ndarray
    errors: dict[str, str] = field(default_factory=dict)
    _index: dict[str, int] | None = None

    def index(self, request_id: str) -> int:
        """Position of ``request_id`` among emitting requests, or -1."""
        idx = self._index
        if idx is None:
            lo = self.lo.tolist()
            idx = self._index = {rid: i for i, rid in enumerate(self.req_ids) if lo[i] >= 0}
        return idx.get(request_id, -1)

    def rows_for(self, request_id: str) -> tuple[int, np.ndarray] | None:
        """``(token_start, rows)`` emitted for one request this step, or None."""
        i = self.index(request_id)
        if i < 0:
            return None
        return int(self.token_starts[i]), self.rows[int(self.lo[i]) : int(self.hi[i])]
