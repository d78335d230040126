"""docs/wire.md is enough to decode everything auxout sends: a decoder written from that page
alone (``wire_spec_decoder``, numpy and the standard library) reads every format auxout's encoder
writes, over random shapes and expert counts 1..65536, and rebuilds keys-only manifests from a
real Redis with a plain redis-py client."""

from __future__ import annotations

import base64
import json
import uuid
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from wire_spec_decoder import decode, read_manifest, redis_address

from auxout.connector.keys_output import KeysPublisher
from auxout.keys import KeySpace
from auxout.profile import RouteProfile
from auxout.stores.redis import RedisStore
from auxout.testing.servers import RedisServer, redis_server
from auxout.wire import FORMATS, encode

EXPERTS = st.one_of(
    st.integers(1, 65536), st.sampled_from([1, 2, 3, 4, 8, 60, 64, 128, 255, 256, 257, 384, 512, 32768, 65535, 65536])
)


@st.composite
def routes(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    num_experts = draw(EXPERTS)
    shape = (draw(st.integers(0, 40)), draw(st.integers(1, 6)), draw(st.integers(1, min(8, num_experts))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = np.uint8 if num_experts <= 256 else np.uint16  # (the id dtype auxout uses)
    ids = rng.integers(0, num_experts, size=shape).astype(dtype)
    if draw(st.booleans()) and ids.size:  # the largest id too, where the top bit is set
        ids.reshape(-1)[rng.integers(0, ids.size)] = num_experts - 1
    return ids, num_experts


@given(routes(), st.sampled_from(FORMATS))
def test_the_spec_decodes_every_ids_payload(case: tuple[np.ndarray, int], fmt: str) -> None:
    ids, num_experts = case
    fields = json.loads(json.dumps(encode(ids, fmt, num_experts=num_experts)))  # as a client receives it
    got = decode(fields)
    np.testing.assert_array_equal(got, ids)
    assert got.dtype == np.dtype(fields["routed_experts_dtype"])
    if fmt == "packed":  # b = ceil(log2(num_experts)), at least 1
        assert fields["routed_experts_bits"] == max(1, int(np.ceil(np.log2(num_experts))))
    if fmt == "sglang":
        assert fields["routed_experts_dtype"] == "int32"


@given(st.integers(0, 30), st.integers(1, 5), st.integers(1, 8), st.sampled_from(FORMATS), st.integers(0, 2**32 - 1))
def test_the_spec_decodes_every_weights_payload(rows: int, layers: int, top_k: int, fmt: str, seed: int) -> None:
    w = np.random.default_rng(seed).random((rows, layers, top_k), dtype=np.float32)
    fields = json.loads(json.dumps(encode(w, fmt, name="routing_weights")))
    got = decode(fields, "routing_weights")
    assert got.dtype == np.float32 and fields["routing_weights_dtype"] == "float32"
    assert got.tobytes() == w.tobytes()


def test_the_worked_example_and_the_framing() -> None:
    """The page's example (4 experts: ids 2, 0, 1, 3 are the byte 0x87), zlib framing that a raw
    DEFLATE reader refuses, and big-endian 16-bit ids."""
    fields = encode(np.array([[[2, 0, 1, 3]]], np.uint8), "packed", num_experts=4)
    raw = base64.b64decode(fields["routed_experts"])
    assert fields["routed_experts_bits"] == 2 and zlib.decompress(raw) == b"\x87"
    with pytest.raises(zlib.error):
        zlib.decompress(raw, -15)
    wide = encode(np.array([[[0x1234]]], np.uint16), "packed", num_experts=65536)
    assert zlib.decompress(base64.b64decode(wide["routed_experts"])) == b"\x12\x34"
    weights = encode(np.array([[[1.0]]], np.float32), "packed", name="routing_weights")
    assert zlib.decompress(base64.b64decode(weights["routing_weights"])) == np.float32(1.0).astype("<f4").tobytes()


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("n, start", [(45, 0), (45, 19), (32, 5), (7, 0), (40, 40)])
def test_the_spec_rebuilds_manifests_from_redis(redis: RedisServer, weights: bool, n: int, start: int) -> None:
    import redis as redis_py

    profile = RouteProfile(num_layers=3, top_k=4, num_experts=300, weights=weights)  # uint16 ids
    rng = np.random.default_rng(n + start)
    rows = profile.empty(n)
    ids = rng.integers(0, 300, size=(n, 3, 4)).astype(np.uint16)
    if weights:
        rows["id"], rows["w"] = ids, rng.random((n, 3, 4), dtype=np.float32)
    else:
        rows[:] = ids
    with RedisStore(redis.url + "/0", namespace="spec", object_nbytes=profile.block_nbytes(16)) as store:
        pub = KeysPublisher(store, keyspace=KeySpace(f"s-{uuid.uuid4().hex[:6]}"), block_size=16, profile=profile)
        pub.expect("r", start)
        pub.add("r", 0, rows)
        m = pub.finish("r", block_hashes=[uuid.uuid4().bytes for _ in range(n // 16)], generation=0, token_end=n)
    manifest = json.loads(m.to_json())
    url, namespace = redis_address(manifest["store"])
    assert url == redis.url + "/0"
    client = redis_py.Redis.from_url(url)

    def get(keys: list[str]) -> list[bytes]:
        return list(client.mget([f"{namespace}/{k}" for k in keys])) if keys else []

    got = read_manifest(manifest, get)
    client.close()
    assert manifest["token_start"] == start and got.shape == (n - start, 3, 4)
    if weights:
        assert manifest["dtype"] == "<u2+w<f4"
        np.testing.assert_array_equal(got["id"], ids[start:])
        assert got["w"].tobytes() == rows["w"][start:].tobytes()
    else:
        assert manifest["dtype"] == "<u2"
        np.testing.assert_array_equal(got, ids[start:])
