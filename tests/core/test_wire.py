"""Wire formats round-trip any route or weight array exactly; bad payloads fail with a clear error."""

from __future__ import annotations

import base64
import io
import json
import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import auxout
from auxout.wire import _SAMPLE_BYTES, FORMATS, WireFormatError, decode_routes, encode, id_bits


@st.composite
def route_arrays(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    num_experts = draw(st.sampled_from([1, 2, 3, 8, 16, 60, 128, 256, 257, 384, 65536]))
    tokens = draw(st.integers(0, 40))
    layers = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, min(8, num_experts)))
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    seed = draw(st.integers(0, 2**32 - 1))
    ids = np.random.default_rng(seed).integers(0, num_experts, size=(tokens, layers, top_k)).astype(dtype)
    return ids, num_experts


@given(route_arrays(), st.sampled_from(FORMATS))
def test_ids_round_trip_in_every_format(case: tuple[np.ndarray, int], fmt: str) -> None:
    ids, num_experts = case
    fields = json.loads(json.dumps(encode(ids, fmt, num_experts=num_experts)))  # survives JSON
    assert fields["routed_experts_format"] == fmt
    assert fields["routed_experts_shape"] == list(ids.shape)
    got = decode_routes(fields)
    assert got is not None and got.shape == ids.shape
    np.testing.assert_array_equal(got, ids)
    if fmt == "npy":
        assert got.dtype == ids.dtype
    if fmt == "sglang":  # SGLang clients decode flat int32
        flat = np.frombuffer(base64.b64decode(fields["routed_experts"]), dtype=np.int32)
        np.testing.assert_array_equal(flat, ids.reshape(-1))


@given(st.integers(0, 30), st.sampled_from(FORMATS), st.sampled_from([np.float32, np.float16]))
def test_weights_round_trip_bit_exact(tokens: int, fmt: str, dtype: type) -> None:
    w = np.random.default_rng(tokens).random((tokens, 3, 4)).astype(dtype)
    fields = encode(w, fmt, name="routing_weights")
    got = decode_routes(fields, "routing_weights")
    assert got is not None
    assert got.tobytes() == w.astype(got.dtype).tobytes() and got.dtype == w.dtype


def test_packed_is_smaller_than_npy_for_uniform_routes() -> None:
    ids = np.random.default_rng(0).integers(0, 128, size=(320, 48, 8)).astype(np.uint8)
    npy = encode(ids, "npy")["routed_experts"]
    packed = encode(ids, "packed", num_experts=128)["routed_experts"]
    assert len(packed) < 0.9 * len(npy)
    assert id_bits(128) == 7 and id_bits(129) == 8 and id_bits(1) == 1


def test_bare_npy_string_and_vllm_contract() -> None:
    ids = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    buf = io.BytesIO()
    np.save(buf, ids)
    text = base64.b64encode(buf.getvalue()).decode()
    np.testing.assert_array_equal(auxout.decode_routes(text), ids)
    assert decode_routes({"text": "x"}) is None


class _ClientChoice:  # what the openai client gives for unknown response fields
    def __init__(self, extra: dict) -> None:
        self.model_extra = extra


def test_decodes_openai_client_objects() -> None:
    ids = np.random.default_rng(1).integers(0, 16, size=(5, 2, 4)).astype(np.uint8)
    np.testing.assert_array_equal(decode_routes(_ClientChoice(encode(ids, "packed", num_experts=16))), ids)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda f: f.update(routed_experts_format="zip"), "unknown format"),
        (lambda f: f.update(routed_experts="***"), "base64"),
        (lambda f: f.update(routed_experts_shape=[9, 2, 4]), "shape"),
        (lambda f: f.pop("routed_experts_bits"), "routed_experts_bits"),
        (lambda f: f.pop("routed_experts_dtype"), "routed_experts_dtype"),
        (lambda f: f.update(routed_experts=base64.b64encode(b"nope").decode()), "packed payload"),
    ],
)
def test_bad_payloads_raise_naming_the_problem(mutate, needle) -> None:
    ids = np.random.default_rng(2).integers(0, 16, size=(5, 2, 4)).astype(np.uint8)
    fields = encode(ids, "packed", num_experts=16)
    mutate(fields)
    with pytest.raises(WireFormatError, match=needle):
        decode_routes(fields)


