"""Route chunks held per request until it finishes, without pinning the engine's step buffers.

The chunks ``SchedulerConnector.take_output_parts`` returns are views: of a step's row snapshot,
of a recycled output buffer shared with other requests, or ``StoreRows`` still in the store's
arena (gathered by the join). An engine that hands routes over only when
a request finishes (vLLM's frontend does) must hold them meanwhile, and a long request holding
one view per step would keep every one of those buffers alive (a 3 MiB prefill snapshot for a
single row) and stop the worker from reusing its output buffers. So every ``compact_every``
chunks the trailing views are copied into one array: at most ``compact_every - 1`` views stay
alive per request, and each row is copied O(1) times in total.
"""

from __future__ import annotations

import numpy as np

from auxout.store_rows import StoreRows, join_rows


class HeldRows:
    """``request_id -> chunks``; ``pop`` returns them as one array."""

    def __init__(self, compact_every: int = 64) -> None:
        if compact_every < 2:
            raise ValueError(f"HeldRows compact_every must be >= 2, got {compact_every!r}")
        self.compact_every = compact_every
        self._chunks: dict[str, list[np.ndarray | StoreRows]] = {}
        self._views: dict[str, int] = {}  # trailing chunks that are still views

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def add(self, request_id: str, rows: np.ndarray | StoreRows) -> None:
        """Hold one chunk (a view, or ``StoreRows`` gathered when joined)."""
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
        self._views.pop(request_id, None)
        chunks = self._chunks.pop(request_id, None)
        if not chunks:
            return None
        return join_rows(chunks)

    def discard(self, request_id: str) -> None:
        self._views.pop(request_id, None)
        self._chunks.pop(request_id, None)
