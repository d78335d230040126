"""HeldRows: rows come back whole and in order, and old step buffers are never kept alive."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from auxout.connector.held_rows import HeldRows


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


def test_store_rows_gather_into_any_destination_and_join_with_arrays() -> None:
    """``StoreRows`` slices gather exactly, into contiguous and strided destinations alike."""
    from auxout.stores.rows import StoreRows, join_rows

    rng = np.random.default_rng(4)
    arena = rng.integers(0, 255, (6, 4, 3, 2), dtype=np.uint8)  # 6 slots of 4-row blocks
    slots = np.array([5, 0, 3], dtype=np.int64)
    whole = StoreRows(arena, slots)
    flat = arena[slots].reshape(12, 3, 2)
    for lo, hi in [(0, 12), (4, 8), (1, 11), (3, 3), (5, 12)]:
        part = whole[lo:hi]
        assert np.array_equal(np.asarray(part), flat[lo:hi])
        strided = np.zeros((hi - lo, 3, 4), dtype=np.uint8)[:, :, ::2]  # not C-contiguous
        part.copy_into(strided)
        assert np.array_equal(strided, flat[lo:hi])
    own = rng.integers(0, 255, (2, 3, 2), dtype=np.uint8)
    assert np.array_equal(join_rows([whole[2:9], own, whole[:1]]), np.concatenate([flat[2:9], own, flat[:1]]))
    assert np.array_equal(pickle.loads(pickle.dumps(whole[1:7])), flat[1:7])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.permutations(["a", "b", "c", "d"]).map(lambda p: p[:3])),
        st.tuples(st.just("step_same"), st.none()),
        st.tuples(st.just("add"), st.sampled_from("abcd")),
        st.tuples(st.just("pop"), st.sampled_from("abcd")),
        st.tuples(st.just("discard"), st.sampled_from("abcd")),
        st.tuples(st.just("contains"), st.sampled_from("abcd")),
    ),
    max_size=40,
)


@given(ops=ops, every=st.integers(2, 5))
def test_steps_held_whole_equal_one_row_per_request(ops: list, every: int) -> None:
    """``add_step`` (a decode step's rows held once) gives every request the rows, in the order,
    that one ``add`` per request gives, however steps mix with other calls."""
    whole, each = HeldRows(compact_every=every), HeldRows(compact_every=every)
    last: list[str] = ["a", "b", "c"]
    rng = np.random.default_rng(len(ops))
    for kind, arg in ops:
        if kind in ("step", "step_same"):
            ids = list(arg) if kind == "step" else last  # (step_same: the very list again, as a batch repeats)
            rows = rng.integers(0, 255, (len(ids), 2, 2)).astype(np.uint8)
            whole.add_step(ids, rows)
            for i, rid in enumerate(ids):
                each.add(rid, rows[i : i + 1])
            last = ids
        elif kind == "add":
            rows = rng.integers(0, 255, (2, 2, 2)).astype(np.uint8)
            whole.add(arg, rows)
            each.add(arg, rows)
        elif kind == "pop":
            got, want = whole.pop(arg), each.pop(arg)
            assert (got is None and want is None) or (got is not None and want is not None and np.array_equal(got, want))
        elif kind == "discard":
            whole.discard(arg)
            each.discard(arg)
        else:
            assert (arg in whole) == (arg in each)
    assert len(whole) == len(each)
    for rid in "abcd":
        got, want = whole.pop(rid), each.pop(rid)
        assert (got is None and want is None) or (got is not None and want is not None and np.array_equal(got, want))
    with pytest.raises(ValueError, match="2 rows for 3 requests"):
        whole.add_step(["a", "b", "c"], np.zeros((2, 2, 2), np.uint8))
