"""Routed experts from vLLM: ``LLM(model, **auxout.vllm.engine_kwargs())``.

Every ``CompletionOutput.routed_experts`` then holds ``[num_tokens - 1 - prompt_start,
num_moe_layers, top_k]`` expert ids (uint8/uint16), bit-exact under prefix caching, chunked
prefill, speculative decoding and preemption. Opt a request out with
``SamplingParams(extra_args={"return_routed_experts": False})``. With
``engine_kwargs(routing_weights=True)``, ``SamplingParams(extra_args={"return_routing_weights": True})``
also fills ``CompletionOutput.routing_weights`` (float32, same shape: the top-k combine weights).
``update_weights(llm, model.named_parameters())`` loads new weights in place (an RL weight sync).

The binding of auxout to vLLM (elsewhere only ``auxout.demo`` and the trainer's rollouts build
engines, through it), grouped by the process each part runs in: ``engine_core`` (the
scheduler), ``workers`` (worker classes, router capture, layer topology, async step outputs),
``caller`` (request checks, completion outputs), ``server`` (``auxout serve``); beside them the
options (``options``, ``config``), every request and output field's name (``fields``) and the
in-place weight sync (``weight_sync``). What auxout subclasses, replaces or wraps in vLLM, and
why: docs/architecture.md.
"""

from auxout.vllm.config import engine_kwargs
from auxout.vllm.fields import REQUEST_FLAG
from auxout.vllm.options import VllmOptions
from auxout.vllm.weight_sync import (
    WeightSync,
    WeightSyncError,
    repair_moe_prepack,
    update_weights,
)

__all__ = [
    "REQUEST_FLAG",
    "VllmOptions",
    "WeightSync",
    "WeightSyncError",
    "engine_kwargs",
    "repair_moe_prepack",
    "update_weights",
]
