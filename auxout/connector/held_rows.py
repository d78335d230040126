"""Route chunks held per request until it finishes, without pinning the engine's step buffers.

The chunks ``SchedulerConnector.take_output_parts`` returns are views: of a step's row snapshot,
of a recycled output buffer shared with other requests, or ``StoreRows`` still in the store's
arena (gathered by the join). An engine that hands routes over only when
a request finishes (vLLM's frontend does) must hold them meanwhile, and a long request holding
one view per step would keep every one of those buffers alive (a 3 MiB prefill snapshot for a
single row) and stop the worker from reusing its output buffers. So every ``compact_every``
chunks the trailing views are copied into one array: at most ``compact_every - 1`` views stay
alive per request, and each row is copied O(1) times in total.

A decode step gives every request of the batch one row. ``add_step`` holds that step's rows
array once, not one view per request: while the same batch keeps decoding, each step costs one
list append, and the steps are split into per-request chunks (one stack, one chunk per request)
only when the batch changes, when ``compact_every`` steps have gathered, or when anything else
reads or adds.
"""

from __future__ import annotations

import numpy as np

from auxout.stores.rows import StoreRows, join_rows


class HeldRows:
    """``request_id -> chunks``; ``pop`` returns them as one array."""

    def __init__(self, compact_every: int = 64) -> None:
        if compact_every < 2:
            raise ValueError(f"HeldRows compact_every must be >= 2, got {compact_every!r}")
        self.compact_every = compact_every
        self._chunks: dict[str, list[np.ndarray | StoreRows]] = {}
        self._views: dict[str, int] = {}  # trailing chunks that are still views
        self._run_ids: list[str] | None = None  # the batch of the steps held whole, in row order
        self._run_rows: list[np.ndarray] = []  # one [len(_run_ids), ...] rows array per step

    def __contains__(self, request_id: str) -> bool:
        self._split_run()
        return request_id in self._chunks

    def __len__(self) -> int:
        self._split_run()
        return len(self._chunks)

    def add_step(self, request_ids: list[str], rows: np.ndarray) -> None:
        """Hold one row per request: ``request_ids[i]`` gets ``rows[i]`` (a decode step's rows).

        ``request_ids`` must not be mutated afterwards (a step output's list is not)."""
        if len(rows) != len(request_ids):
            raise ValueError(f"add_step got {len(rows)} rows for {len(request_ids)} requests")
        run = self._run_ids
        if run is not None and len(self._run_rows) < self.compact_every and (request_ids is run or request_ids == run):
            self._run_rows.append(rows)
            return
        self._split_run()
        self._run_ids = request_ids
        self._run_rows = [rows]

    def _split_run(self) -> None:
        """Hand the steps held whole to their requests: one chunk each, views of one stacked array."""
        ids = self._run_ids
        if ids is None:
            return
        steps = self._run_rows
        self._run_ids = None
        self._run_rows = []
        block = steps[0][:, None] if len(steps) == 1 else np.stack(steps, axis=1)  # [requests, steps, ...]
        add = self._add
        for rid, rows in zip(ids, block):
            add(rid, rows)

    def add(self, request_id: str, rows: np.ndarray | StoreRows) -> None:
        """Hold one chunk (a view, or ``StoreRows`` gathered when joined)."""
        if self._run_ids is not None:
            self._split_run()
        self._add(request_id, rows)

    def _add(self, request_id: str, rows: np.ndarray | StoreRows) -> None:
        chunks = self._chunks.get(request_id)
        if chunks is None:
            self._chunks[request_id] = [rows]
            self._views[request_id] = 1
            return
        chunks.append(rows)
        views = self._views[request_id] + 1
        if views >= self.compact_every:
            chunks[-views:] = [join_rows(chunks[-views:])]
            views = 0
        self._views[request_id] = views

    def pop(self, request_id: str) -> np.ndarray | None:
        """All rows held for the request, in order (None if nothing was held); forgets it."""
        if self._run_ids is not None:
            self._split_run()
        self._views.pop(request_id, None)
        chunks = self._chunks.pop(request_id, None)
        if not chunks:
            return None
        return join_rows(chunks)

    def discard(self, request_id: str) -> None:
        if self._run_ids is not None:
            self._split_run()
        self._views.pop(request_id, None)
        self._chunks.pop(request_id, None)
