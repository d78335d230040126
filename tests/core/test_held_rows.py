"""HeldRows: rows come back whole and in order, and old step buffers are never kept alive."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from auxout.held_rows import HeldRows


@given(sizes=st.lists(st.integers(0, 5), max_size=40), every=st.integers(2, 6))
def test_pop_returns_every_row_in_order_and_only_recent_views_stay(sizes: list[int], every: int) -> None:
    held = HeldRows(compact_every=every)
    sources: list[np.ndarray] = []  # one "step buffer" per chunk; the chunk is a view into it
    for i, n in enumerate(sizes):
        buf = np.full((n + 3, 2, 2), i, dtype=np.uint8)
        sources.append(buf)
        held.add("r", buf[1 : 1 + n])
        pinned = [k for k, src in enumerate(sources) if any(np.shares_memory(c, src) for c in held._chunks["r"])]
        assert len(pinned) < every, f"{len(pinned)} step buffers still referenced (limit {every - 1})"
        assert all(k > i - every for k in pinned), "only the most recent chunks may stay views"
    got = held.pop("r")
    if not sizes:
        assert got is None
        return
    want = np.concatenate([np.full((n, 2, 2), i, dtype=np.uint8) for i, n in enumerate(sizes)])
    assert got is not None and got.dtype == np.uint8 and np.array_equal(got, want)
    assert "r" not in held and len(held) == 0


def test_requests_are_independent_and_discard_forgets() -> None:
    held = HeldRows(compact_every=2)
    a, b = np.zeros((2, 1, 1), np.uint8), np.ones((3, 1, 1), np.uint8)
    held.add("a", a)
    held.add("b", b)
    held.add("a", a + 5)
    held.discard("b")
    assert "b" not in held and held.pop("b") is None
    out = held.pop("a")
    assert out is not None and out[:, 0, 0].tolist() == [0, 0, 5, 5]
    with pytest.raises(ValueError, match="compact_every"):
        HeldRows(compact_every=1)
