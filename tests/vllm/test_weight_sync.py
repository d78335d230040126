"""In-place weight syncs (``auxout.vllm.update_weights``) into in-process engines, with weights a
few AdamW steps in transformers really changed.

The oracles: a fresh engine built on the new weights saved to disk (greedy token ids and logprobs
bit for bit), and transformers' fp32 full forward of those weights (every route). vLLM-CPU's
layerwise reload alone leaves the fused-MoE experts on stale packed weights (logprobs move by
tenths, most routes change); the sync and every vLLM reload path on auxout's engine repack them.
Two engines sharing a Redis route store never exchange routes of different weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from routes_oracle import Oracle, close_llm
from weight_sync_helpers import Trainer, greedy_outputs, ids_and_logprobs, inprocess_llm, prompts

from auxout.manifest import RouteManifest
from auxout.testing.servers import redis_server

pytestmark = pytest.mark.vllm

SYNCS = 3
NUM_MOE_LAYERS = 2  # the tiny qwen3_moe
KEYS = {"routed_experts_output": "keys"}  # (a request field: the manifest instead of rows)


@pytest.fixture(scope="module")
def base_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def redis():  # type: ignore[no-untyped-def]
    with redis_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def shared(redis) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    return {"store": "redis", "namespace": "sync", "store_options": {"url": str(redis.url), "namespace": "ws"}}


@pytest.fixture(scope="module")
def engine(base_path: str, shared: dict[str, Any]):  # type: ignore[no-untyped-def]
    llm = inprocess_llm(base_path, shared)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def synced(engine: Any, base_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The engine's outputs on its checkpoint, then SYNCS rounds of (2 AdamW steps, sync); the final
    weights saved as a checkpoint."""
    import auxout.vllm

    ps = prompts(1)
    before = ids_and_logprobs(greedy_outputs(engine, ps))
    trainer = Trainer(base_path)
    states, syncs = [trainer.state()], []
    for _ in range(SYNCS):
        trainer.step()
        syncs.append(auxout.vllm.update_weights(engine, trainer.model.named_parameters(), hf_model=trainer.model))
        states.append(trainer.state())
    path = trainer.save(tmp_path_factory.mktemp("synced") / "ckpt")
    return {"prompts": ps, "before": before, "syncs": syncs, "states": states, "path": path}


@pytest.fixture(scope="module")
def fresh(synced: dict[str, Any]):  # type: ignore[no-untyped-def]
    """An engine built from the saved final weights; plain vLLM (no auxout)."""
    llm = inprocess_llm(synced["path"], plain=True)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def oracle(synced: dict[str, Any]) -> Oracle:
    return Oracle(synced["path"])


def test_synced_engine_computes_what_a_fresh_engine_on_the_new_weights_does(engine, fresh, synced) -> None:  # type: ignore[no-untyped-def]
    assert all(s.num_tensors == 117 and s.moe_layers_repacked == NUM_MOE_LAYERS for s in synced["syncs"])
    now = ids_and_logprobs(greedy_outputs(engine, synced["prompts"]))
    want = ids_and_logprobs(greedy_outputs(fresh, synced["prompts"]))
    assert now == want  # token ids and logprobs, bit for bit
    moved = max(abs(a - b) for (_, x), (_, y) in zip(now, synced["before"]) for a, b in zip(x, y))
    assert moved > 0.05  # the weights really changed


def test_routes_after_syncs_equal_the_full_forward_of_the_new_weights(engine, synced, oracle) -> None:  # type: ignore[no-untyped-def]
    ps = synced["prompts"]
    for p, c in zip(ps, greedy_outputs(engine, ps)):  # (the prefixes are cached now)
        oracle.check(p, c)
    longer = [p + [5, 6, 7] for p in ps]
    for p, c in zip(longer, greedy_outputs(engine, longer, 6)):
        oracle.check(p, c)


def test_vllm_reload_paths_repack_the_experts(engine, fresh, synced, base_path) -> None:  # type: ignore[no-untyped-def]
    """vLLM's own reload on auxout's engine: from disk (the loaded checkpoint) gives back the first
    outputs; from an iterator (checkpoint names) the synced ones; through ``collective_rpc`` too."""
    from auxout.vllm.weight_sync import checkpoint_named, repacked_count

    runner = engine.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    before = repacked_count()
    runner.reload_weights()  # the checkpoint at base_path, from disk
    engine.reset_prefix_cache()
    assert ids_and_logprobs(greedy_outputs(engine, synced["prompts"])) == synced["before"]
    named = checkpoint_named(synced["states"][-1], engine.llm_engine.model_config.hf_config)
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named.items())})
    engine.reset_prefix_cache()
    assert ids_and_logprobs(greedy_outputs(engine, synced["prompts"])) == ids_and_logprobs(
        greedy_outputs(fresh, synced["prompts"])
    )
    assert repacked_count() - before == 2 * NUM_MOE_LAYERS


