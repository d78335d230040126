"""Generations after a prefix-cache reset keyed by the weights: engines that run the same weights
share routes (P/D peers, replicas, restarts), engines that run other weights never do."""

from __future__ import annotations

import numpy as np
import pytest

from auxout.keys import KeySpace, PackedHashes
from auxout.stores import ArenaStore
from auxout.testing import FakeMoE, SimEngine, SimKVConnector, oracle_routes

BS = 4


def test_a_weights_digest_names_every_later_generation_the_same_in_every_lifetime() -> None:
    h = [bytes(range(32))]
    a, b = KeySpace("ns/mfp", "life1", "d1"), KeySpace("ns/mfp", "life2", "d1")
    assert a.keys(h, 1) == b.keys(h, 7) == a.keys_batch([PackedHashes.pack(h * 70)], 3)[0][:1]
    assert a.keys(h, 1)[0].startswith("auxout/r3/ns/mfp/wd1/")
    assert a.keys(h, 0) == KeySpace("ns/mfp").keys(h, 0)  # generation 0: the loaded checkpoint's
    assert KeySpace("ns/mfp", "life1", "d2").keys(h, 1) != a.keys(h, 1)
    assert KeySpace("ns/mfp", "life1").keys(h, 1) != a.keys(h, 1)  # no digest: the life token's own
    with pytest.raises(ValueError, match="weights digest"):
        KeySpace("ns", "l", "a/b")


class _Pair:
    """A prefill and a decode engine sharing one route store and one KV connector (P/D)."""

    def __init__(self, model: FakeMoE, prefill_digest: dict[str, str] | None, decode_digest: dict[str, str] | None) -> None:
        obj = model.profile.block_nbytes(BS)
        self.store = ArenaStore(4096 * obj, obj)
        self.kv = SimKVConnector()

        def engine(life: str, digest: dict[str, str] | None) -> SimEngine:
            return SimEngine(
                model, block_size=BS, num_kv_blocks=256, store=self.store, kv_connector=self.kv, shared_store=True,
                life=life, weights_digest=(lambda: digest["w"]) if digest is not None else None,
            )  # fmt: skip

        self.prefill = engine("p1", prefill_digest)
        self.decode = engine("d1", decode_digest)

    def update(self, prefill_model: FakeMoE, decode_model: FakeMoE) -> None:
        """An RL weight sync: new weights on both sides, prefix caches reset, saved KV stale."""
        self.prefill.model, self.decode.model = prefill_model, decode_model
        assert self.prefill.reset_prefix_cache() and self.decode.reset_prefix_cache()
        self.kv.saved.clear()

    def run(self, rid: str, prompt: list[int], max_tokens: int = 6) -> tuple[np.ndarray, np.ndarray, int]:
        """Prefill the prompt there, decode it here: (routes, oracle routes, tokens loaded as KV)."""
        self.prefill.add_request(f"{rid}-p", prompt, 1)
        self.prefill.run()
        self.prefill.store.flush()  # (a KV producer publishes before its KV is handed over)
        self.decode.add_request(rid, prompt, max_tokens)
        (res,) = self.decode.run().values()
        assert res.routed_experts is not None and res.error is None, res
        return res.routed_experts, oracle_routes(self.decode.model, res), res.num_cached_tokens

    def close(self) -> None:
        self.prefill.store.flush()
        self.decode.store.flush()
        self.prefill.close()
        self.decode.close()


def _prompt(seed: int, n: int = 41) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def test_pd_peers_share_routes_after_a_weight_sync_when_their_weights_agree() -> None:
    """After a sync both sides run the new weights: the decode side reads the prefill side's
    routes for the KV it loads (nothing recomputed), from the very first request of the
    generation, and they are the new weights' routes."""
    old, new = FakeMoE(seed=0), FakeMoE(seed=1)
    version = {"w": "v0"}
    pair = _Pair(old, version, version)
    for step, weights in enumerate([old, new, new, old]):
        if step:
            version["w"] = f"v{step}"
            pair.update(weights, weights)
        for i in range(3):
            got, want, loaded = pair.run(f"s{step}r{i}", _prompt(10 * step + i))
            np.testing.assert_array_equal(got, want)
            assert loaded >= 40 - BS, (step, i, loaded)  # the KV came from the prefill side
        assert pair.decode.scheduler.recomputed_tokens == 0, step
        assert pair.decode.scheduler.recomputed_requests == 0, step
    # every generation after the first was keyed by its digest, on both sides
    assert pair.decode.worker.keyspace.weights == pair.prefill.worker.keyspace.weights == "v3"
    assert pair.decode.scheduler.keyspace == pair.decode.worker.keyspace
    pair.close()


