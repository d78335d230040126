"""Tensor parallel (``tensor_parallel_size=2``, multiprocess executor) on vLLM-CPU.

Both ranks run the same router on the same all-reduced hidden states; rank 0 captures and owns
the connector and store, rank 1 neither captures nor publishes. ``VLLM_CPU_OMP_THREADS_BIND``
pins one OpenMP thread per rank to its own core (without it vLLM refuses: "Not enough allowed
NUMA nodes to bind threads of 2 local CPUWorkers").
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
        engine = make_llm(model_path, tensor_parallel_size=2, **ENGINE_KW)
    yield engine
    close_llm(engine)


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


def test_only_rank_zero_captures_and_publishes(llm):
    rank0, rank1 = llm.collective_rpc("auxout_rank_state")
    assert rank0["captures"] and rank0["owns_routes"] and rank0["columns"] == [0, 1]
    assert not rank1["captures"] and not rank1["owns_routes"] and not rank1["ships_rows"]


def test_chunked_prefill_and_prefix_hit(llm, oracle):
    chunked_prefill_and_prefix_hit(llm, oracle, seed=31)


def test_concurrent_requests_with_preemption(llm, oracle):
    concurrent_with_preemption(llm, oracle, seed=32)
