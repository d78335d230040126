"""RouteTrace: stitching checks, layouts that round-trip, and rows that stay with their tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VOCAB, build_tiny
from hypothesis import given, settings
from hypothesis import strategies as st

from auxout.trainer import (
    RouteTrace,
    RouteTraceError,
    Turn,
    from_megatron,
    pack,
    pad_batch,
    to_megatron,
    unpack,
    unpad_batch,
)
from auxout.trainer.hf import RouteRecorder, capture_routes, replay

L, K = 3, 2


def _trace_for(tokens: np.ndarray, prompt_len: int) -> RouteTrace:
    """Routes derived from the token ids themselves, so a row that moves away from its token is visible."""
    s = len(tokens)
    rows = (tokens[:, None, None] * 7 + np.arange(L)[None, :, None] * 3 + np.arange(K)[None, None, :]) % 1000
    return RouteTrace.from_output(tokens[:prompt_len], tokens[prompt_len:], rows[: s - 1])


def _expected_rows(tokens: np.ndarray) -> np.ndarray:
    return (tokens[:, None, None] * 7 + np.arange(L)[None, :, None] * 3 + np.arange(K)[None, None, :]) % 1000


samples = st.lists(
    st.tuples(st.lists(st.integers(0, 50_000), min_size=2, max_size=40), st.integers(0, 40)),
    min_size=1, max_size=5,
)


def _traces(data) -> list[RouteTrace]:
    return [_trace_for(np.array(toks), min(p, len(toks))) for toks, p in data]


@settings(max_examples=60, deadline=None)
@given(samples, st.sampled_from(["left", "right"]))
def test_padded_layout_round_trips(data, side):
    traces = _traces(data)
    ids, mask, routes = pad_batch(traces, side=side)
    assert routes.dtype == np.int16 and (routes[mask == 0] == -1).all()
    back = unpad_batch(routes, mask)
    for t, r, row_ids, m in zip(traces, back, ids, mask):
        np.testing.assert_array_equal(r, t.routes)
        toks = row_ids[m.astype(bool)]
        np.testing.assert_array_equal(toks, t.tokens)
        # every covered row is the one computed from its own token
        np.testing.assert_array_equal(r[:-1], _expected_rows(toks)[:-1])
        assert (r[-1] == -1).all()


@settings(max_examples=60, deadline=None)
@given(samples)
def test_packed_and_megatron_layouts_round_trip(data):
    traces = _traces(data)
    ids, pos, cu, routes = pack(traces)
    assert cu[-1] == len(ids) == len(routes) and (pos[cu[:-1]] == 0).all()
    np.testing.assert_array_equal(from_megatron(to_megatron(routes)), routes)
    assert len(to_megatron(routes)) == L and to_megatron(routes)[0].shape == (len(ids), K)
    for t, r, i in zip(traces, unpack(routes, cu), range(len(traces))):
        np.testing.assert_array_equal(r, t.routes)
        np.testing.assert_array_equal(ids[cu[i] : cu[i + 1]], t.tokens)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 999), min_size=3, max_size=60), st.data())
def test_per_sample_and_truncation(tokens, data):
    toks = np.array(tokens)
    p = data.draw(st.integers(0, len(toks)))
    t = _trace_for(toks, p)
    np.testing.assert_array_equal(t.per_sample(), _expected_rows(toks)[:-1])
    assert t.response_mask.sum() == len(toks) - p
    n = data.draw(st.integers(1, len(toks)))
    tr = t.truncate(n)
    assert len(tr.tokens) == n and tr.prompt_len == min(p, n)
    np.testing.assert_array_equal(tr.routes[: min(n, len(toks) - 1)], _expected_rows(toks)[: min(n, len(toks) - 1)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(2, 8), st.data())
def test_multi_turn_stitching(extra_per_turn, first_len, data):
    """Turn k re-sends turn k-1's tokens plus new ones and returns rows from prompt_start = len(prev) - 1."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    grown = [first_len, *(np.cumsum(extra_per_turn) + first_len)]
    all_tokens = rng.integers(0, 1000, grown[-1])
    full = _expected_rows(all_tokens)
    turns, prev_len = [], 0
    for n in grown:
        start = max(prev_len - 1, 0)
        turns.append(Turn(all_tokens[:n], full[start : n - 1], start))
        prev_len = n
    t = RouteTrace.stitch(turns)
    t.check_complete()
    np.testing.assert_array_equal(t.per_sample(), full[:-1])


