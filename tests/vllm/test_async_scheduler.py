"""auxout's scheduler on vLLM's real ``Scheduler`` and ``AsyncScheduler`` (no engine, no model).

vLLM-CPU forces ``async_scheduling`` off (``CpuPlatform.check_and_update_config``) and its model
runner cannot build the async output path (``torch.cuda.Event`` is a dummy class in CPU torch),
so the async path is proven here: vLLM's own scheduler classes, driven the way ``EngineCore``
drives them (one step in flight under async scheduling), with auxout's real worker connector
fed by a causal fake router, and step outputs resolved on a separate thread through auxout's
worker code. Every request's routes must equal a full pass over its tokens, through chunked
prefill, prefix-cache hits, preemption (stale in-flight outputs) and aborts.
"""

from __future__ import annotations

import numpy as np
import pytest
from sched_harness import SchedulerHarness

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


def _check(h: SchedulerHarness, done: dict, starts: dict[str, int] | None = None) -> None:
    starts = starts or {}
    for rid, f in done.items():
        assert f.finish_reason == "length", (rid, f.finish_reason)
        expected = h.expected(f, starts.get(rid, 0))
        assert f.routes is not None, rid
        assert f.routes.shape == expected.shape, (rid, f.routes.shape, expected.shape)
        assert np.array_equal(f.routes, expected), f"{rid}: routes differ from a full pass"


def test_selector_builds_on_the_base_the_config_asks_for(model_path):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from auxout.vllm.engine_core.async_scheduler import AuxoutAsyncScheduler
    from auxout.vllm.engine_core.scheduler import AuxoutScheduler

    sync = SchedulerHarness(model_path, async_scheduling=False)
    asyn = SchedulerHarness(model_path, async_scheduling=True)
    try:
        assert type(sync.scheduler) is AuxoutScheduler and not isinstance(sync.scheduler, AsyncScheduler)
        assert type(asyn.scheduler) is AuxoutAsyncScheduler and isinstance(asyn.scheduler, AsyncScheduler)
        # auxout's hooks run first, then vLLM's async bookkeeping, then the base scheduler
        mro = AuxoutAsyncScheduler.__mro__
        assert mro.index(AuxoutScheduler) < mro.index(AsyncScheduler) < mro.index(AsyncScheduler.__base__)
        assert asyn.scheduler.aux_output_connector is asyn.scheduler.auxout
    finally:
        sync.close()
        asyn.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_routes_through_chunks_prefix_hits_and_preemption(model_path, async_scheduling):
    h = SchedulerHarness(model_path, async_scheduling=async_scheduling, num_blocks=20, max_num_batched_tokens=48)
    try:
        rng = np.random.default_rng(0)
        base = rng.integers(3, 900, 40).tolist()
        for i in range(6):
            h.add(f"r{i}", base + rng.integers(3, 900, 5 + 13 * i).tolist(), 60)
        done = h.run()
        assert sorted(done) == [f"r{i}" for i in range(6)]
        _check(h, done)
        assert h.num_preemptions > 0, "the KV cache must be small enough to preempt"
        assert max(f.num_cached_tokens for f in done.values()) >= 32, "no prefix-cache hit"
        assert h.max_inflight == (2 if async_scheduling else 1)
        # a second turn extends the first: prefix hit across turns, routes still exact
        first = done["r5"]
        h.add("turn2", first.tokens + rng.integers(3, 900, 9).tolist(), 12, routed_experts_prompt_start=30)
        again = h.run()
        assert again["turn2"].num_cached_tokens >= 64
        _check(h, again, {"turn2": 30})
    finally:
        h.close()


def test_async_abort_in_flight_and_opt_out(model_path):
    from vllm.v1.request import RequestStatus

    h = SchedulerHarness(model_path, async_scheduling=True)
    try:
        rng = np.random.default_rng(1)
        prompts = {f"a{i}": rng.integers(3, 900, 30 + 7 * i).tolist() for i in range(3)}
        for rid, p in prompts.items():
            h.add(rid, p, 25)
        h.add("quiet", rng.integers(3, 900, 20).tolist(), 10, extra_args={"return_routed_experts": False})
        for _ in range(8):
            h.step()
        assert h._queue, "a step must be in flight when the abort lands"
        h.scheduler.finish_requests("a1", RequestStatus.FINISHED_ABORTED)
        done = h.run()
        assert "a1" not in done
        assert done["quiet"].routes is None
        del done["quiet"]
        _check(h, done)
        # (the last finished request's terminal event rides the next step's metadata)
        assert "a1" not in h.connector.tracked_requests(), "aborted request leaked worker state"
        # the aborted request's prefix was published and serves a later request exactly
        h.add("after", prompts["a1"] + rng.integers(3, 900, 4).tolist(), 5)
        again = h.run()
        assert again["after"].num_cached_tokens >= 32
        _check(h, again)
    finally:
        h.close()


def test_async_prefix_cache_reset_between_turns(model_path):
    h = SchedulerHarness(model_path, async_scheduling=True)
    try:
        rng = np.random.default_rng(2)
        p = rng.integers(3, 900, 70).tolist()
        h.add("t1", p, 8)
        first = h.run()["t1"]
        assert h.scheduler.reset_prefix_cache()
        h.add("t2", first.tokens + rng.integers(3, 900, 5).tolist(), 8)
        second = h.run()
        assert second["t2"].num_cached_tokens == 0
        _check(h, second)
        assert h.connector.generation == 1
    finally:
        h.close()
