"""vLLM V1 workers that capture routes and run auxout's worker connector around every step.

Installed with ``worker_cls``. After the model loads, capture is bound to every fused-MoE
router; once the KV cache is sized, the connector and its store are built (default capacity:
one route object per hash block the KV cache holds). Each step then runs:

``execute_model``: the forward (a step without tokens only applies its metadata, ``begin_step``).
``sample_tokens``: sampling, then ``begin_step(metadata)``, ``prepare_output`` with each
request's computed-token count before the step, the batch's query start offsets and a snapshot
of the captured rows, and ``process_output(sampled, rejected)``; the ``StepOutput`` rides back to
the scheduler in ``ModelRunnerOutput.aux_output_connector_output``. (When ``execute_model``
returns the final output itself, it does all of that at once.)
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.worker.gpu_worker import Worker

from auxout.connector.messages import StepOutput
from auxout.connector.row_check import RowCheck
from auxout.connector.worker import PendingStep, WorkerConnector
from auxout.errors import InvariantError
from auxout.stores import make_store
from auxout.vllm.config import route_keyspace, weights_digest
from auxout.vllm.options import options_from_vllm_config, shares_routes
from auxout.vllm.weight_sync import (
    generation_digest,
    install_load_digests,
    install_prepack_repair,
    load_on_worker,
    load_path_on_worker,
)
from auxout.vllm.workers.async_output import RoutedAsyncOutput
from auxout.vllm.workers.capture import RouteCapture, bind_capture
from auxout.vllm.workers.topology import RankRole, current_role, install_pipeline_rows

logger = logging.getLogger("vllm.auxout")  # under vLLM's logger: its handlers and format


SEND_AHEAD_ENV = "AUXOUT_SEND_AHEAD"
"""``0`` turns off sending a steady decode step's output before the connector runs (the worker
then makes the connector's calls before it sends each output, as for any other step)."""


class _AfterSend:
    """The multiprocess executor's output hook: the worker of this process, called after each
    output it sends (``active`` once it was: only then is a step's output sent ahead)."""

    active = False
    worker: Any = None


_AFTER_SEND = _AfterSend()


def install_after_send(worker: Any) -> None:
    """Call ``worker._auxout_after_send()`` after vLLM's multiprocess executor sends each output.

    ``WorkerProc.enqueue_output`` puts a worker's result on the engine core's response queue;
    what runs after it runs while the engine core works and the worker would wait. Wrapped in
    this (worker) process only, once; the uni executor never calls it.
    """
    try:
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError:  # (an executor without it: outputs are settled at the next call instead)
        return
    if not getattr(WorkerProc.enqueue_output, "_auxout_after_send", False):
        original = WorkerProc.enqueue_output

        def enqueue_output(self: Any, output: Any) -> None:
            original(self, output)
            hooked = _AFTER_SEND.worker
            if hooked is not None:
                _AFTER_SEND.active = True
                hooked._auxout_after_send()

        enqueue_output._auxout_after_send = True  # type: ignore[attr-defined]
        WorkerProc.enqueue_output = enqueue_output  # type: ignore[method-assign]
    _AFTER_SEND.worker = worker


def num_rejected_tokens(
    req_ids: list[str], num_sampled: np.ndarray, scheduled: dict[str, int], spec_tokens: dict[str, list[int]]
) -> np.ndarray:
    """Rows of each request whose input tokens were rejected drafts: ``scheduled - sampled`` when drafted."""
    out = np.zeros(len(req_ids), dtype=np.int64)
    for i, rid in enumerate(req_ids):
        drafts = spec_tokens.get(rid)
        if drafts and num_sampled[i] > 0:
            out[i] = scheduled[rid] - int(num_sampled[i])
    return out


def _check_output(output: Any) -> Any:
    """``output`` itself, if it is a step's own ``ModelRunnerOutput`` (the routes go on it)."""
    if not isinstance(output, ModelRunnerOutput) or output is EMPTY_MODEL_RUNNER_OUTPUT:
        raise RuntimeError(f"auxout needs the step's ModelRunnerOutput, got {type(output).__name__}")
    return output


