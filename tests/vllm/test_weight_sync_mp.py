"""``auxout.vllm.update_weights`` on vLLM's default engine: the engine core and its worker run in
other processes (the ``mp`` executor), so the tensors travel as bytes through ``collective_rpc``
to auxout's worker, which loads them and repacks the fused-MoE experts there."""

from __future__ import annotations

from typing import Any

import pytest
from routes_oracle import ENGINE_ARGS, Oracle, close_llm, make_llm
from weight_sync_helpers import Trainer, greedy_outputs, ids_and_logprobs, inprocess_llm, prompts

pytestmark = pytest.mark.vllm

NUM_MOE_LAYERS = 2


@pytest.fixture(scope="module")
def base_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def llm(base_path: str):  # type: ignore[no-untyped-def]
    engine = make_llm(base_path, max_model_len=512)
    assert type(engine.llm_engine.engine_core).__name__ == "SyncMPClient"  # (the worker is elsewhere)
    yield engine
    close_llm(engine)


@pytest.fixture(scope="module")
def synced(llm: Any, base_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import auxout.vllm

    ps = prompts(2)
    before = ids_and_logprobs(greedy_outputs(llm, ps))
    trainer = Trainer(base_path, seed=1)
    syncs = []
    for _ in range(2):
        trainer.step()
        syncs.append(auxout.vllm.update_weights(llm, trainer.model.named_parameters(), hf_model=trainer.model))
    path = trainer.save(tmp_path_factory.mktemp("mp") / "ckpt")
    return {"prompts": ps, "before": before, "syncs": syncs, "path": path}


def test_a_multiprocess_engine_syncs_through_collective_rpc(llm, synced) -> None:  # type: ignore[no-untyped-def]
    assert all(s.moe_layers_repacked == NUM_MOE_LAYERS for s in synced["syncs"])
    fresh = inprocess_llm(synced["path"], plain=True)
    try:
        want = ids_and_logprobs(greedy_outputs(fresh, synced["prompts"]))
    finally:
        close_llm(fresh)
    now = greedy_outputs(llm, synced["prompts"])
    assert ids_and_logprobs(now) == want
    assert ids_and_logprobs(now) != synced["before"]
    oracle = Oracle(synced["path"])
    for p, c in zip(synced["prompts"], now):
        oracle.check(p, c)


def test_vllm_reload_over_rpc_is_repaired_in_the_worker(llm, synced) -> None:  # type: ignore[no-untyped-def]
    """vLLM's own ``collective_rpc("reload_weights")`` (from the checkpoint on disk) on auxout's
    worker gives back exactly the first outputs; ``repair_moe_prepack`` reports the layers covered."""
    import auxout.vllm

    assert auxout.vllm.repair_moe_prepack(llm) == NUM_MOE_LAYERS
    llm.collective_rpc("reload_weights")
    assert llm.reset_prefix_cache()
    assert ids_and_logprobs(greedy_outputs(llm, synced["prompts"])) == synced["before"]


@pytest.mark.slow
def test_a_plain_multiprocess_engine_is_refused_with_the_reason(base_path) -> None:  # type: ignore[no-untyped-def]
    import torch
    from vllm import LLM

    import auxout.vllm

    plain = LLM(model=base_path, **{**ENGINE_ARGS, "max_model_len": 256})
    try:
        with pytest.raises(RuntimeError, match="workers run in other processes and are vLLM's own"):
            auxout.vllm.update_weights(plain, {"model.norm.weight": torch.ones(64)})
    finally:
        close_llm(plain)
