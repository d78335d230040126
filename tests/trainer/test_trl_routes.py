"""auxout.trainer.trl without an engine: per-sample checks, turn stitching and TRL's batch layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from auxout.trainer.hf import MoELayer, MoELayers
from auxout.trainer.trl import RolloutRoutesError, _Request, batch_routes, check_sample_routes, stitch_sample

L, K, E = 2, 2, 8


def _layers() -> MoELayers:
    return MoELayers(tuple(MoELayer(i, i, nn.Identity(), nn.Identity(), "softmax_topk", f"layers.{i}.mlp.gate")
                           for i in range(L)), E, K, L)


def _routes(rng: np.random.Generator, rows: int) -> np.ndarray:
    return np.argsort(rng.random((rows, L, E)), axis=-1)[..., :K].astype(np.uint8)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda r: r[:-1], r"sample 3 \(9 tokens\): 7 route rows, expected 8"),
        (lambda r: np.concatenate([r, r[:1]]), r"sample 3 \(9 tokens\): 9 route rows, expected 8"),
        (lambda r: r[:, :1], r"sample 3 .*1 layers, the model has 2 MoE layers"),
        (lambda r: np.concatenate([r, r], axis=2), r"sample 3 .*top-k 4, the model routes top_k=2"),
        (lambda r: r.astype(np.float32), r"sample 3 .*integer dtype"),
        (lambda r: r[0], r"sample 3 .*shape"),
    ],
)
def test_sample_shape_problems_name_the_sample(corrupt, message):
    r = _routes(np.random.default_rng(0), 8)
    with pytest.raises(RolloutRoutesError, match=message):
        check_sample_routes(3, np.arange(9), corrupt(r), _layers())


@pytest.mark.parametrize("row, why", [([1, 8], "outside"), ([3, 3], "repeats"), ([-1, -1], "outside"),
                                      ([-1, 2], "outside")])
def test_bad_ids_name_sample_position_and_layer(row, why):
    r = _routes(np.random.default_rng(1), 8).astype(np.int64)
    r[5, 1] = row
    with pytest.raises(RolloutRoutesError, match=rf"sample 2 .*position 5, MoE layer 1 = .*{why}"):
        check_sample_routes(2, np.arange(9), r, _layers())


@given(st.integers(2, 40), st.lists(st.integers(1, 39), max_size=4), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_stitched_turns_equal_the_whole(n, cuts, extra, seed):
    """Turns that each send only their new rows (``prompt_start``) stitch into the whole sample's rows,
    whatever other samples' requests sit between them; a longer request (TRL truncated) counts too."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 100, n + extra)
    full = _routes(rng, n + extra - 1)
    ends = sorted({c for c in cuts if c < n} | {n + extra})
    requests, start = [], 0
    for end in ends:
        requests.append(_Request(tokens[:end], full[start : end - 1], start))
        requests.append(_Request(rng.integers(100, 200, end), _routes(rng, end - 1), 0))  # another sample
        start = end - 1
    got = stitch_sample(0, tokens[:n], requests)
    np.testing.assert_array_equal(got, full[: n - 1])


def test_stitch_errors_name_sample_and_position():
    rng = np.random.default_rng(2)
    tokens = rng.integers(3, 100, 12)
    full = _routes(rng, 11)
    gap = [_Request(tokens[:5], full[:4], 0), _Request(tokens, full[7:], 7)]
    with pytest.raises(RolloutRoutesError, match=r"sample 4 \(12 tokens\): no routes from position 4"):
        stitch_sample(4, tokens, gap)
    other = tokens.copy()
    other[6] += 1
    with pytest.raises(RolloutRoutesError, match=r"sample 1 \(12 tokens\): no routes from position 6: its tokens "
                       r"differ .*request 0\) has token \d+ at position 6"):
        stitch_sample(1, tokens, [_Request(other, full, 0)])
    last = tokens.copy()
    last[11] += 1  # no row depends on the last token: the engine's rows are this sample's
    np.testing.assert_array_equal(stitch_sample(1, tokens, [_Request(last, full, 0)]), full)
    with pytest.raises(RolloutRoutesError, match=r"sample 0 .*engine returned no routes"):
        stitch_sample(0, tokens, [_Request(tokens, None, 0)])


@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 7)), min_size=1, max_size=5), st.integers(0, 2),
       st.integers(0, 2**31 - 1))
def test_batch_layout_is_trls(lens, pad, seed):
    """Left-padded prompt, right-padded completion (extra columns as ``pad_to_multiple_of`` adds):
    every route row sits in its token's column, the last token and padding are -1."""
    rng = np.random.default_rng(seed)
    samples = []
    for p, c in lens:
        tokens = rng.integers(3, 100, p + c)
        samples.append((tokens, _routes(rng, p + c - 1).astype(np.int16), p))
    pw = max(p for p, _ in lens) + pad
    cw = max(c for _, c in lens) + pad
    ids = torch.zeros(len(lens), pw + cw, dtype=torch.long)
    for i, (tokens, _, p) in enumerate(samples):
        ids[i, pw - p : pw + len(tokens) - p] = torch.from_numpy(tokens)
    out = batch_routes(samples, pw, cw, _layers(), ids)
    assert out.shape == (len(lens), pw + cw, L, K) and out.dtype == torch.int16
    for i, (tokens, routes, p) in enumerate(samples):
        cols = np.arange(pw - p, pw + len(tokens) - p)
        np.testing.assert_array_equal(out[i, cols[:-1]].numpy(), routes)
        rest = np.ones(pw + cw, bool)
        rest[cols[:-1]] = False
        assert (out[i, rest] == -1).all()


def test_batch_tokens_that_differ_name_sample_and_position():
    rng = np.random.default_rng(3)
    samples = [(rng.integers(3, 100, 7), _routes(rng, 6).astype(np.int16), 3) for _ in range(2)]
    ids = torch.zeros(2, 9, dtype=torch.long)
    for i, (tokens, _, p) in enumerate(samples):
        ids[i, 4 - p : 4 - p + 7] = torch.from_numpy(tokens)
    ids[1, 5] += 1  # sample 1's token 4 (the second completion token)
    with pytest.raises(RolloutRoutesError, match=r"sample 1: the batch's token at position 4 \(column 5\)"):
        batch_routes(samples, 4, 5, _layers(), ids)