def test_pd_peers_with_other_weights_never_read_each_others_routes() -> None:
    """Only the prefill side got the new weights: the decode side must recompute, not serve
    routes of weights it does not run (its digest differs, so its keys do)."""
    old, new = FakeMoE(seed=0), FakeMoE(seed=1)
    pre, dec = {"w": "v0"}, {"w": "v0"}
    pair = _Pair(old, pre, dec)
    pre["w"], dec["w"] = "v1", "v0x"
    pair.update(new, old)
    for i in range(3):
        got, want, _ = pair.run(f"r{i}", _prompt(100 + i))
        np.testing.assert_array_equal(got, want)  # the decode side's own (old) weights
    assert pair.decode.scheduler.recomputed_tokens > 0
    pair.close()


def test_without_a_digest_generations_stay_one_engines_own() -> None:
    """Engines that do not name generations by their weights (an in-process store) keep the
    life-token keys: after a reset nothing is shared, every loaded prefix recomputes, exactly."""
    old, new = FakeMoE(seed=0), FakeMoE(seed=1)
    pair = _Pair(old, None, None)
    pair.update(new, new)
    got, want, _ = pair.run("r0", _prompt(7))
    np.testing.assert_array_equal(got, want)
    assert pair.decode.scheduler.recomputed_tokens > 0
    pair.close()


@pytest.mark.parametrize("output", ["inline", "keys"])
def test_a_weight_sync_mid_request_keeps_the_returned_rows_and_says_where_the_new_ones_begin(output: str) -> None:
    """Weights updated and the prefix cache reset while a request runs (``reset_running_requests``):
    rows already returned are the old weights', the recompute's follow from ``reset_at``. A
    keys-only request answers inline then, saying why: a manifest names one generation's keys."""
    from auxout.connector.scheduler import REASON_TWO_GENERATIONS

    old, new = FakeMoE(num_layers=3, top_k=2, num_experts=8, vocab_size=50, seed=1), FakeMoE(
        num_layers=3, top_k=2, num_experts=8, vocab_size=50, seed=2
    )
    obj = old.profile.block_nbytes(BS)
    eng = SimEngine(old, block_size=BS, num_kv_blocks=64, max_num_batched_tokens=8, store=ArenaStore(256 * obj, obj))
    prompt = list(np.random.default_rng(3).integers(0, 50, 30))
    eng.add_request("r", prompt, 10, prompt_start=5, output=output)
    for _ in range(6):  # 30 prompt tokens in chunks of 8: decoding by now
        eng.step()
    eng.model = new
    assert eng.reset_prefix_cache(reset_running_requests=True)
    (res,) = eng.run().values()
    (at,) = res.reset_at
    assert 5 < at < len(res.tokens) - 1
    assert res.manifest is None and res.inline_reason == (REASON_TWO_GENERATIONS if output == "keys" else None)
    got, before, after = res.routed_experts, oracle_routes(old, res), oracle_routes(new, res)
    assert got.shape == before.shape
    assert np.array_equal(got[: at - 5], before[: at - 5]) and np.array_equal(got[at - 5 :], after[at - 5 :])
    assert not np.array_equal(before[at - 5 :], after[at - 5 :])


def test_a_weight_sync_before_a_keys_only_requests_prompt_start_keeps_its_manifest() -> None:
    """Keys-only rows are held from the start of the block holding ``prompt_start``; a sync that
    lands after some of those were held but before ``prompt_start`` returned nothing yet: the held
    rows are dropped for the recompute's, and the request keeps its manifest (all new weights)."""
    from auxout.manifest import fetch_rows

    old, new = FakeMoE(num_layers=3, top_k=2, num_experts=8, vocab_size=50, seed=1), FakeMoE(
        num_layers=3, top_k=2, num_experts=8, vocab_size=50, seed=2
    )
    bs = 16
    obj = old.profile.block_nbytes(bs)
    eng = SimEngine(old, block_size=bs, num_kv_blocks=64, max_num_batched_tokens=8, store=ArenaStore(256 * obj, obj))
    prompt = list(np.random.default_rng(4).integers(0, 50, 40))
    eng.add_request("r", prompt, 6, prompt_start=13, output="keys")
    eng.step()  # rows [0, 8) held (the block of position 13 starts at 0), none returned
    assert eng.scheduler._delivered["r"] == 8
    eng.model = new
    assert eng.reset_prefix_cache(reset_running_requests=True)
    (res,) = eng.run().values()
    assert res.reset_at is None and res.inline_reason is None and res.manifest is not None
    assert np.array_equal(fetch_rows(res.manifest, store=eng.store), oracle_routes(new, res))
