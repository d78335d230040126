"""vLLM V1 scheduler that drives auxout's scheduler connector (``scheduler_cls``).

vLLM 0.32's ``Scheduler`` already calls an ``aux_output_connector`` at the right points (step
metadata, request freed or preempted, per-request output, prefix-cache reset); it only builds
its own when vLLM's Model Runner V2 feature is on. This subclass installs auxout's connector
there through :class:`SchedulerBridge` and adds what vLLM does not do: per-request admission
(opt-in/out, ``routed_experts_prompt_start``), and a KV hit that never fails for missing
routes: the local prefix hit (``_get_local_prefix_cache_hit``) and a KV connector's external
hit (``get_num_new_matched_tokens``) are clipped to the blocks whose routes are readable, and a
request whose prefix rows still could not be read drops that step's samples and is preempted,
so it recomputes them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from operator import attrgetter
from typing import Any

import numpy as np
from vllm.sampling_params import RequestOutputKind
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request, RequestStatus

from auxout.connector.held_rows import HeldRows
from auxout.connector.keys_output import KeysPublisher
from auxout.connector.messages import StepOutput
from auxout.connector.scheduler import SchedulerConnector
from auxout.errors import BlockStoreError, RequestValidationError, RoutesUnavailableError
from auxout.keys import KeySpace
from auxout.manifest import RouteManifest
from auxout.profile import WEIGHT_DTYPE, has_weights, id_dtype_for, rows_as_bytes
from auxout.stores import BlockStore, make_store
from auxout.stores.rows import StoreRows
from auxout.vllm.config import route_keyspace
from auxout.vllm.fields import (
    INLINE_REASON_FIELD,
    MANIFEST_FIELD,
    OUTPUT_FLAG,
    RECOMPUTED_FIELD,
    REQUEST_FLAG,
    RESET_AT_FIELD,
    WEIGHTS_FLAG,
    WEIGHTS_SPLIT,
    normalize_flag,
)
from auxout.vllm.options import SHARED_STORES, VllmOptions, options_from_vllm_config, shares_routes

logger = logging.getLogger("vllm.auxout")  # under vLLM's logger: its handlers and format

# vLLM's ``RequestStatus.is_finished(status)`` is ``status > RequestStatus.PREEMPTED``
_LAST_UNFINISHED = RequestStatus.PREEMPTED
_status = attrgetter("status")
_NO_SKIP: frozenset[str] = frozenset()
assert not RequestStatus.is_finished(_LAST_UNFINISHED) and RequestStatus.is_finished(RequestStatus.FINISHED_STOPPED)


def request_route_options(request: Any) -> tuple[object, object, object]:
    """``(prompt_start, return_routes, output)`` as the request carries them (validated by the connector)."""
    params = request.sampling_params
    if params is None:  # pooling request: no sampled tokens, no routes
        return 0, False, None
    extra = params.extra_args or {}
    return params.routed_experts_prompt_start, normalize_flag(extra.get(REQUEST_FLAG)), extra.get(OUTPUT_FLAG)


def is_pd_prefill_leg(request: Any) -> bool:
    """The prefill leg of a disaggregated (P/D) request: ``kv_transfer_params.do_remote_decode``.

    It returns no route rows: the decode engine returns the whole sequence's, prompt included
    (read back from the shared store), so a router that splices the two responses' rows has
    nothing to splice. Its routes are still captured and published for the decode side."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def engine_rows(rows: np.ndarray, request: Any) -> np.ndarray:
    """What goes into ``EngineCoreOutput.routed_experts``: the ids, or with routing weights
    captured and asked for, the (id, weight) rows as ``uint8 [n, L, K, item bytes]`` (vLLM's
    messages carry no structured arrays; the frontend splits them: ``caller.completion_fields``)."""
    if not has_weights(rows):
        return rows
    params = request.sampling_params
    extra = (params.extra_args or {}) if params is not None else {}
    if normalize_flag(extra.get(WEIGHTS_FLAG)) is True:
        if extra.get(WEIGHTS_SPLIT):
            return rows_as_bytes(rows)
        _warn_unsplit(request.request_id)
    return np.ascontiguousarray(rows["id"])


