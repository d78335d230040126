"""Rank duties, MoE column order and per-DP-rank key namespaces (no engine).

The data-parallel case runs two SimEngines (auxout's real connectors and store) that share one
store, as two DP ranks share a redis or mooncake store: the same prompt gives the same block
hashes on both, while their routes differ in bytes (two routers stand for the numeric drift a
different batch composition causes at near-ties). With one namespace per rank each rank reads
back exactly its own routes; with a shared namespace one rank is served the other's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from auxout.keys import KeySpace
from auxout.stores import ArenaStore
from auxout.testing import FakeMoE, SimEngine, oracle_routes
from auxout.vllm.workers.topology import RankRole, dp_keyspace, role_of

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("tp_rank", "pp_size", "first", "last", "expected"),
    [
        (0, 1, True, True, RankRole(captures=True, owns_routes=True, pp_size=1, last_stage=True)),
        (1, 1, True, True, RankRole(captures=False, owns_routes=False, pp_size=1, last_stage=True)),
        # PP: a non-last stage ships rows from every TP rank (send_tensor_dict may split by TP)
        (0, 2, True, False, RankRole(captures=True, owns_routes=False, pp_size=2, last_stage=False)),
        (1, 2, True, False, RankRole(captures=True, owns_routes=False, pp_size=2, last_stage=False)),
        (0, 2, False, True, RankRole(captures=True, owns_routes=True, pp_size=2, last_stage=True)),
        (1, 2, False, True, RankRole(captures=False, owns_routes=False, pp_size=2, last_stage=True)),
    ],
)
def test_rank_roles(tp_rank, pp_size, first, last, expected):
    role = role_of(tp_rank, pp_size, first, last)
    assert role == expected
    assert role.ships_rows == (role.captures and not last)


def test_route_keyspace_per_dp_rank():
    one = SimpleNamespace(data_parallel_size=1, data_parallel_rank=0, data_parallel_index=0)
    assert dp_keyspace("ns", one) == KeySpace("ns")  # keys unchanged without DP
    ranks = [SimpleNamespace(data_parallel_size=2, data_parallel_rank=0, data_parallel_index=i) for i in (0, 1)]
    spaces = [dp_keyspace("ns", pc) for pc in ranks]
    assert spaces == [KeySpace("ns/dp0"), KeySpace("ns/dp1")]
    h = [bytes(range(32))]
    assert spaces[0].keys(h, 0) != spaces[1].keys(h, 0)


def test_route_keyspace_reads_vllms_dp_rank():
    """On the config vLLM builds for each DP rank (``LLM(data_parallel_size=2)`` itself is refused
    offline: "not supported for single-process usage"; each rank is its own engine)."""
    from vllm.engine.arg_utils import EngineArgs

    from auxout.testing.models import build_tiny_moe

    path = build_tiny_moe("qwen3_moe")
    spaces = [
        dp_keyspace(
            "ns",
            EngineArgs(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
                       data_parallel_size=2, data_parallel_rank=rank).create_engine_config().parallel_config,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    assert spaces == [KeySpace("ns/dp0"), KeySpace("ns/dp1")]


def _rank(model: FakeMoE, store: ArenaStore, keyspace: KeySpace) -> SimEngine:
    # what dp_keyspace gives each rank's worker and scheduler; the store is shared by both ranks
    return SimEngine(model, block_size=4, num_kv_blocks=64, store=store, namespace=keyspace.namespace, shared_store=True)


def _two_turns(eng: SimEngine, model: FakeMoE, prompt: list[int]) -> list[bool]:
    """Cold turn, then a turn that hits the first turn's prefix; whether each equals the oracle."""
    eng.add_request("t1", prompt, 3)
    r1 = eng.run()["t1"]
    eng.store.flush()
    eng.add_request("t2", r1.tokens + [5, 6, 7], 3)
    r2 = eng.run()["t2"]
    assert r2.num_cached_tokens >= 12, "the second turn must read its prefix from the store"
    return [r.routed_experts is not None and np.array_equal(r.routed_experts, oracle_routes(model, r)) for r in (r1, r2)]


@pytest.mark.parametrize("separate", [True, False], ids=["namespace-per-rank", "shared-namespace"])
def test_dp_ranks_sharing_a_store(separate):
    models = [FakeMoE(num_layers=2, top_k=2, num_experts=8, vocab_size=100, seed=s) for s in (7, 8)]
    store = ArenaStore(256 * models[0].profile.block_nbytes(4), models[0].profile.block_nbytes(4))
    spaces = [KeySpace.for_instance("rl", r) if separate else KeySpace("rl") for r in (0, 1)]
    prompt = list(range(10, 30))  # five blocks: identical block hashes on both ranks
    engines = [_rank(model, store, space) for model, space in zip(models, spaces, strict=True)]
    try:  # both ranks live at once (closing one would close the shared store)
        ok = [_two_turns(eng, model, prompt) for eng, model in zip(engines, models, strict=True)]
        for eng in engines:  # every rank's writer done before the first close closes the shared store
            eng.store.flush()
    finally:
        for eng in engines:
            eng.close()
    if separate:
        assert ok == [[True, True], [True, True]]
    else:  # the control: rank 1's prefix hit is served rank 0's bytes
        assert ok[0] == [True, True] and ok[1][1] is False
