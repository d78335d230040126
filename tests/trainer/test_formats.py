"""Framework formats: every converter round-trips, keeps each row with its token, and refuses what it cannot place."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from conftest import VOCAB, build_tiny
from hypothesis import given, settings
from hypothesis import strategies as st

from auxout.trainer import RouteTrace, RouteTraceError
from auxout.trainer.formats import (
    decode_sglang,
    decode_vllm,
    encode_sglang,
    encode_vllm,
    expand_layers,
    from_nemo_rl,
    from_slime,
    from_verl,
    select_moe_layers,
    to_nemo_rl,
    to_slime,
    to_verl,
)
from auxout.trainer.hf import capture_routes, moe_layers, replay

L, K, E = 3, 2, 8


def _rows(n: int, seed: int, num_experts: int = E, layers: int = L) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((n, layers, num_experts)), axis=-1)[..., :K].astype(np.int64)


shapes = st.tuples(st.integers(1, 40), st.integers(0, 40), st.integers(0, 2**31 - 1))


@settings(max_examples=50, deadline=None)
@given(shapes, st.sampled_from([np.uint8, np.uint16, np.int16, np.int32]))
def test_vllm_payload_round_trips(shape, dtype):
    n, _, seed = shape
    r = _rows(n, seed).astype(dtype)
    payload = encode_vllm(r)
    # what docs/trainer.md tells users to write by hand decodes the same
    by_hand = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    got = decode_vllm(payload)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, r)
    np.testing.assert_array_equal(by_hand, r)


@settings(max_examples=50, deadline=None)
@given(shapes, st.sampled_from(["int32", "uint16", "uint8"]))
def test_sglang_payload_round_trips_with_echoed_dtype(shape, dtype):
    n, _, seed = shape
    hidden = 4  # SGLang keeps a row per hidden layer: layer 0 dense here
    full = expand_layers(_rows(n, seed), [1, 2, 3], hidden)
    full[:, 0] = 0 if dtype != "int32" else -1  # whatever SGLang writes for a dense layer is dropped
    payload, echoed = encode_sglang(full, dtype)
    got = decode_sglang(payload, num_layers=hidden, top_k=K, dtype=echoed, moe_layers=[1, 2, 3])
    np.testing.assert_array_equal(got, full[:, 1:])
    np.testing.assert_array_equal(select_moe_layers(decode_sglang(payload, hidden, K, echoed), [1, 2, 3]), got)


def test_expand_layers_refuses_layers_outside_the_model():
    r = _rows(5, 1)
    for bad in ([1, 2, 4], [-1, 2, 3], [1, 1, 3]):
        with pytest.raises(RouteTraceError, match="not distinct layers of the 4 hidden layers"):
            expand_layers(r, bad, 4)


def test_sglang_legacy_int32_and_refusals():
    r = _rows(5, 1)
    legacy = base64.b64encode(r.astype(np.int32).tobytes()).decode()  # older servers: no dtype field
    np.testing.assert_array_equal(decode_sglang(legacy, L, K), r)
    with pytest.raises(RouteTraceError, match="not a multiple of num_layers=4"):
        decode_sglang(legacy, 4, K)  # wrong layer count is caught by the byte count here
    with pytest.raises(RouteTraceError, match="routed_experts_dtype='float16'"):
        decode_sglang(legacy, L, K, dtype="float16")
    with pytest.raises(RouteTraceError, match="not valid base64"):
        decode_sglang("***", L, K)
    with pytest.raises(RouteTraceError, match="do not fit uint8"):
        encode_sglang(r + 300, "uint8")
    with pytest.raises(RouteTraceError, match="not an .npy"):
        decode_vllm(base64.b64encode(b"not numpy").decode())
    with pytest.raises(RouteTraceError, match=r"\[rows, L, K\]"):
        decode_vllm(base64.b64encode(_npy(np.zeros((3, 2), np.uint8))).decode())


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _trace(seed: int, prompt: int, response: int) -> RouteTrace:
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, VOCAB, prompt + response)
    return RouteTrace.from_output(toks[:prompt], toks[prompt:], _rows(prompt + response - 1, seed))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(0, 4), st.integers(0, 4), st.integers(0, 2**31 - 1))
def test_verl_layout_round_trips_and_keeps_rows_with_tokens(p, r, extra_p, extra_r, seed):
    t = _trace(seed, p, r)
    ids, mask, routes = to_verl(t, p + extra_p, r + extra_r)
    assert routes.dtype == np.int16 and routes.shape == (p + r + extra_p + extra_r, L, K)
    assert (mask[:extra_p] == 0).all() and mask[extra_p] == 1  # prompt left-padded
    assert (routes[mask == 0] == -1).all()  # padding is never a route
    np.testing.assert_array_equal(ids[mask.astype(bool)], t.tokens)
    np.testing.assert_array_equal(routes[mask.astype(bool)], t.routes)
    np.testing.assert_array_equal(from_verl(routes, mask), t.per_sample())


def test_verl_refuses_overlong_sample():
    with pytest.raises(RouteTraceError, match="exceed max_prompt_len=3"):
        to_verl(_trace(0, 5, 2), 3, 4)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_slime_and_nemo_rl_round_trip(p, r, seed):
    t = _trace(seed, p, r)
    s = to_slime(t)
    assert s.dtype == np.int32 and s.shape == (p + r - 1, L, K)
    back = from_slime(t.tokens, s, p)
    np.testing.assert_array_equal(back.routes, t.routes)
    assert back.prompt_len == p
    n = to_nemo_rl(t)
    np.testing.assert_array_equal(from_nemo_rl(n), n)


def test_slime_and_nemo_rl_refusals():
    t = _trace(3, 4, 4)
    with pytest.raises(RouteTraceError, match="8 tokens"):
        from_slime(t.tokens, t.routes, 4)  # S rows instead of S-1
    for prompt_len in (-3, 9, 2.0, True):  # (a negative one wrapped, one past the sample was clamped)
        with pytest.raises(RouteTraceError, match=rf"prompt_len must be an int in \[0, 8\].*{prompt_len!r}"):
            from_slime(t.tokens, t.routes[:-1], prompt_len)  # type: ignore[arg-type]
    assert from_slime(t.tokens, t.routes[:-1], 8).prompt_len == 8
    bad = to_nemo_rl(t)
    bad[2, 1, 0] = -1
    with pytest.raises(RouteTraceError, match=r"position=2, moe_layer=1\] = \[-1, "):
        from_nemo_rl(bad)


def test_verl_layout_replays_like_the_unpadded_sample():
    """The padded verl sample replayed through transformers gives the unpadded sample's logits at real tokens."""
    model = build_tiny("qwen3_moe", seed=5)
    lay = moe_layers(model)
    rng = np.random.default_rng(5)
    toks = rng.integers(3, VOCAB, 20)
    oracle = capture_routes(model, toks)
    t = RouteTrace.from_output(toks[:8], toks[8:], oracle[:-1])
    ids, mask, routes = to_verl(t, 12, 16)
    assert routes.shape[1:] == (len(lay), lay.top_k)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(toks)[None], use_cache=False).logits[0]
        with replay(model, routes[None], attention_mask=mask[None]) as ctx:
            out = model(input_ids=torch.from_numpy(ids)[None], attention_mask=torch.from_numpy(mask)[None],
                        use_cache=False).logits[0]
    assert ctx.fallback_count == len(lay)  # only the last real token (no route) used the live router
    torch.testing.assert_close(out[mask.astype(bool)], ref, atol=2e-5, rtol=1e-4)