_WARNED_UNSPLIT = False


def _rows_at_finish_only(params: Any) -> bool:
    """A request whose rows go out with its final output only: sampled, no stop strings (the
    frontend may stop those on text without a final engine output), not streamed."""
    return params is not None and not params.stop and params.output_kind != RequestOutputKind.DELTA


def _warn_unsplit(request_id: str) -> None:
    global _WARNED_UNSPLIT
    if not _WARNED_UNSPLIT:
        _WARNED_UNSPLIT = True
        logger.warning(
            "auxout: request %s asked for %s, but the process that sent it has no auxout hooks (plain `vllm serve` "
            "or an LLM built without auxout.vllm.engine_kwargs()): it gets the ids alone; use `auxout serve` or "
            "engine_kwargs() to receive routing weights (warned once)",
            request_id,
            WEIGHTS_FLAG,
        )


class SharedStoreClient:
    """The scheduler's one client of the shared store, opened on first use.

    The keys publisher and the prefix-hit check share it (one connection per engine). It is
    sized by an upper bound on one route object, known before any rows are seen (the publisher
    writes exact blocks and shorter boundary pieces; the check reads no payload); a publisher
    that needs more reopens it wider.
    """

    def __init__(self, opts: VllmOptions, max_object_nbytes: int) -> None:
        self.opts = opts
        self.max_object_nbytes = max_object_nbytes
        self._store: BlockStore | None = None

    def __call__(self, object_nbytes: int = 0) -> BlockStore:
        if object_nbytes > self.max_object_nbytes:  # the config-derived bound was short: reopen wider
            self.max_object_nbytes = object_nbytes
            if self._store is not None:
                self._store.close()
                self._store = None
        if self._store is None:
            n = self.max_object_nbytes
            self._store = make_store(
                self.opts.store, max_bytes=n, object_nbytes=n, background=False, **self.opts.store_options
            )
        return self._store


def make_publisher(
    opts: VllmOptions, block_size: int, client: SharedStoreClient, keyspace: KeySpace | None = None
) -> KeysPublisher | None:
    """The keys-only publisher on the shared store (None for an in-process store)."""
    if opts.store not in SHARED_STORES:
        return None
    return KeysPublisher(client, keyspace=keyspace or KeySpace(opts.namespace), block_size=block_size)


def make_remote_contains(opts: VllmOptions, client: SharedStoreClient) -> Callable[[Sequence[str]], list[bool]] | None:
    """``contains`` on the shared store other instances publish to (P/D peers, replicas, restarts).

    None for an in-process store, which no other instance can fill.
    """
    peers = list(opts.store_options.get("read_from") or []) if opts.store == "shm" else []
    if peers:  # shared memory on one host: the segments of the engines this one reads from
        from auxout.stores.read_through import peers_contains

        return peers_contains(peers)
    if opts.store not in SHARED_STORES:
        return None

    def contains(keys: Sequence[str]) -> list[bool]:
        return client().contains(keys)

    return contains


class LoopCollector:
    """vLLM's ``aux_output_connector`` during a collected step's output loop (``SchedulerBridge.collects``).

    Its two methods are a dict's and a list's own (C functions: no Python frame per request).
    """

    __slots__ = ("emitted", "finished", "take_output", "request_finished")

    def __init__(self) -> None:
        self.emitted: dict[Request, Any] = {}  # requests vLLM took output for, in its loop's order
        self.finished: list[Request] = []  # terminal events inside the loop, in order
        self.take_output = self.emitted.__setitem__  # (returns None: rows go on after the loop)
        self.request_finished = self.finished.append

    def clear(self) -> None:
        self.emitted.clear()
        self.finished.clear()