def test_a_partial_sync_leaves_the_other_layers_packed(engine, fresh, synced) -> None:  # type: ignore[no-untyped-def]
    """A sync of the embeddings alone rebuilds no MoE layer: their packed experts stay as they are
    (packing them again would scramble them)."""
    import auxout.vllm

    state = synced["states"][-1]
    r = auxout.vllm.update_weights(engine, {"model.embed_tokens.weight": state["model.embed_tokens.weight"]})
    assert (r.num_tensors, r.moe_layers_repacked) == (1, 0)
    assert ids_and_logprobs(greedy_outputs(engine, synced["prompts"])) == ids_and_logprobs(
        greedy_outputs(fresh, synced["prompts"])
    )


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("unknown", r"not in the engine's checkpoint, e.g. \['model.layers.0.mlp.nope.weight'\]"),
        ("shape", r"weights\['model.norm.weight'\]: shape \(63,\) differs from the checkpoint's \(64,\)"),
        ("partial_layer", r"model.layers.1 is incomplete: \d+ of its tensors missing"),
        ("not_tensor", r"weights\['model.norm.weight'\]: expected a floating-point torch tensor, got list"),
        ("int_tensor", r"weights\['model.norm.weight'\]: expected a floating-point torch tensor, got Tensor of torch.int64"),
        ("empty", "empty, nothing to load"),
    ],
)
def test_bad_weights_are_refused_by_name_and_the_engine_keeps_serving(engine, fresh, synced, case, match) -> None:  # type: ignore[no-untyped-def]
    import torch

    import auxout.vllm

    state = synced["states"][-1]
    bad: dict[str, Any] = {
        "unknown": {"model.layers.0.mlp.nope.weight": torch.zeros(3)},
        "shape": {"model.norm.weight": torch.zeros(63)},
        "partial_layer": {"model.layers.1.self_attn.q_proj.weight": state["model.layers.1.self_attn.q_proj.weight"]},
        "not_tensor": {"model.norm.weight": [0.0] * 64},
        "int_tensor": {"model.norm.weight": torch.zeros(64, dtype=torch.int64)},
        "empty": {},
    }[case]
    with pytest.raises(auxout.vllm.WeightSyncError, match=match):
        auxout.vllm.update_weights(engine, bad)
    assert ids_and_logprobs(greedy_outputs(engine, synced["prompts"][:1])) == ids_and_logprobs(
        greedy_outputs(fresh, synced["prompts"][:1])
    )


def test_a_plain_vllm_engine_syncs_too(fresh, synced) -> None:  # type: ignore[no-untyped-def]
    """update_weights on an engine without auxout (its worker is vLLM's): back to the first weights."""
    import auxout.vllm

    r = auxout.vllm.update_weights(fresh, synced["states"][0])
    assert r.moe_layers_repacked == NUM_MOE_LAYERS
    assert ids_and_logprobs(greedy_outputs(fresh, synced["prompts"])) == synced["before"]


def _manifest_keys(completion_owner: Any) -> set[str]:
    """The keys of the request's full hash blocks (a partial last block has a key of its own request)."""
    keys = RouteManifest.from_dict(completion_owner.kv_transfer_params["auxout_routes_manifest"]).keys
    blocks = {k for k in keys if "/boundary/" not in k}
    assert len(blocks) >= 2
    return blocks


def _run_keys(llm: Any, prompt: list[int]) -> tuple[Any, set[str]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=dict(KEYS))
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return out, _manifest_keys(out)


def test_engines_sharing_a_store_never_exchange_routes_of_other_weights(engine, synced, base_path, shared, oracle) -> None:  # type: ignore[no-untyped-def]
    """A second engine on the first weights, the same checkpoint path and the same Redis store:
    whatever generation each is in, neither reads the other's routes; once it is synced to the
    same weights, they share keys (and routes)."""
    import auxout.vllm
    from auxout.manifest import fetch

    old_oracle = Oracle(base_path)
    other = inprocess_llm(base_path, shared)
    try:
        auxout.vllm.update_weights(engine, synced["states"][-1])  # (the synced weights, after the tests above)
        rng = np.random.default_rng(9)
        x, y = (rng.integers(3, 1000, 70).tolist() for _ in range(2))
        tail = [11, 12, 13]
        for reset in (False, True):  # the old engine in its first generation, then in a later one
            if reset:
                assert other.reset_prefix_cache()
            new_x, new_keys = _run_keys(engine, x)
            old_x, old_keys = _run_keys(other, x)
            assert new_keys and old_keys and not new_keys & old_keys
            # a prefix hit on each side reads its own generation's rows from the store, where the
            # other engine published the same blocks first
            (b,) = other.generate([{"prompt_token_ids": x + tail}], greedy_plain(4), use_tqdm=False)
            assert b.num_cached_tokens > 0
            old_oracle.check(x + tail, b.outputs[0])
            _run_keys(other, y + [500 + reset])  # (published first: the store keeps the first copy of a key)
            _run_keys(engine, y + [500 + reset])
            (a,) = engine.generate([{"prompt_token_ids": y + [500 + reset] + tail}], greedy_plain(4), use_tqdm=False)
            assert a.num_cached_tokens > 0
            oracle.check(y + [500 + reset] + tail, a.outputs[0])
            tokens = x + list(new_x.outputs[0].token_ids)
            assert (np.sort(fetch(RouteManifest.from_dict(new_x.kv_transfer_params["auxout_routes_manifest"])), -1)
                    == np.sort(oracle.routes(tokens)[: len(tokens) - 1], -1)).all()  # fmt: skip

        # a sync that changes only the routers' weights is another generation, whatever vLLM-CPU packs
        mixed = dict(synced["states"][-1])
        for name, t in synced["states"][0].items():
            if name.endswith("mlp.gate.weight"):
                mixed[name] = t
        auxout.vllm.update_weights(other, mixed)
        _, mixed_keys = _run_keys(other, x)
        _, new_keys = _run_keys(engine, x)
        assert not mixed_keys & new_keys

        # the same weights: the same keys, and the rows the other engine published
        auxout.vllm.update_weights(other, synced["states"][-1])
        got, same_keys = _run_keys(other, x)
        assert same_keys == new_keys
        tokens = x + list(got.outputs[0].token_ids)
        assert (np.sort(fetch(RouteManifest.from_dict(got.kv_transfer_params["auxout_routes_manifest"])), -1)
                == np.sort(oracle.routes(tokens)[: len(tokens) - 1], -1)).all()  # fmt: skip
    finally:
        close_llm(other)


def greedy_plain(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
