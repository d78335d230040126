"""vLLM V1 scheduler that drives auxout's scheduler connector (``scheduler_cls``).

vLLM 0.32's ``Scheduler`` already calls an ``aux_output_connector`` at the right points (step
metadata, request freed or preempted, per-request output, prefix-cache reset); it only builds
its own when vLLM's Model Runner V2 feature is on. This subclass installs auxout's connector
there through :class:`SchedulerBridge` and adds what vLLM does not do: per-request admission
(opt-in/out, ``routed_experts_prompt_start``) and turning a request whose routes cannot be
assembled into a failed request instead of a dead engine.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
from vllm.sampling_params import RequestOutputKind
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request, RequestStatus

from auxout.errors import BlockStoreError, RequestValidationError
from auxout.held_rows import HeldRows
from auxout.integrations.vllm.options import (
    MANIFEST_FIELD,
    OUTPUT_FLAG,
    REQUEST_FLAG,
    SHARED_STORES,
    VllmOptions,
    normalize_flag,
    options_from_vllm_config,
)
from auxout.keys import KeySpace
from auxout.keys_output import KeysPublisher
from auxout.manifest import RouteManifest
from auxout.scheduler_connector import SchedulerConnector
from auxout.stores import BlockStore, make_store

logger = logging.getLogger("auxout.vllm")


def request_route_options(request: Any) -> tuple[object, object, object]:
    """``(prompt_start, return_routes, output)`` as the request carries them (validated by the connector)."""
    params = request.sampling_params
    if params is None:  # pooling request: no sampled tokens, no routes
        return 0, False, None
    extra = params.extra_args or {}
    return params.routed_experts_prompt_start, normalize_flag(extra.get(REQUEST_FLAG)), extra.get(OUTPUT_FLAG)


def make_publisher(opts: VllmOptions, block_size: int) -> KeysPublisher | None:
    """A scheduler-side client of the shared store, opened once the route shape is known."""
    if opts.store not in SHARED_STORES:
        return None

    def open_store(object_nbytes: int) -> BlockStore:
        return make_store(
            opts.store, max_bytes=object_nbytes, object_nbytes=object_nbytes, background=False, **opts.store_options
        )

    return KeysPublisher(open_store, keyspace=KeySpace(opts.namespace), block_size=block_size)


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

    def build_connector_meta(self, scheduler_output: Any, requests: Mapping[str, Request]) -> Any:
        return self.connector.build_metadata(scheduler_output.num_scheduled_tokens, requests)

    def request_finished(self, request: Request) -> None:
        # vLLM calls this before freeing KV blocks, on preemption (status still RUNNING) and on finish.
        preempted = not request.is_finished()
        if not preempted:
            self.held.discard(request.request_id)  # finished without a final output (abort)
        self.connector.request_finished(request, preempted=preempted)

    def take_output(self, request: Request, output: Any) -> np.ndarray | None:
        rid = request.request_id
        finished = request.is_finished()
        try:
            rows = self.connector.take_output(output, request, finished=finished)
        except BlockStoreError as exc:
            logger.error("auxout: routes of request %s are unavailable: %s", rid, exc)
            self.failed[rid] = str(exc)
            self.held.discard(rid)
            return None
        if rows is None:
            return None
        if isinstance(rows, RouteManifest):  # keys-only: delivered in the final output's kv_transfer_params
            self.manifests[rid] = rows.to_dict()
            return None
        params = request.sampling_params
        if params is not None and (params.stop or params.output_kind == RequestOutputKind.DELTA):
            return rows  # streamed: the server sends each step's rows with its tokens
        self.held.add(rid, rows)
        return self.held.pop(rid) if finished else None

    def reset(self) -> None:
        self.connector.reset()


class AuxoutScheduler(Scheduler):
    """vLLM ``Scheduler`` with routed experts returned in ``EngineCoreOutput.routed_experts``."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.auxout_options: VllmOptions = options_from_vllm_config(vllm_config)
        opts = self.auxout_options
        publisher = make_publisher(opts, self._auxout_hash_block_size(vllm_config))
        self.auxout = SchedulerBridge(
            SchedulerConnector(default_return=opts.default_return, publisher=publisher, default_output=opts.output)
        )
        self.aux_output_connector = self.auxout  # type: ignore[assignment]  # vLLM calls it at every hook

    def _auxout_hash_block_size(self, vllm_config: Any) -> int:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        return int(resolve_kv_cache_block_sizes(self.kv_cache_config, vllm_config)[1])

    def add_request(self, request: Request) -> None:
        try:
            start, wanted, output = request_route_options(request)
            self.auxout.connector.add_request(
                request.request_id, request.num_prompt_tokens, prompt_start=start, return_routes=wanted, output=output
            )
        except RequestValidationError as exc:
            # The frontends validate first; whatever slips through fails this request, not the engine.
            logger.error("auxout: rejecting request %s: %s", request.request_id, exc)
            self.auxout.failed[request.request_id] = str(exc)
            self.auxout.connector.add_request(request.request_id, request.num_prompt_tokens, return_routes=False)
        super().add_request(request)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.auxout.failed:
            self._fail_requests(outputs)
        if self.auxout.manifests:
            self._attach_manifests(outputs)
        return outputs

    def _attach_manifests(self, outputs: dict[int, Any]) -> None:
        """Keys-only output: the manifest rides in the final output's ``kv_transfer_params``."""
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                manifest = self.auxout.manifests.pop(out.request_id, None)
                if manifest is not None:
                    out.kv_transfer_params = {**(out.kv_transfer_params or {}), MANIFEST_FIELD: manifest}
        for rid in list(self.auxout.manifests):
            if rid not in self.requests:
                del self.auxout.manifests[rid]

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


__all__ = ["AuxoutScheduler", "SchedulerBridge", "request_route_options"]