class SchedulerBridge:
    """Adapts auxout's ``SchedulerConnector`` to the calls vLLM's scheduler makes.

    Rows are held per request and handed to vLLM once, with the request's final output: vLLM's
    frontend only exposes routes on finished requests, and one array per request instead of one
    per request per step keeps the engine-core -> frontend path as cheap as without routes.
    Requests with stop strings (the frontend may stop them on text without a final engine
    output) and streamed requests (``output_kind=DELTA``: each chunk carries its rows) are the
    exception: they get their rows every step.
    """

    def __init__(self, connector: SchedulerConnector) -> None:
        self.connector = connector
        self.failed: dict[str, str] = {}
        self.held = HeldRows()
        self.manifests: dict[str, dict[str, Any]] = {}
        self.taken: set[str] = set()  # requests vLLM took output for this step
        self.recomputed: dict[str, int] = {}  # prefix-hit tokens recomputed per live request
        self._bulk: StepOutput | None = None  # this step's output, when its plain rows are taken in bulk
        self._deferred: list[Request] = []  # running requests whose rows this step are taken in bulk
        self._deferred_tokens: list[int] = []  # and their num_tokens
        self.plain: set[str] = set()  # live requests with rows at finish only (no stop strings, not streamed)
        self.collector = LoopCollector()
        self.collected_steps = 0  # steps whose output loop ran with the collector (``collects``)

    def build_connector_meta(self, scheduler_output: Any, requests: Mapping[str, Request]) -> Any:
        return self.connector.build_metadata(scheduler_output.num_scheduled_tokens, requests)

    def request_finished(self, request: Request) -> None:
        # vLLM calls this before freeing KV blocks, on preemption (status still RUNNING) and on finish.
        preempted = not request.is_finished()
        if not preempted:
            self.held.discard(request.request_id)  # finished without a final output (abort)
            self.plain.discard(request.request_id)
        self.connector.request_finished(request, preempted=preempted)

    def add_plain(self, request: Request) -> None:
        """Note a request whose rows go out with its final output only (see ``collects``)."""
        if _rows_at_finish_only(request.sampling_params) and not getattr(request, "resumable", False):
            self.plain.add(request.request_id)

    def collects(self, step: StepOutput | None) -> bool:
        """Whether vLLM's per-request loop over this step's output can run with ``collector``
        standing in for this bridge: a step without read-back heads or errors (every decode
        step) whose requests all get their rows at finish only. vLLM then calls no Python
        function of auxout per request (about 1 us each, 16 per step on the tiny model); ``settle_collected`` makes the same calls after the loop.
        """
        return step is not None and not step.errors and not step.heads and self.plain.issuperset(step.req_ids)

    def settle_collected(self, step: StepOutput, requests: Mapping[str, Request], outputs: dict[int, Any]) -> None:
        """After a loop run with ``collector``: what ``take_output`` and ``request_finished``
        would have done inside it, in the same order per request, and the final rows put on the
        finished requests' outputs. Every request is plain (``collects``), so ``take_output``
        queues the unfinished ones, and a request's terminal event comes after its rows."""
        col = self.collector
        self.collected_steps += 1
        emitted = list(col.emitted)
        finished = col.finished[:]
        col.clear()
        if not finished and emitted and max(map(_status, emitted)) <= _LAST_UNFINISHED:
            whole = self.connector.take_step(step, emitted)  # (a steady decode batch; reads num_tokens)
            if whole is not None:  # every request of the step took its one row
                self.held.add_step(step.req_ids, whole)
                return
            self.taken.clear()  # (else as end_step_output takes what take_output queued)
            self._take_queued(step, emitted)
            self.hold_uncollected(step, requests, _NO_SKIP)
            return
        self.begin_step_output(step)
        final: dict[str, np.ndarray] | None = None
        take = self.take_output
        for request in emitted:  # (queues the unfinished; a finished one's rows come back now)
            rows = take(request, step)
            if rows is not None:
                final = final or {}
                final[request.request_id] = rows
        for request in finished:
            self.request_finished(request)
        self.end_step_output(step, requests, _NO_SKIP)
        if final:
            for engine_outputs in outputs.values():
                for out in engine_outputs.outputs:
                    rows = final.get(out.request_id)
                    if rows is not None:
                        out.routed_experts = rows

    def begin_step_output(self, step: StepOutput | None) -> None:
        """Before vLLM's per-request loop over a step's output.

        In a step without read-back heads or errors (every decode step), a running request
        that gets its rows only at finish is not served inside vLLM's loop: ``take_output``
        queues it, and ``end_step_output`` takes all of them with one ``take_outputs`` call (the
        same rows; two calls per request fewer, about 40 us less per 16-request step measured in
        the engine). When every request of the step was queued and each
        took its one row (a steady decode batch), ``take_step`` takes the step whole and
        ``HeldRows.add_step`` holds its rows array once: no call per request at all.
        """
        self.taken.clear()
        self._deferred = []
        self._deferred_tokens = []
        self._bulk = step if step is not None and not step.errors and not step.heads else None

    def end_step_output(self, step: StepOutput | None, requests: Mapping[str, Request], skip: AbstractSet[str]) -> None:
        """After vLLM's loop: take the queued requests' rows, then hold what nobody collected."""
        deferred, self._deferred = self._deferred, []
        self._bulk = None
        if deferred and step is not None:
            whole = self.connector.take_step(step, deferred, self._deferred_tokens)  # (a steady decode batch)
            if whole is not None:
                self.held.add_step(step.req_ids, whole)
                return  # every request of the step took its row: nothing is uncollected
            self._take_queued(step, deferred)
        if step is not None:
            self.hold_uncollected(step, requests, skip)

    def _take_queued(self, step: StepOutput, queued: list[Request]) -> None:
        """Hold the rows of running requests queued this step, with one ``take_outputs`` call."""
        self.taken.update([r.request_id for r in queued])
        add = self.held.add
        for request, rows in zip(queued, self.connector.take_outputs(step, queued)):
            if type(rows) is np.ndarray:
                add(request.request_id, rows)
            elif isinstance(rows, RoutesUnavailableError):  # (not in a step without errors)
                self._unavailable(request.request_id, rows)
            # (None: opted out, or keys-only rows the publisher holds until the request finishes)

    def take_output(self, request: Request, output: Any) -> np.ndarray | None:
        bulk = self._bulk
        if (
            bulk is not None and output is bulk
            and request.status <= _LAST_UNFINISHED  # (``not request.is_finished()``, without two calls)
            and _rows_at_finish_only(request.sampling_params)
        ):  # fmt: skip
            self._deferred.append(request)  # rows at finish only: taken with the others after the loop
            self._deferred_tokens.append(request.num_tokens)  # (read now, while vLLM has it in cache)
            return None  # (not in ``taken`` yet: end_step_output adds them if it needs to)
        rid = request.request_id
        self.taken.add(rid)
        finished = request.is_finished()
        try:
            parts = self.connector.take_output_parts(output, request, finished)
        except BlockStoreError as exc:
            self._unavailable(rid, exc)
            return None
        if parts is None:
            return None
        if isinstance(parts, RouteManifest):  # keys-only: delivered in the final output's kv_transfer_params
            self.manifests[rid] = parts.to_dict()
            return None
        self._hold(rid, parts)
        params = request.sampling_params
        # streamed (and stop-string) requests get their rows every step: the server sends each
        # step's rows with its tokens (held rows of earlier prefill chunks included)
        if finished or (params is not None and (params.stop or params.output_kind == RequestOutputKind.DELTA)):
            held = self.held.pop(rid)
            return None if held is None else engine_rows(held, request)
        return None

    def hold_uncollected(self, output: StepOutput, requests: Mapping[str, Request], skip: AbstractSet[str]) -> None:
        """Rows of requests vLLM emitted nothing for this step (a prefill chunk): held until they do."""
        spans = output.span_map()
        if len(self.taken) >= len(spans) and self.taken.issuperset(spans):  # (a decode step: all taken)
            return
        for rid in spans:
            if rid in self.taken or rid in skip:
                continue
            request = requests.get(rid)
            if request is None or request.is_finished():
                continue
            try:
                parts = self.connector.take_output_parts(output, request)
            except BlockStoreError as exc:
                self._unavailable(rid, exc)
                continue
            if parts is not None and not isinstance(parts, RouteManifest):
                self._hold(rid, parts)

    def _unavailable(self, rid: str, exc: BlockStoreError) -> None:
        """A request whose routes could not be assembled fails alone (``finish_reason=error``)."""
        logger.error("auxout: routes of request %s are unavailable: %s", rid, exc)
        self.failed[rid] = str(exc)
        self.held.discard(rid)

    def _hold(self, rid: str, parts: np.ndarray | list[np.ndarray | StoreRows]) -> None:
        """Hold a step's rows (a prefix hit's come in two parts: joined once, when handed over)."""
        if isinstance(parts, list):
            for rows in parts:
                self.held.add(rid, rows)
        else:
            self.held.add(rid, parts)

    def reset(self) -> None:
        self.connector.reset()