def test_stitch_refuses_misalignment():
    toks = (np.arange(20) * 13) % 97
    rows = _expected_rows(toks)
    good = [Turn(toks[:8], rows[:7], 0), Turn(toks[:20], rows[7:19], 7)]
    RouteTrace.stitch(good).check_complete()
    # server ignored prompt_start and returned the full history again: row count is off
    with pytest.raises(RouteTraceError, match="ignored prompt_start"):
        RouteTrace.stitch([good[0], Turn(toks[:20], rows[:19], 7)])
    # re-templated history: turn 1 tokens do not extend turn 0's
    bad = toks[:20].copy()
    bad[3] += 1
    with pytest.raises(RouteTraceError, match="first difference at position 3"):
        RouteTrace.stitch([good[0], Turn(bad, rows[7:19], 7)])
    # gap and double count
    with pytest.raises(RouteTraceError, match="gap"):
        RouteTrace.stitch([good[0], Turn(toks[:20], rows[9:19], 9)])
    with pytest.raises(RouteTraceError, match="double count"):
        RouteTrace.stitch([good[0], Turn(toks[:20], rows[5:19], 5)])
    ok = RouteTrace.stitch([good[0], Turn(toks[:20], rows[5:19], 5)], allow_overlap=True)
    np.testing.assert_array_equal(ok.per_sample(), rows[:19])
    shifted = rows[4:18]
    with pytest.raises(RouteTraceError, match="disagree"):
        RouteTrace.stitch([good[0], Turn(toks[:20], shifted, 5)], allow_overlap=True)
    # engine returned S rows instead of S-1
    with pytest.raises(RouteTraceError, match="S rows instead of S-1"):
        RouteTrace.from_output(toks[:5], toks[5:], rows)
    with pytest.raises(RouteTraceError, match="integer dtype"):
        RouteTrace.from_output(toks[:5], toks[5:], rows[:-1].astype(float))
    # rows the engine returned from routed_experts_prompt_start: the skipped positions stay uncovered
    part = RouteTrace.from_output(toks[:12], toks[12:], rows[7:19], prompt_start=7)
    np.testing.assert_array_equal(part.per_sample()[7:], rows[7:19])
    assert not part.covered[:7].any() and part.covered[7:19].all() and (part.per_sample()[:7] == -1).all()
    with pytest.raises(RouteTraceError, match="7 positions have no routes, first at 0"):
        part.check_complete()
    with pytest.raises(RouteTraceError, match="S rows instead of S-1"):  # the start is still checked
        RouteTrace.from_output(toks[:12], toks[12:], rows[6:19], prompt_start=7)


@pytest.fixture(scope="module")
def qwen():
    return build_tiny("qwen3_moe")


def test_shift_with_same_length_is_caught_by_oracle_agreement(qwen):
    toks = np.random.default_rng(0).integers(3, VOCAB, 64)
    oracle = capture_routes(qwen, toks)
    t = RouteTrace.from_output(toks[:20], toks[20:], oracle[:-1])
    assert t.agreement(oracle) == 1.0
    shifted = np.concatenate([oracle[1:-1], oracle[:1]])  # off-by-one, same length
    ts = RouteTrace.from_output(toks[:20], toks[20:], shifted)
    assert ts.agreement(oracle) < 0.5


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_packed_replay_keeps_rows_with_tokens(arch):
    model = build_tiny(arch)
    rng = np.random.default_rng(1)
    traces = []
    for n in (11, 17, 6):
        toks = rng.integers(3, VOCAB, n)
        forced = np.argsort(rng.random((n - 1, 2, 8)), axis=-1)[..., :2]
        traces.append(RouteTrace.from_output(toks[:3], toks[3:], forced))
    ids, pos, cu, routes = pack(traces)
    with replay(model, routes) as ctx, RouteRecorder(model) as rec, torch.no_grad():
        packed = model(input_ids=torch.from_numpy(ids)[None], position_ids=torch.from_numpy(pos)[None],
                       use_cache=False).logits[0]
    assert ctx.fallback_count == 2 * len(traces)  # (token, layer) rows: last token of each sample, 2 layers
    used = unpack(rec.routes(), cu)
    for t, u, lo, hi in zip(traces, used, cu[:-1], cu[1:]):
        np.testing.assert_array_equal(u[:-1], t.per_sample())
        with replay(model, t.for_forward()), torch.no_grad():
            alone = model(input_ids=torch.from_numpy(t.tokens)[None], use_cache=False).logits[0]
        torch.testing.assert_close(packed[lo:hi], alone, atol=2e-5, rtol=1e-4)


def test_pad_batch_and_truncate_name_their_bad_argument():
    tr = _trace_for(np.arange(3, 13), 4)
    for dtype in (np.uint8, np.uint16, np.float32):  # (-1 padding: numpy's OverflowError before)
        with pytest.raises(RouteTraceError, match=r"dtype must be a signed integer type"):
            pad_batch([tr], dtype=dtype)
    assert pad_batch([tr], dtype=np.int8)[2].dtype == np.int8
    for bad in (-1, 2.5, True):
        with pytest.raises(RouteTraceError, match=rf"max_len must be a non-negative int, got {bad!r}"):
            tr.truncate(bad)  # type: ignore[arg-type]
    assert len(tr.truncate(0).tokens) == 0 and len(tr.truncate(99).tokens) == 10
    for dtype in (np.uint8, np.float32):  # pack pads nothing, but uncovered rows are -1 (uint8: 255)
        with pytest.raises(RouteTraceError, match=r"dtype must be a signed integer type"):
            pack([tr], dtype=dtype)
    for cu in (np.array([]), np.array([[0, 9]]), np.array([0.0, 9.0])):
        with pytest.raises(RouteTraceError, match="cu_seqlens must be a non-empty 1-D integer array"):
            unpack(tr.routes, cu)
    toks, rows = tr.tokens, tr.routes[:-1]
    for bad in (1.7, True, "1", None):  # (1.7 became 1: every row one position off)
        with pytest.raises(RouteTraceError, match=f"prompt_start must be an integer position, got {bad!r}"):
            RouteTrace.from_output(toks[:4], toks[4:], rows[1:], prompt_start=bad)  # type: ignore[arg-type]
        with pytest.raises(RouteTraceError, match="turn 0 prompt_start must be an integer"):
            RouteTrace.stitch([(toks, rows[1:], bad)])
    assert RouteTrace.from_output(toks[:4], toks[4:], rows[1:], prompt_start=np.int64(1)).covered[1:-1].all()
