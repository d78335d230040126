"""The two per-step messages survive the trip to another process exactly (their own pickling)."""

from __future__ import annotations

import pickle
from dataclasses import fields

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from auxout.connector.messages import StepMetadata, StepOutput
from auxout.keys import PackedHashes
from auxout.profile import RouteProfile


@given(
    n=st.integers(0, 6),
    extra_rows=st.integers(0, 5),
    experts=st.sampled_from([8, 300]),
    weights=st.booleans(),
    seed=st.integers(0, 2**16),
    with_head=st.booleans(),
    one_row=st.booleans(),
)
def test_step_output_round_trips_every_field(
    n: int, extra_rows: int, experts: int, weights: bool, seed: int, with_head: bool, one_row: bool
) -> None:
    rng = np.random.default_rng(seed)
    prof = RouteProfile(num_layers=2, top_k=3, num_experts=experts, weights=weights)
    rows = prof.empty(n + extra_rows)
    rows.view(np.uint8)[...] = rng.integers(0, 256, rows.view(np.uint8).shape, dtype=np.uint8)
    ids = [f"r{i}" for i in range(n)]
    starts = rng.integers(0, 1000, n)
    lo = np.arange(n) if one_row else np.where(rng.random(n) < 0.3, -1, np.arange(n))
    hi = np.where(lo < 0, -1, lo + 1)
    heads = {ids[0]: (rows[:2].copy(), 0)} if with_head and n and not one_row else {}
    out = StepOutput(ids, starts, lo, hi, rows, {"x": "gone"}, ["k1"], ["k2"], heads)
    if one_row:  # (a lane step: request i emitted row i only; its wire form sends the starts alone)
        out.one_row_starts = starts.tolist()
    if seed % 2:  # (the first output of a generation named by the weights)
        out.weights = (seed, "abc123")
    back = pickle.loads(pickle.dumps(out, protocol=5))
    assert back.one_row_starts == out.one_row_starts and back.weights == out.weights
    assert back.req_ids == ids and back.errors == {"x": "gone"} and back.published == ["k1"] and back.lost == ["k2"]
    for name in ("token_starts", "lo", "hi"):
        got, want = getattr(back, name), getattr(out, name)
        assert got.dtype == np.int64 and np.array_equal(got, want), name
    assert back.rows.dtype == rows.dtype and back.rows.shape == rows.shape
    assert back.rows.tobytes() == rows.tobytes()
    assert back.span_map() == out.span_map()
    assert back.heads.keys() == heads.keys()
    for rid, (head, own) in heads.items():
        assert back.heads[rid][1] == own and back.heads[rid][0].tobytes() == head.tobytes()
    checked = {"req_ids", "token_starts", "lo", "hi", "rows", "errors", "published", "lost", "heads", "one_row_starts", "weights"}
    assert {f.name for f in fields(StepOutput)} - {"_spans"} == checked, "a new field needs its round trip checked here"


def test_step_metadata_round_trips() -> None:
    meta = StepMetadata(
        3, {"a": 0, "b": 17}, {"a": PackedHashes.pack([b"x" * 32, b"y" * 32])}, ("c",), {"c": PackedHashes.pack([b"z" * 32])}
    )
    back = pickle.loads(pickle.dumps(meta, protocol=5))
    assert back == meta and list(back.block_hashes["a"]) == [b"x" * 32, b"y" * 32]


def test_a_large_step_output_round_trips_as_an_array() -> None:
    prof = RouteProfile(num_layers=4, top_k=8, num_experts=300)  # uint16: 64 B per row
    rows = np.random.default_rng(1).integers(0, 300, (4096, 4, 8)).astype(prof.dtype)
    assert rows.nbytes >= 1 << 16  # (past the raw-bytes threshold)
    q = np.arange(0, 4097, 1024, dtype=np.int64)
    out = StepOutput(["a", "b", "c", "d"], np.zeros(4, np.int64), q[:4], q[1:], rows)
    back = pickle.loads(pickle.dumps(out, protocol=5))
    assert back.rows.dtype == rows.dtype and np.array_equal(back.rows, rows)
    assert back.span_map() == out.span_map()


def test_a_one_row_step_larger_than_the_shared_arange_round_trips() -> None:
    n = (1 << 14) + 3  # (unpickled lo/hi are views of a shared arange up to its length)
    prof = RouteProfile(num_layers=1, top_k=2, num_experts=8)
    rows = prof.empty(n)
    starts = np.arange(n, dtype=np.int64) * 3
    q = np.arange(n + 1, dtype=np.int64)
    out = StepOutput([f"r{i}" for i in range(n)], starts, q[:n], q[1:], rows, one_row_starts=starts.tolist())
    back = pickle.loads(pickle.dumps(out, protocol=5))
    assert np.array_equal(back.lo, q[:n]) and np.array_equal(back.hi, q[1:]) and back.one_row_starts == out.one_row_starts
