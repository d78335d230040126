"""Keys-only output through the engine loop: manifests fetched from a real store equal inline routes.

The same workload (shared prefixes so later requests hit the prefix cache, prompt_start anywhere,
async scheduling and speculative drafts) runs once inline and once keys-only; every fetched
array must equal the inline array and the oracle, bit for bit.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from auxout.errors import ObjectMissingError
from auxout.manifest import RouteManifest, fetch
from auxout.stores.redis import RedisStore
from auxout.stores.shm import SharedMemoryStore
from auxout.testing import FakeMoE, SimEngine, oracle_routes
from auxout.testing.servers import RedisServer

MODEL = FakeMoE(num_layers=3, top_k=2, num_experts=16, vocab_size=200, seed=5)
BS = 4


def workload(eng: SimEngine, output: str) -> dict:
    rng = np.random.default_rng(7)
    base = rng.integers(0, 200, 21).tolist()
    results = {}
    history: dict[int, list[int]] = {}
    for turn in range(2):
        for c in range(4):
            prompt = history.get(c, base) + rng.integers(0, 200, int(rng.integers(1, 9))).tolist()
            start = int(rng.integers(0, len(prompt) + 1))
            eng.add_request(f"t{turn}c{c}", prompt, int(rng.integers(1, 12)), prompt_start=start, output=output)
        for rid, res in eng.run().items():
            assert res.error is None, res.error
            results[rid] = res
            history[int(rid[-1])] = res.tokens
    return results


def run_both(make_store, address_reader) -> None:  # type: ignore[no-untyped-def]
    cfg: dict[str, Any] = dict(block_size=BS, async_scheduling=True, num_speculative_tokens=2, max_num_batched_tokens=16)
    inline = workload(SimEngine(MODEL, **cfg), "inline")
    eng = SimEngine(MODEL, store=make_store(), **cfg)
    keyed = workload(eng, "keys")
    assert sum(r.num_cached_tokens for r in keyed.values()) > 0, "the workload must hit the prefix cache"
    reader = address_reader()
    try:
        for rid, res in keyed.items():
            assert isinstance(res.manifest, RouteManifest) and res.routed_experts is None
            m = RouteManifest.from_json(res.manifest.to_json())  # what a trainer receives
            got = fetch(m, store=reader)
            assert np.array_equal(got, inline[rid].routed_experts), rid
            assert np.array_equal(got, oracle_routes(MODEL, res)), rid
            assert m.num_rows == len(res.tokens) - 1 - res.prompt_start
    finally:
        reader.close()
        eng.close()


def test_keys_only_equals_inline_with_redis(redis_srv: RedisServer) -> None:
    nbytes = MODEL.profile.block_nbytes(BS)

    def make() -> RedisStore:
        return RedisStore(redis_srv.url, namespace="keys-engine", object_nbytes=nbytes)

    run_both(make, make)


def test_keys_only_equals_inline_with_shared_memory() -> None:
    nbytes = MODEL.profile.block_nbytes(BS)
    owner = SharedMemoryStore(1024 * nbytes, nbytes)
    try:
        run_both(lambda: owner, lambda: SharedMemoryStore.open(owner.name))
    except Exception:
        owner.close()
        raise


def test_manifest_for_expired_keys_names_them(redis_srv: RedisServer) -> None:
    nbytes = MODEL.profile.block_nbytes(BS)
    eng = SimEngine(MODEL, block_size=BS, store=RedisStore(redis_srv.url, namespace="keys-ttl", object_nbytes=nbytes))
    eng.add_request("a", list(range(30)), 3, output="keys")
    res = eng.run()["a"]
    eng.close()
    assert res.manifest is not None
    admin = RedisStore(redis_srv.url, namespace="keys-ttl", object_nbytes=nbytes)
    try:
        import redis

        client = redis.Redis.from_url(redis_srv.url)
        gone = res.manifest.keys[1]
        assert client.delete(f"keys-ttl/{gone}") == 1  # what TTL expiry does
        with pytest.raises(ObjectMissingError) as exc:
            fetch(res.manifest, store=admin)
        assert gone in str(exc.value) and exc.value.keys == [gone]
    finally:
        admin.close()


def test_a_manifest_restarts_the_ttl_of_the_old_blocks_it_names(redis_srv: RedisServer) -> None:
    """A hot prefix's blocks were written long ago and are about to expire; a later request's
    manifest names them. Returning the manifest restarts their TTL, so the trainer's fetch after
    the response finds them (first write wins: the write itself never extends a TTL)."""
    import redis

    nbytes = MODEL.profile.block_nbytes(BS)
    ns = "keys-touch"
    eng = SimEngine(MODEL, block_size=BS, store=RedisStore(redis_srv.url, namespace=ns, object_nbytes=nbytes, ttl=30))
    prefix = list(range(40, 60))
    eng.add_request("old", prefix + [1, 2], 2, output="keys")
    old = eng.run()["old"].manifest
    client = redis.Redis.from_url(redis_srv.url)
    try:
        for key in old.keys[:4]:
            assert client.pexpire(f"{ns}/{key}", 300)  # these blocks' TTL is nearly over
        eng.add_request("new", prefix + [3, 4, 5], 3, output="keys")
        res = eng.run()["new"]
        assert res.num_cached_tokens >= 4 * BS and set(old.keys[:4]) <= set(res.manifest.keys)
        assert min(client.pttl(f"{ns}/{key}") for key in res.manifest.keys) > 20_000
        time.sleep(0.5)  # past the old TTL
        assert np.array_equal(fetch(res.manifest), oracle_routes(MODEL, res))
    finally:
        client.close()
        eng.close()