class AuxoutScheduler(Scheduler):
    """vLLM ``Scheduler`` with routed experts returned in ``EngineCoreOutput.routed_experts``."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.auxout_options: VllmOptions = options_from_vllm_config(vllm_config)
        opts = self.auxout_options
        hash_block = self._auxout_hash_block_size(vllm_config)
        keyspace = route_keyspace(vllm_config, opts, hash_block)  # per DP rank, model fingerprint
        client = SharedStoreClient(opts, _max_object_nbytes(vllm_config, hash_block))
        publisher = make_publisher(opts, hash_block, client, keyspace)
        kv_blocks = int(getattr(self.kv_cache_config, "num_blocks", 0)) * max(1, self.block_size // hash_block)
        self.auxout = SchedulerBridge(
            SchedulerConnector(
                default_return=opts.default_return,
                publisher=publisher,
                default_output=opts.output,
                keyspace=keyspace,
                block_size=hash_block,
                remote_contains=make_remote_contains(opts, client),
                index_capacity=max(1 << 16, 4 * kv_blocks),
                weights_from_worker=shares_routes(opts),
            )
        )
        self.aux_output_connector = self.auxout  # type: ignore[assignment]  # vLLM calls it at every hook
        self._auxout_recompute_logged = 0
        if self.connector is not None:
            self._auxout_clip_connector(self.connector)
        self._auxout_startup_warnings(vllm_config)
        logger.info("auxout: route keys under %s (hash block %d)", keyspace.prefix(0), hash_block)

    def _auxout_hash_block_size(self, vllm_config: Any) -> int:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        return int(resolve_kv_cache_block_sizes(self.kv_cache_config, vllm_config)[1])

    # -- a KV hit never fails for missing routes --------------------------------------------------
    def _get_local_prefix_cache_hit(self, request: Request) -> Any:
        blocks, num_local, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        if num_local <= 0:
            return blocks, num_local, boundary, diverged
        keep = self.auxout.connector.readable_prefix(request, num_local)
        keep -= keep % self.block_size
        if keep < num_local:
            self._auxout_log_recompute(request, keep, num_local, "local prefix cache")
            blocks = self.kv_cache_manager.truncate_computed_blocks(blocks, keep)
            num_local = keep
        return blocks, num_local, boundary, diverged

    def _auxout_clip_connector(self, connector: Any) -> None:
        """A KV connector's external hit is taken whole, in the connector's own alignment, or not at all.

        Connectors place the blocks they matched by their own rule, whatever shorter count the
        scheduler allocates for: ExampleConnector loads its file from the front (into too few
        blocks: a worker crash), NIXL and Mooncake's P/D connector line the remote blocks up from
        the end (a shorter count shifts every block: wrong KV, silently). So the count is never cut:
        - an asynchronous load is taken whole, and what its routes cannot cover is recomputed
          after it lands (:meth:`_update_waiting_for_remote_kv`), from a hash-block boundary;
        - a synchronous load (counted as computed at once) is taken only when it ends on a hash
          block boundary with every route block readable; otherwise it is refused whole.
        """
        original = connector.get_num_new_matched_tokens

        def get_num_new_matched_tokens(request: Request, num_computed_tokens: int) -> Any:
            ext, load_async = original(request, num_computed_tokens)
            if not ext:
                return ext, load_async
            taken = self.auxout.connector.external_hit(request, num_computed_tokens, ext, load_async)
            if taken:
                return taken, load_async
            end = min(num_computed_tokens + ext, request.num_tokens - 1)  # (the last token computes anyway)
            self._auxout_log_recompute(request, num_computed_tokens, end, "KV connector")
            return 0, False

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens

    def _update_waiting_for_remote_kv(self, request: Request) -> None:
        """An asynchronous KV load has landed: computation resumes from a hash-block boundary up
        to which routes are readable (``SchedulerConnector.resume_after_load``), never inside a
        block; the KV loaded past it is written again by the recompute (the path vLLM itself
        takes after a failed block load)."""
        loaded = request.num_computed_tokens
        keep = self.auxout.connector.resume_after_load(request, loaded)
        resume = min(loaded, request.num_tokens - 1)
        if keep < resume:
            request.num_computed_tokens = keep
            self._auxout_log_recompute(request, keep, resume, "KV connector (resumed at a block boundary)")
        super()._update_waiting_for_remote_kv(request)

    def _auxout_log_recompute(self, request: Request, lo: int, hi: int, source: str) -> None:
        """Count and log prefix positions ``[lo, hi)`` recomputed (each position once per request)."""
        rid = request.request_id
        n = hi - lo
        self.auxout.recomputed[rid] = self.auxout.connector.count_recompute(rid, lo, hi)
        logger.info(
            "auxout: recomputing %d prefix tokens of request %s from the %s: their routes are not readable "
            "(total recomputed: %d tokens)",
            n, request.request_id, source, self.auxout.connector.recomputed_tokens,
        )  # fmt: skip

    def _auxout_startup_warnings(self, vllm_config: Any) -> None:
        opts = self.auxout_options
        if self.connector is not None and opts.store not in SHARED_STORES:
            logger.warning(
                "auxout: a KV connector is configured but routes live in the in-process store %r: KV that "
                "comes from outside this engine (P/D, offload, restarts) cannot bring its routes, so those "
                "prefixes are recomputed (correct, slower). Use a store both sides reach: store='redis' or "
                "'mooncake' with the same namespace on every instance.",
                opts.store,
            )
        algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
        if opts.store in SHARED_STORES and "sha256" not in algo and os.environ.get("PYTHONHASHSEED") is None:
            logger.warning(
                "auxout: prefix_caching_hash_algo=%s seeds block hashes randomly per process, so other "
                "instances (P/D peers, replicas, a restarted engine) never find these routes and recompute "
                "them. Set PYTHONHASHSEED to the same value everywhere, or use sha256.",
                algo,
            )

    def add_request(self, request: Request) -> None:
        try:
            start, wanted, output = request_route_options(request)
            if is_pd_prefill_leg(request):  # its rows come back from the decode side, whole
                start, wanted, output = 0, False, None
            self.auxout.connector.add_request(
                request.request_id, request.num_prompt_tokens, prompt_start=start, return_routes=wanted, output=output
            )
        except RequestValidationError as exc:
            # The frontends validate first; whatever slips through fails this request, not the engine.
            logger.error("auxout: rejecting request %s: %s", request.request_id, exc)
            self.auxout.failed[request.request_id] = str(exc)
            self.auxout.connector.add_request(request.request_id, request.num_prompt_tokens, return_routes=False)
        self.auxout.add_plain(request)
        super().add_request(request)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        step = getattr(model_runner_output, "aux_output_connector_output", None)
        step = step if isinstance(step, StepOutput) else None
        redo = self.auxout.connector.begin_output(step)
        if redo:  # prefix rows unreadable: this step's samples are dropped, the request recomputes
            index = model_runner_output.req_id_to_index
            sampled = model_runner_output.sampled_token_ids
            for rid in redo:
                if rid in index and sampled:
                    sampled[index[rid]] = []
        bridge = self.auxout
        if not redo and self.aux_output_connector is bridge and bridge.collects(step):
            assert step is not None
            self.aux_output_connector = bridge.collector  # type: ignore[assignment]
            try:
                outputs = super().update_from_output(scheduler_output, model_runner_output)
            except BaseException:
                bridge.collector.clear()  # (nothing half-collected is settled with a later step)
                raise
            finally:
                self.aux_output_connector = bridge  # type: ignore[assignment]
            bridge.settle_collected(step, self.requests, outputs)
        else:
            bridge.begin_step_output(step)
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            bridge.end_step_output(step, self.requests, set(redo))
        for rid in redo:
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            self._preempt_request(request, time.monotonic(), drop_stale_output=True)  # in-flight samples too
            logger.info(
                "auxout: request %s recomputes its prompt: its routes could not be assembled (%s)",
                rid, step.errors.get(rid, "") if step is not None else "",
            )  # fmt: skip
        if self.auxout.failed:
            self._fail_requests(outputs)
        conn = self.auxout.connector
        if self.auxout.manifests or conn.inline_fallbacks or self.auxout.recomputed or conn.reset_at:
            self._attach_manifests(outputs)
        return outputs

    def _attach_manifests(self, outputs: dict[int, Any]) -> None:
        """Keys-only output: the manifest rides in the final output's ``kv_transfer_params``."""
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                manifest = self.auxout.manifests.pop(out.request_id, None)
                if manifest is not None:
                    out.kv_transfer_params = {**(out.kv_transfer_params or {}), MANIFEST_FIELD: manifest}
                if out.finish_reason is not None and out.request_id in self.auxout.recomputed:
                    n = self.auxout.recomputed.pop(out.request_id)
                    out.kv_transfer_params = {**(out.kv_transfer_params or {}), RECOMPUTED_FIELD: n}
                reason = self.auxout.connector.inline_fallbacks.pop(out.request_id, None)
                if reason is not None:  # keys-only asked, rows inline: say why
                    out.kv_transfer_params = {**(out.kv_transfer_params or {}), INLINE_REASON_FIELD: reason}
                if out.finish_reason is not None and out.request_id in self.auxout.connector.reset_at:
                    at = self.auxout.connector.reset_at.pop(out.request_id)  # a weight sync mid-request
                    out.kv_transfer_params = {**(out.kv_transfer_params or {}), RESET_AT_FIELD: at}
        for pending in (self.auxout.manifests, self.auxout.recomputed, self.auxout.connector.reset_at):
            for rid in [r for r in pending if r not in self.requests]:
                del pending[rid]

    def _fail_requests(self, outputs: dict[int, Any]) -> None:
        """Finish requests whose routes failed, with ``finish_reason=error`` on their output."""
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                reason = self.auxout.failed.pop(out.request_id, None)
                if reason is None:
                    continue
                out.finish_reason = FinishReason.ERROR
                out.stop_reason = f"auxout: {reason}"
                request = self.requests.get(out.request_id)
                if request is not None and not request.is_finished():
                    self.finish_requests(out.request_id, RequestStatus.FINISHED_ERROR)
                finished = engine_outputs.finished_requests
                if finished is not None:
                    finished.add(out.request_id)
        for rid in list(self.auxout.failed):
            if rid not in self.requests:  # gone without another output (aborted): forget it
                del self.auxout.failed[rid]


def _max_object_nbytes(vllm_config: Any, hash_block: int) -> int:
    """An upper bound on one route object's size (every decoder layer counted as MoE)."""
    mc = vllm_config.model_config
    layers = int(getattr(mc.hf_text_config, "num_hidden_layers", 0) or 1)
    itemsize = id_dtype_for(int(mc.get_num_experts())).itemsize + WEIGHT_DTYPE.itemsize  # a weight, if captured
    return hash_block * layers * int(mc.get_num_experts_per_tok()) * itemsize


__all__ = ["AuxoutScheduler", "SchedulerBridge", "is_pd_prefill_leg", "request_route_options"]
