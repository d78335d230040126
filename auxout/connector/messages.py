"""The two messages between the payload-free scheduler side and the worker data plane."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from auxout.keys import PackedHashes
from auxout.stores.rows import StoreRows, join_rows

_RAW_ROWS_BELOW = 1 << 16
"""A step's rows smaller than this are pickled as raw bytes (a decode step's: numpy's own array
pickling costs more than the copy); larger ones as the array (``benchmarks/probes/step_messages.py``)."""

_ARANGE = np.arange(1 << 14, dtype=np.int64)
_ARANGE.flags.writeable = False  # (lo/hi of unpickled one-row steps are views of it: never written)
_COLUMNS = frozenset(("token_starts", "lo", "hi"))

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

    def __reduce__(self) -> tuple:  # (sent every step: positional, without the slots-state dance)
        return StepMetadata, (self.generation, self.requests, self.block_hashes, self.finished, self.final_hashes)


@dataclass(slots=True)
class StepOutput:
    """Worker → scheduler, once per executed step: one rows array plus per-request spans.

    Request ``req_ids[i]`` emitted rows ``lo[i]:hi[i]`` of ``rows`` (the step's snapshot, never
    copied) for positions starting at ``token_starts[i]``; ``lo[i] == -1`` means it emitted
    nothing this step. A request in ``heads`` emitted rows from before the step first (e.g. its
    cached prefix): ``heads[rid] = (head, own)``, the head read back from the store (an array,
    or ``StoreRows`` still in an in-process store's arena), then its own rows from ``rows[own]``,
    uncopied; its span lies past ``rows`` as if those followed the head (read it with
    ``span_rows``). ``errors`` holds a message for requests whose routes could not be assembled
    (e.g. evicted prefix objects): the engine recomputes them. ``published``/``lost`` report the
    store keys written and lost (evicted, dropped, found missing) since the previous output, for
    the scheduler's ``RouteIndex``.
    """

    req_ids: list[str]
    token_starts: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    rows: np.ndarray
    errors: dict[str, str] = field(default_factory=dict)
    published: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    heads: dict[str, tuple[np.ndarray | StoreRows, int]] = field(default_factory=dict)
    # ``token_starts`` as a list, set (by the worker's decode lane) only when request ``i``
    # emitted exactly row ``i`` (``lo[i] == i``, ``hi[i] == i + 1``): the scheduler then takes
    # the step without numpy (``SchedulerConnector.take_step``), and the step's wire form sends
    # the token starts alone (``lo``/``hi`` are rebuilt as ``arange``)
    one_row_starts: list[int] | None = None
    # ``(generation, weights digest)`` on the first output after the worker named a generation
    # by the weights it runs (``KeySpace.weights``): the scheduler keys that generation the same way
    weights: tuple[int, str] | None = None
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
        return sp[0], join_rows(rows) if isinstance(rows, list) else rows

    def span_rows(self, request_id: str, lo: int, hi: int) -> np.ndarray | list[np.ndarray | StoreRows]:
        """Rows ``lo:hi`` of a request's span: one view of ``rows``, or the parts to join in
        order (a head, then own rows; a head may be ``StoreRows``: ``auxout.stores.rows.join_rows``)."""
        n = len(self.rows)
        if hi <= n:
            return self.rows[lo:hi]
        head, own = self.heads[request_id]
        x, y = lo - n, hi - n  # offsets into the request's head + own rows
        n_head = len(head)
        if y <= n_head:
            return [head[x:y]]
        if x >= n_head:
            return self.rows[own + x - n_head : own + y - n_head]
        return [head[x:] if x else head, self.rows[own : own + y - n_head]]

    def __getstate__(self) -> tuple:
        # Sent once per step between processes (the mp executor pickles it with the model
        # runner's output), and unpickled cold in the engine core, where each numpy call costs
        # several microseconds (benchmarks/probes/step_messages.py): the int columns go as one raw bytes
        # object, small rows as raw bytes (numpy's own array pickling costs more than the copy),
        # a builtin dtype as its string. A one-row step (the decode lane's) sends its token starts
        # as the list it has, and its columns are built only if read (``__getattr__``).
        heads = self.heads
        if heads:  # rows still in an in-process store go as arrays (StoreRows pickles as one)
            heads = {rid: (h if type(h) is np.ndarray else np.asarray(h), own) for rid, (h, own) in heads.items()}
        one_row = self.one_row_starts
        cols = None if one_row is not None else (
            np.concatenate([self.token_starts, self.lo, self.hi], dtype=np.int64, casting="safe").tobytes()
        )  # fmt: skip
        rows = self.rows
        dtype = rows.dtype
        # (a large array pickles best as itself: one copy each way, where bytes would add one)
        data = rows.tobytes() if rows.nbytes < _RAW_ROWS_BELOW else rows
        return (
            self.req_ids, cols, dtype.str if dtype.isbuiltin else dtype, rows.shape, data, self.errors,
            self.published, self.lost, heads, one_row, self.weights,
        )  # fmt: skip

    def __setstate__(self, state: tuple) -> None:
        (
            self.req_ids, cols, dtype, shape, rows, self.errors, self.published, self.lost, self.heads,
            self.one_row_starts, self.weights,
        ) = state  # fmt: skip
        if cols is not None:
            n = len(self.req_ids)
            ints = np.frombuffer(cols, dtype=np.int64)  # (read-only views: a step output is never written to)
            self.token_starts, self.lo, self.hi = ints[:n], ints[n : 2 * n], ints[2 * n :]
        # (else left unset: ``__getattr__`` builds them from ``one_row_starts`` if they are read)
        self.rows = np.ndarray(shape, dtype, rows) if type(rows) is bytes else rows  # (read-only: over bytes)
        self._spans = None

    def __getattr__(self, name: str) -> np.ndarray:
        """The int columns of an unpickled one-row step, built when first read (the bridge's
        decode path reads only ``one_row_starts``)."""
        one_row = self.one_row_starts if name in _COLUMNS else None
        if one_row is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        n = len(one_row)
        spans = _ARANGE if n < len(_ARANGE) else np.arange(n + 1, dtype=np.int64)
        self.token_starts, self.lo, self.hi = np.array(one_row, dtype=np.int64), spans[:n], spans[1 : n + 1]
        self.token_starts.flags.writeable = False
        return getattr(self, name)