def test_encode_rejects_ids_that_do_not_fit() -> None:
    with pytest.raises(WireFormatError, match="does not fit"):
        encode(np.array([[[17]]], dtype=np.uint8), "packed", num_experts=16)
    with pytest.raises(WireFormatError, match="unknown format"):
        encode(np.zeros((1, 1, 1), np.uint8), "json")


@given(st.integers(1, 16), st.integers(0, 70), st.integers(0, 2**32 - 1))
def test_pack_matches_a_bit_by_bit_reference(bits: int, count: int, seed: int) -> None:
    from auxout.wire import pack_ids, unpack_ids

    ids = np.random.default_rng(seed).integers(0, 1 << bits, size=count).astype(np.uint16)
    stream = "".join(format(int(v), f"0{bits}b") for v in ids)
    stream += "0" * (-len(stream) % 8)
    expected = bytes(int(stream[i : i + 8], 2) for i in range(0, len(stream), 8))
    assert pack_ids(ids, bits) == expected
    np.testing.assert_array_equal(unpack_ids(expected, bits, count, np.dtype(np.uint16)), ids)


def _reference_pack(ids: np.ndarray, bits: int) -> bytes:
    """MSB-first bit stream, ``bits`` per id, zero-padded to a byte: one id at a time."""
    stream = "".join(format(int(v), f"0{bits}b") for v in ids.reshape(-1))
    stream += "0" * (-len(stream) % 8)
    return int(stream, 2).to_bytes(len(stream) // 8, "big") if stream else b""


@st.composite
def packed_cases(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """Any expert count 1..65536, shapes whose packed stream spans both sides of the sampling
    threshold, uniform or skewed ids (skewed ones leave DEFLATE something to win)."""
    num_experts = draw(st.integers(1, 65536))
    shape = (draw(st.integers(0, 300)), draw(st.integers(1, 8)), draw(st.integers(1, 8)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        ids = rng.integers(0, num_experts, size=shape)
    else:
        ids = np.minimum(rng.geometric(0.3, size=shape) - 1, num_experts - 1)
    return ids.astype(np.uint8 if num_experts <= 256 else np.uint16), num_experts


@given(packed_cases())
def test_packed_payload_is_the_reference_bit_stream(case: tuple[np.ndarray, int]) -> None:
    ids, num_experts = case
    bits = id_bits(num_experts)
    fields = encode(ids, "packed", num_experts=num_experts)
    assert fields["routed_experts_bits"] == bits
    payload = base64.b64decode(fields["routed_experts"])
    expected = _reference_pack(ids, bits)
    assert zlib.decompress(payload) == expected
    # level 1 (what the format always wrote) or stored blocks where DEFLATE had nothing to win
    assert payload in (zlib.compress(expected, 1), zlib.compress(expected, 0))
    if len(expected) <= _SAMPLE_BYTES:
        assert payload == zlib.compress(expected, 1)
    np.testing.assert_array_equal(decode_routes(fields), ids)


def test_packed_keeps_level_1_bytes_where_deflate_wins_and_stores_where_it_cannot() -> None:
    rng = np.random.default_rng(3)
    skewed = np.minimum(rng.geometric(0.05, size=(320, 48, 8)) - 1, 127).astype(np.uint8)
    uniform = rng.integers(0, 128, size=(320, 48, 8)).astype(np.uint8)
    for ids, level in ((skewed, 1), (uniform, 0)):
        payload = base64.b64decode(encode(ids, "packed", num_experts=128)["routed_experts"])
        expected = _reference_pack(ids, 7)
        assert payload == zlib.compress(expected, level)
        assert len(payload) <= len(zlib.compress(expected, 1))
