"""Store capacity vs KV cache: evicted prefix routes fail closed; default sizing never evicts them."""

from __future__ import annotations

import numpy as np

from auxout.stores import ArenaStore
from auxout.testing import FakeMoE, SimEngine, oracle_routes

MODEL = FakeMoE(num_layers=2, top_k=2, num_experts=8, vocab_size=100, seed=3)


def test_prefix_hit_on_evicted_routes_fails_closed() -> None:
    bs = 4
    # store holds 3 objects; the KV cache holds 64 blocks, so KV keeps prefixes the store dropped
    arena = ArenaStore(3 * MODEL.profile.block_nbytes(bs), MODEL.profile.block_nbytes(bs))
    eng = SimEngine(MODEL, block_size=bs, num_kv_blocks=64, store=arena)
    rng = np.random.default_rng(0)
    first = rng.integers(0, 100, 12).tolist()  # 3 blocks: fits the store while it runs
    eng.add_request("first", first, 1)
    r1 = eng.run()["first"]
    assert r1.error is None and np.array_equal(r1.routed_experts, oracle_routes(MODEL, r1))
    eng.store.flush()
    first_keys = arena.stored_keys
    assert len(first_keys) == 3
    for i in range(4):  # churn: other prefixes push "first"'s objects out of the 3-object store
        eng.add_request(f"other{i}", rng.integers(0, 100, 8).tolist(), 1)
        eng.run()
    # Reads wait only for their own queued keys, so without this the hit could race ahead of the
    # churn on the writer thread and (correctly) read routes that were about to be evicted.
    eng.store.flush()
    assert not any(eng.store.contains(first_keys)), "the churn must have evicted every block of the prefix"
    eng.add_request("hit", first + [7, 8], 2)
    res = eng.run()["hit"]
    assert res.num_cached_tokens >= 8, "the KV cache must still hold the prefix"
    assert res.routed_experts is None
    assert res.error is not None and "missing from the store" in res.error and "increase" in res.error
    # the engine keeps serving: a cold request afterwards is correct
    eng.add_request("after", rng.integers(0, 100, 10).tolist(), 3)
    after = eng.run()["after"]
    assert after.error is None and np.array_equal(after.routed_experts, oracle_routes(MODEL, after))


def test_default_sizing_never_loses_a_kv_hit() -> None:
    bs = 4
    eng = SimEngine(MODEL, block_size=bs, num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=32)
    rng = np.random.default_rng(1)
    prefixes = [rng.integers(0, 100, int(n)).tolist() for n in rng.integers(4, 40, 6)]
    cached = 0
    for step in range(30):
        for j in range(3):
            base = prefixes[int(rng.integers(0, len(prefixes)))]
            eng.add_request(f"r{step}-{j}", base + rng.integers(0, 100, 5).tolist(), int(rng.integers(1, 12)))
        for res in eng.run().values():
            assert res.error is None, res.error
            assert np.array_equal(res.routed_experts, oracle_routes(MODEL, res))
            cached += res.num_cached_tokens
    assert cached > 0, "the workload must exercise prefix hits"


def test_batch_larger_than_store_fails_only_requests_that_need_it() -> None:
    bs = 4
    eng = SimEngine(MODEL, block_size=bs, num_kv_blocks=64, store_bytes=2 * MODEL.profile.block_nbytes(bs))
    rng = np.random.default_rng(2)
    big = rng.integers(0, 100, 20).tolist()  # 5 referenced blocks never fit a 2-object store
    eng.add_request("big", big, 2)
    res = eng.run()["big"]
    # its own rows came straight from the step: correct, nothing read from the store
    assert res.error is None and np.array_equal(res.routed_experts, oracle_routes(MODEL, res))
    eng.store.flush()
    assert eng.store.dropped_batches > 0, "the writer must have rejected the oversized batch"
    eng.add_request("reuse", big + [1], 1)  # needs big's prefix from the store: fails closed
    reuse = eng.run()["reuse"]
    assert reuse.routed_experts is None and reuse.error is not None and "missing" in reuse.error
    eng.add_request("small", [5, 6, 7], 2)  # the engine keeps serving
    small = eng.run()["small"]
    assert small.error is None and np.array_equal(small.routed_experts, oracle_routes(MODEL, small))
