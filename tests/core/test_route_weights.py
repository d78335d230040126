"""Routing weights as (id, float32 weight) route slots: the dtype, its byte form for vLLM's
messages, manifests naming it, and a store that never mixes the two layouts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from auxout.manifest import RouteManifest, fetch, fetch_rows, publish_manifest
from auxout.profile import (
    RouteProfile,
    dtype_name,
    parse_dtype_name,
    rows_as_bytes,
    rows_from_bytes,
    rows_with_weights,
    split_rows,
)
from auxout.stores import ArenaStore
from auxout.testing import FakeMoE, SimEngine, oracle_routes


@pytest.mark.parametrize("num_experts", [40, 300], ids=["uint8", "uint16"])
def test_rows_round_trip_through_bytes_and_split(num_experts):
    profile = RouteProfile(3, 2, num_experts, weights=True)
    assert profile.dtype.names == ("id", "w") and profile.id_dtype == (np.uint8 if num_experts <= 256 else np.uint16)
    assert profile.token_nbytes == 3 * 2 * (profile.id_dtype.itemsize + 4)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, num_experts, (7, 3, 2)).astype(profile.id_dtype)
    w = rng.random((7, 3, 2), dtype=np.float32)
    rows = rows_with_weights(ids, w)
    data = rows_as_bytes(rows)
    assert data.dtype == np.uint8 and data.shape == (7, 3, 2, profile.dtype.itemsize)
    back = rows_from_bytes(data[2:5])  # vLLM slices the row axis (stop strings): still rows
    assert back.dtype == profile.dtype and np.array_equal(back, rows[2:5])
    got_ids, got_w = split_rows(back)
    assert got_ids.flags.c_contiguous and np.array_equal(got_ids, ids[2:5]) and np.array_equal(got_w, w[2:5])
    assert split_rows(ids)[1] is None
    with pytest.raises(ValueError, match="route bytes"):
        rows_from_bytes(ids)
    with pytest.raises(ValueError, match="not ids plus a float32 weight"):
        rows_from_bytes(np.zeros((1, 1, 1, 8), np.uint8))
    with pytest.raises(ValueError, match="same shape"):
        rows_with_weights(ids, w[:3])


def test_dtype_names_and_manifests_with_weights():
    dt = RouteProfile(2, 2, 8, weights=True).dtype
    assert dtype_name(dt) == "|u1+w<f4" and parse_dtype_name("|u1+w<f4") == dt
    assert dtype_name(np.dtype(np.uint16)) == "<u2" and parse_dtype_name("<u2") == np.uint16
    with pytest.raises(TypeError, match="float32"):
        parse_dtype_name("|u1+w<f8")
    model = FakeMoE(num_layers=2, top_k=2, num_experts=8, vocab_size=50, seed=3, weights=True)
    rows = model.routes(list(range(1, 12)))
    store = ArenaStore(1 << 16, model.profile.block_nbytes(4))
    m = publish_manifest(store, address="local://", block_keys=[], tail_rows=rows, token_start=2, token_end=11,
                         block_size=4, namespace="t")  # fmt: skip
    again = RouteManifest.from_json(m.to_json())
    assert again == m and again.has_weights and again.row_nbytes == 2 * 2 * 5
    assert np.array_equal(fetch_rows(again, store=store), rows[2:])
    ids, w = fetch(again, store=store, weights=True)
    assert np.array_equal(ids, rows["id"][2:]) and np.array_equal(w, rows["w"][2:])
    assert np.array_equal(fetch(again, store=store), rows["id"][2:])  # ids, as without weights
    plain = publish_manifest(store, address="local://", block_keys=[], tail_rows=rows["id"].copy(), token_start=0,
                             token_end=3, block_size=4, namespace="t")  # fmt: skip
    with pytest.raises(ValueError, match="no routing weights"):
        fetch(plain, store=store, weights=True)
    with pytest.raises(ValueError, match="integer"):
        RouteManifest.from_dict({**m.to_dict(), "dtype": "<f4+w<f4"})


def test_a_store_never_mixes_routes_with_and_without_weights():
    from auxout.vllm.config import route_keyspace
    from auxout.vllm.options import VllmOptions

    mc = SimpleNamespace(
        model="/m", hf_text_config=SimpleNamespace(num_hidden_layers=4),
        get_num_experts=lambda: 16, get_num_experts_per_tok=lambda: 4,
    )  # fmt: skip
    cfg = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(), parallel_config=SimpleNamespace())
    plain = route_keyspace(cfg, VllmOptions(), 16)
    weighted = route_keyspace(cfg, VllmOptions(routing_weights=True), 16)
    assert plain != weighted and plain == route_keyspace(cfg, VllmOptions(), 16)
    with pytest.raises(ValueError, match="routing_weights must be a bool"):
        VllmOptions(routing_weights="yes")  # type: ignore[arg-type]


def test_engine_serves_weights_of_a_cached_prefix_from_the_store():
    model = FakeMoE(num_layers=2, top_k=3, num_experts=300, vocab_size=90, seed=8, weights=True)  # uint16 ids
    eng = SimEngine(model, block_size=4, max_num_batched_tokens=8, num_kv_blocks=64)
    prompt = list(range(3, 40))
    eng.add_request("a", prompt, 6)
    a = eng.run()["a"]
    eng.add_request("b", a.tokens + [5, 6, 7], 4, prompt_start=10)
    b = eng.run()["b"]
    for res in (a, b):
        assert res.error is None and res.routed_experts.dtype == model.profile.dtype
        assert np.array_equal(res.routed_experts, oracle_routes(model, res))
    assert b.num_cached_tokens >= 40, "the second request must hit the prefix cache (rows read from the store)"
    eng.close()
