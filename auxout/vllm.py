"""Routed experts from vLLM: ``LLM(model, **auxout.vllm.engine_kwargs())``.

Every ``CompletionOutput.routed_experts`` then holds ``[num_tokens - 1 - prompt_start,
num_moe_layers, top_k]`` expert ids (uint8/uint16), bit-exact under prefix caching, chunked
prefill, speculative decoding and preemption. Opt a request out with
``SamplingParams(extra_args={"return_routed_experts": False})``. With
``engine_kwargs(routing_weights=True)``, ``SamplingParams(extra_args={"return_routing_weights": True})``
also fills ``CompletionOutput.routing_weights`` (float32, same shape: the top-k combine weights).
``update_weights(llm, model.named_parameters())`` loads new weights in place (an RL weight sync).
"""

from auxout.integrations.vllm import (
    REQUEST_FLAG,
    VllmOptions,
    WeightSync,
    WeightSyncError,
    engine_kwargs,
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
