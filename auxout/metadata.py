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
    ``finished`` lists terminal events (finish, abort, preemption, restart for a recompute),
    each delivered once, with ``final_hashes`` found after the request's last schedule. Terminal
    events apply first: a request may end one incarnation and start the next in the same step.
    """

    generation: int
    requests: dict[str, int]
    block_hashes: dict[str, PackedHashes] = field(default_factory=dict)
    finished: tuple[str, ...] = ()
    final_hashes: dict[str, PackedHashes] = field(default_factory=dict)


@dataclass(slots=True)
class StepOutput:
    """Worker → scheduler, once per executed step: one rows array plus per-request spans.

    Request ``req_ids[i]`` emitted rows ``lo[i]:hi[i]`` of ``rows`` followed by ``extra``
    (``rows`` is the step's snapshot, never copied; ``extra`` holds rows assembled from before
    the step, e.g. a cached prefix) for positions starting at ``token_starts[i]``; ``lo[i] == -1``
    means it emitted nothing this step. A request in ``heads`` emitted rows from before the step
    (read back into ``extra``) and then its own rows, which stay in the snapshot, uncopied
    (``span_rows``). ``errors`` holds a message for requests whose routes
    could not be assembled (e.g. evicted prefix objects): the engine recomputes them.
    ``published``/``lost`` report the store keys written and lost (evicted, dropped, found
    missing) since the previous output, for the scheduler's ``RouteIndex``.
    """

    req_ids: list[str]
    token_starts: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    rows: np.ndarray
    errors: dict[str, str] = field(default_factory=dict)
    extra: np.ndarray | None = None
    published: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    heads: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    _spans: dict[str, tuple[int, int, int]] | None = None

    def span_map(self) -> dict[str, tuple[int, int, int]]:
        """``request_id -> (token_start, lo, hi)`` for requests that emitted (plain ints, built once)."""
        spans = self._spans
        if spans is None:
            triples = zip(self.token_starts.tolist(), self.lo.tolist(), self.hi.tolist())
            if np.count_nonzero(self.lo >= 0) == len(self.lo):  # every request emitted (decode): built in C
                spans = dict(zip(self.req_ids, triples))
            else:
                spans = {rid: t for rid, t in zip(self.req_ids, triples) if t[1] >= 0}
            self._spans = spans
        return spans

    def span(self, request_id: str) -> tuple[int, int, int] | None:
        """``(token_start, lo, hi)`` of what ``request_id`` emitted this step, or None."""
        return self.span_map().get(request_id)

    def rows_for(self, request_id: str) -> tuple[int, np.ndarray] | None:
        """``(token_start, rows)`` emitted for one request this step, or None (a head is joined on)."""
        sp = self.span(request_id)
        if sp is None:
            return None
        rows = self.span_rows(request_id, sp[1], sp[2])
        return sp[0], np.concatenate(rows) if isinstance(rows, list) else rows

    def slice(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` of ``rows`` followed by ``extra`` (a span never straddles the two; not
        for the span of a request in ``heads``, see ``span_rows``)."""
        n = len(self.rows)
        if hi <= n:
            return self.rows[lo:hi]
        assert self.extra is not None
        return self.extra[lo - n : hi - n]

    def span_rows(self, request_id: str, lo: int, hi: int) -> np.ndarray | list[np.ndarray]:
        """Rows ``lo:hi`` of a request's span: one view, or two for a head followed by own rows.

        The span of a request in ``heads`` counts as if its own rows followed its head in
        ``extra`` (so it lies past ``rows``, and ``hi - lo`` is its length); ``heads[rid] = (a,
        b, own)``: the head is ``extra[a:b]``, its own rows start at ``rows[own]``.
        """
        head = self.heads.get(request_id) if self.heads else None
        n = len(self.rows)
        if head is None or hi <= n:
            return self.slice(lo, hi)
        assert self.extra is not None
        a, b, own = head
        lo, hi = lo - n - a, hi - n - a  # offsets into the request's head + own rows
        n_head = b - a
        if hi <= n_head:
            return self.extra[a + lo : a + hi]
        if lo >= n_head:
            return self.rows[own + lo - n_head : own + hi - n_head]
        return [self.extra[a + lo : b], self.rows[own : own + hi - n_head]]

    def __getstate__(self) -> tuple:
        return (
            self.req_ids, self.token_starts, self.lo, self.hi, self.rows, self.errors, self.extra,
            self.published, self.lost, self.heads,
        )  # fmt: skip

    def __setstate__(self, state: tuple) -> None:
        (
            self.req_ids, self.token_starts, self.lo, self.hi, self.rows, self.errors, self.extra,
            self.published, self.lost, self.heads,
        ) = state  # fmt: skip
        self._spans = None