class AuxoutWorkerMixin:
    """Route capture and connector calls, shared by the CPU and GPU worker classes."""

    vllm_config: Any
    model_runner: Any
    _auxout_capture: RouteCapture | None = None
    _auxout_async_steps = 0  # steps whose routes were committed from an AsyncModelRunnerOutput
    _auxout_role: RankRole = RankRole(captures=True, owns_routes=True, pp_size=1, last_stage=True)
    _auxout_connector: WorkerConnector | None = None
    _auxout_pending: tuple[PendingStep, list[str], dict[str, int], dict[str, list[int]]] | None = None
    _auxout_done: StepOutput | None = None  # a step committed when prepared, for its output
    _auxout_executed: tuple[WorkerConnector, Any, int, list[str], Any] | None = None  # forward done, not prepared yet
    # Async scheduling resolves step outputs on the executor's output thread: connector calls lock.
    _auxout_lock: threading.Lock = threading.Lock()
    # a decode step whose output was sent before the connector ran (``_auxout_send_first``)
    _auxout_sent: (
        tuple[WorkerConnector, Any, list[str], list[int], list[int], np.ndarray, StepOutput] | None
    ) = None
    _auxout_sent_error: BaseException | None = None  # raised by the worker's next call
    _auxout_send_ahead = False  # steady decode steps' outputs may be sent before the connector runs
    _auxout_sent_ahead_steps = 0  # steps whose output went out before the connector ran (rank state)
    _auxout_late: tuple[list[str], list[str]] = ((), ())  # type: ignore[assignment]  # store reports for the next output
    _auxout_loaded: dict[str, bytes]  # digests of the tensors loaded in place, by name

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        sched = self.vllm_config.scheduler_config
        role = self._auxout_role = current_role()
        weights = options_from_vllm_config(self.vllm_config).routing_weights
        # every rank takes part (PP stages exchange their MoE layer ids), then only some keep it
        capture: RouteCapture | None = bind_capture(
            self.model_runner.get_model(), self.vllm_config.model_config, sched.max_num_batched_tokens, role.pp_size,
            weights,
        )
        if not role.captures and capture is not None:  # TP rank > 0: the same ids as TP rank 0
            capture.unbind()
            capture = None
        if role.pp_size > 1:  # stages forward their rows downstream with the hidden states
            install_pipeline_rows(
                self.model_runner,
                capture.load_rows if capture is not None else None,
                capture.rows_bytes if capture is not None and role.ships_rows else None,
            )
        self._auxout_capture = capture
        # in-place weight updates: the fused-MoE prepack re-run on every reload, and every tensor
        # loaded in place named in the weights digest of the next generation
        model = self.model_runner.get_model()
        install_prepack_repair(model)
        self._auxout_loaded = {}
        if shares_routes(options_from_vllm_config(self.vllm_config)):  # (others read its keys)
            install_load_digests(model, self._auxout_loaded)

    def auxout_update_weights(self, payload: Any) -> dict[str, int]:
        """Load checkpoint-named tensors in place (``auxout.vllm.update_weights`` calls it)."""
        self._auxout_settle()
        return load_on_worker(self, payload)

    def auxout_load_weights_path(self, path: str) -> dict[str, Any]:
        """Load a safetensors file or directory in place (``POST /auxout/update_weights``)."""
        self._auxout_settle()
        return load_path_on_worker(self, path)

    def auxout_weights_version(self) -> str:
        """The digest of the weights this worker runs (a route session's weights version)."""
        return generation_digest(weights_digest(self.model_runner.get_model()), self._auxout_loaded)

    def auxout_repair_moe_prepack(self) -> int:
        """Fused-MoE layers whose reloads re-run the prepack (installed at load time)."""
        return install_prepack_repair(self.model_runner.get_model())

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        super().initialize_from_config(kv_cache_config)  # type: ignore[misc]
        self._auxout_build_connector(kv_cache_config)

    def _auxout_build_connector(self, kv_cache_config: Any) -> None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        if not self._auxout_role.owns_routes:
            return  # only the output rank keeps routes (see auxout.vllm.workers.topology)
        if self._auxout_capture is None:
            raise RuntimeError("auxout: the KV cache was sized before the model was loaded")
        if not self.vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("auxout routes need prefix caching (enable_prefix_caching=True)")
        opts = options_from_vllm_config(self.vllm_config)
        profile = self._auxout_capture.profile
        kv_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, self.vllm_config)
        object_nbytes = profile.block_nbytes(hash_block)
        max_bytes = opts.max_bytes or kv_cache_config.num_blocks * (kv_block // hash_block) * object_nbytes
        sched = self.vllm_config.scheduler_config
        # A KV producer (P/D prefill, a connector saving KV for restarts) publishes each step's
        # routes before the step returns: the consumer may ask for them as soon as it gets the KV.
        ktc = self.vllm_config.kv_transfer_config
        producer = ktc is not None and getattr(ktc, "kv_role", None) in ("kv_producer", "kv_both")
        store = make_store(
            opts.store, max_bytes=max_bytes, object_nbytes=object_nbytes, background=not producer, **opts.store_options
        )
        if self._auxout_connector is not None:
            self._auxout_settle()
            self._auxout_connector.close()
        self._auxout_lock = threading.Lock()
        self._auxout_late = ((), ())  # type: ignore[assignment]
        # a step's output is sent before its connector calls only where nothing reads its
        # publications before the next step (not a KV producer) and one step is in flight
        self._auxout_send_ahead = (
            not sched.async_scheduling and not producer and os.environ.get(SEND_AHEAD_ENV, "1") != "0"
        )
        if self._auxout_send_ahead:
            install_after_send(self)
        self._auxout_connector = WorkerConnector(
            profile,
            block_size=hash_block,
            store=store,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            # async scheduling: the next step is prepared before this one's output resolves
            max_concurrent_batches=2 if sched.async_scheduling else 1,
            keyspace=route_keyspace(self.vllm_config, opts, hash_block),
            # routes others read: a generation after a reset is named by the weights (read then)
            weights_digest=(
                (lambda: generation_digest(weights_digest(self.model_runner.get_model()), self._auxout_loaded))
                if shares_routes(opts)
                else None
            ),
            row_check=RowCheck(profile),  # (a request with rows no router makes is never stored nor returned)
        )
        logger.info(
            "auxout: routes %s x %s, hash block %d, store %s with %d bytes",
            profile.shape_per_token, profile.dtype, hash_block, opts.store, max_bytes,
        )

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if self._auxout_sent is not None or self._auxout_sent_error is not None:
            self._auxout_settle()  # (normally done already, right after the last output was sent)
        conn = self._auxout_connector
        meta = getattr(scheduler_output, "aux_output_connector_metadata", None)
        if conn is not None and (meta is None or scheduler_output.total_num_scheduled_tokens == 0):
            with self._auxout_lock:  # (no rows this step: only the metadata to apply)
                conn.begin_step(meta)
            conn = None
        output = super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        if conn is None:
            return output
        batch = self.model_runner.input_batch
        n = batch.num_reqs
        step = (conn, meta, n, batch.req_ids[:n], scheduler_output)  # (a new list: vLLM reorders its own in place)
        if output is not None:  # output already final (no separate sampling call)
            self._auxout_prepare(step)
            return self._auxout_finish(output)
        self._auxout_executed = step
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)  # type: ignore[misc]
        step, self._auxout_executed = self._auxout_executed, None
        if step is not None:
            rows = (
                self._auxout_send_first(step, output)
                if self._auxout_send_ahead and _AFTER_SEND.active
                else None
            )
            if rows is True:
                return output
            self._auxout_prepare(step, rows)
        return self._auxout_finish(output)

    def _auxout_send_first(self, step: tuple[WorkerConnector, Any, int, list[str], Any], output: Any) -> Any:
        """A steady decode step's output, sent before the connector runs (True), else its snapshot.

        The worker process waits for its next step while the engine core takes this one's
        output and schedules; work done in that wait costs no throughput, work done before the
        output is sent does (benchmarks/probes/idle_windows.py). So for the decode lane's next step the
        output is built from the snapshot alone (``WorkerConnector.peek_lane_step``) and sent;
        the connector's calls run right after the send (``_auxout_settle_sent``, from the
        executor's output hook), or at the latest before the worker's next call, and must
        return exactly that output (else ``InvariantError``). Their store reports ride with the
        next output. Only in a synchronous engine with the multiprocess executor.
        """
        conn, meta, n, req_ids, scheduler_output = step
        runner = self.model_runner
        assert self._auxout_capture is not None
        q = runner.query_start_loc.np[: n + 1].tolist()
        rows = self._auxout_capture.snapshot(q[-1])
        if (
            meta is None or scheduler_output.scheduled_spec_decode_tokens or type(output) is not ModelRunnerOutput
            or output is EMPTY_MODEL_RUNNER_OUTPUT or conn.max_concurrent_batches != 1
        ):  # fmt: skip
            return rows
        starts = runner.input_batch.num_computed_tokens_cpu[:n].tolist()
        sent = conn.peek_lane_step(meta, req_ids, starts, q, rows)
        if sent is None:
            return rows
        sent.published, sent.lost = self._auxout_reports()
        output.aux_output_connector_output = sent  # type: ignore[assignment]
        self._auxout_sent = (conn, meta, req_ids, starts, q, rows, sent)
        self._auxout_sent_ahead_steps += 1
        return True

    def _auxout_reports(self) -> tuple[list[str], list[str]]:
        """Store reports of steps settled after their output was sent, for the next output."""
        published, lost = self._auxout_late
        if not published and not lost:
            return [], []
        self._auxout_late = ((), ())  # type: ignore[assignment]
        return list(published), list(lost)

    def _auxout_settle(self) -> None:
        """Before any other use of the connector: the step sent ahead settled, or its error raised."""
        error, self._auxout_sent_error = self._auxout_sent_error, None
        if error is not None:
            raise error
        self._auxout_settle_sent()

    def _auxout_settle_sent(self) -> None:
        """Run the connector's calls for the step sent ahead, and check they return what was sent."""
        job, self._auxout_sent = self._auxout_sent, None
        if job is None:
            return
        conn, meta, req_ids, starts, q, rows, sent = job
        with self._auxout_lock:
            out = conn.commit_lane_step(meta, req_ids, starts, q, rows)  # (the three calls in one)
            if out is None:  # (not the lane's next step after all, or it brings more: the three calls)
                conn.begin_step(meta)
                pending = conn.prepare_output(req_ids, np.array(starts, dtype=np.int64), q, rows)
                out = None if pending is None else conn.process_output(pending)
        if (
            out is None or out.lo is not sent.lo or out.hi is not sent.hi or out.rows is not rows or out.errors
            or out.heads or out.weights is not None or out.one_row_starts != sent.one_row_starts
            or out.token_starts.tobytes() != sent.token_starts.tobytes()
        ):  # fmt: skip
            raise InvariantError(
                "auxout: a decode step whose output was sent ahead did not commit as the decode lane's "
                "next step (a connector bug: please report it)"
            )
        if out.published or out.lost:
            published, lost = self._auxout_late
            self._auxout_late = ([*published, *out.published], [*lost, *out.lost])

    def _auxout_after_send(self) -> None:
        """After the executor sent an output: the step sent ahead is settled here, off the clock.

        An error is kept and raised at the worker's next call (where it fails that step, as it
        would have failed this one)."""
        if self._auxout_sent is None:
            return
        try:
            self._auxout_settle_sent()
        except BaseException as exc:  # (the executor's loop is not ours to break)
            self._auxout_sent_error = exc

    def _auxout_prepare(
        self, step: tuple[WorkerConnector, Any, int, list[str], Any], rows: Any = None
    ) -> None:
        """Apply the step's metadata, snapshot its rows and register it with the connector.

        Runs after sampling when sampling follows the forward: nothing in the forward depends on
        the connector (capture only holds the routers' ids), and after the sampler, which runs
        torch and numpy, this code finds them in cache; right after the forward it ran cold.
        The routers' ids tensors and the batch's ``query_start_loc`` and
        ``num_computed_tokens_cpu`` stay as the forward left them until the next
        ``execute_model`` (vLLM's sampling and bookkeeping write neither).
        """
        conn, meta, n, req_ids, scheduler_output = step
        runner = self.model_runner
        qsl = runner.query_start_loc.np[: n + 1]  # (prepare_output copies what it keeps)
        starts = runner.input_batch.num_computed_tokens_cpu[:n]
        assert self._auxout_capture is not None
        if rows is None:
            rows = self._auxout_capture.snapshot(int(qsl[-1]))
        spec = scheduler_output.scheduled_spec_decode_tokens  # (scheduled counts matter only with drafts)
        if not spec and meta is not None and conn.max_concurrent_batches == 1:  # the decode lane's next step?
            with self._auxout_lock:
                done = conn.commit_lane_step(meta, req_ids, starts.tolist(), qsl.tolist(), rows)
            if done is not None:
                self._auxout_done = done
                return
        with self._auxout_lock:
            conn.begin_step(meta)
            pending = conn.prepare_output(req_ids, starts, qsl, rows)
        if pending is not None:
            self._auxout_pending = (
                (pending, req_ids, dict(scheduler_output.num_scheduled_tokens), dict(spec)) if spec
                else (pending, req_ids, {}, {})
            )  # fmt: skip

    def _auxout_finish(self, output: Any) -> Any:
        done = self._auxout_done
        if done is not None:  # committed in one call already (``commit_lane_step``)
            self._auxout_done = None
            if isinstance(output, AsyncModelRunnerOutput):  # (not with one batch in flight; kept exact)
                return RoutedAsyncOutput(output, lambda resolved: self._auxout_attach(_check_output(resolved), done))
            return self._auxout_attach(_check_output(output), done)
        step = self._auxout_pending
        if step is None:
            return output
        self._auxout_pending = None
        if isinstance(output, AsyncModelRunnerOutput):  # async scheduling: commit when it resolves
            self._auxout_async_steps += 1
            return RoutedAsyncOutput(output, lambda resolved: self._auxout_commit(step, resolved))
        return self._auxout_commit(step, output)

    def _auxout_commit(
        self, step: tuple[PendingStep, list[str], dict[str, int], dict[str, list[int]]], output: Any
    ) -> Any:
        _check_output(output)
        pending, req_ids, scheduled, spec = step
        rejected = None  # (sampled counts matter only where drafts may have been rejected)
        if spec:
            sampled_ids = output.sampled_token_ids
            if output.req_ids == req_ids and len(sampled_ids) == len(req_ids):  # the same batch order (usual)
                num_sampled = np.fromiter(map(len, sampled_ids), dtype=np.int64, count=len(req_ids))
            else:
                index = output.req_id_to_index
                num_sampled = np.fromiter(
                    (len(sampled_ids[index[r]]) if r in index else 0 for r in req_ids),
                    dtype=np.int64, count=len(req_ids),
                )  # fmt: skip
            rejected = num_rejected_tokens(req_ids, num_sampled, scheduled, spec)
        assert self._auxout_connector is not None
        with self._auxout_lock:
            routes = self._auxout_connector.process_output(pending, None, rejected)
        return self._auxout_attach(output, routes)

    def _auxout_attach(self, output: Any, routes: StepOutput) -> Any:
        """Put a step's routes (and the store reports of steps settled after their output was
        sent) on its ``ModelRunnerOutput`` (checked by the caller: ``_check_output``)."""
        late = self._auxout_late
        if late[0] or late[1]:  # (reports of steps settled after their output was sent)
            published, lost = self._auxout_reports()
            routes.published, routes.lost = published + routes.published, lost + routes.lost
        # vLLM types the field as its own connector output; the scheduler bridge reads ours.
        output.aux_output_connector_output = routes  # type: ignore[assignment]
        return output

    def auxout_rank_state(self) -> dict[str, Any]:
        """What this rank does for routes (``llm.collective_rpc("auxout_rank_state")``)."""
        self._auxout_settle()
        role, capture, conn = self._auxout_role, self._auxout_capture, self._auxout_connector
        return {
            "captures": capture is not None,
            "columns": [] if capture is None else list(capture.columns),
            "num_moe_layers": None if capture is None else capture.profile.num_layers,
            "owns_routes": conn is not None,
            "ships_rows": role.ships_rows,
            "max_concurrent_batches": None if conn is None else conn.max_concurrent_batches,
            "async_scheduling": bool(self.vllm_config.scheduler_config.async_scheduling),
            "async_steps": self._auxout_async_steps,
            "send_ahead": self._auxout_send_ahead,
            "sent_ahead_steps": self._auxout_sent_ahead_steps,
            "impossible_requests": None if conn is None else conn.impossible_requests,
        }

    def shutdown(self) -> None:
        _AFTER_SEND.worker = None
        self._auxout_sent = self._auxout_sent_error = None  # (an output sent ahead needs nothing more now)
        if self._auxout_connector is not None:
            try:
                self._auxout_connector.close()
            except Exception:  # shutting down: report, never mask the engine's own shutdown
                logger.exception("auxout: closing the worker connector failed")
            self._auxout_connector = None
        if self._auxout_capture is not None:
            self._auxout_capture.unbind()
        super().shutdown()  # type: ignore[misc]


class AuxoutGPUWorker(AuxoutWorkerMixin, Worker):
    """GPU (V1 model runner) worker with routes; untested here (no GPU)."""
