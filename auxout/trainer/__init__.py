"""Trainer side of R3: align returned routes with training samples and lay them out for replay.

Submodules (imported on demand, they need torch / megatron-core): ``hf`` (transformers capture and
replay, FSDP2 and activation checkpointing included), ``megatron`` (Megatron-core ``RouterReplay``),
``formats`` (engine payloads and RL-framework layouts), ``verify`` (``auxout verify``). Engine-side
code never imports this package.
"""

from auxout.trainer.route_trace import (
    SENTINEL,
    RouteTrace,
    RouteTraceError,
    Turn,
    from_megatron,
    pack,
    pad_batch,
    to_megatron,
    topk_sets_equal,
    unpack,
    unpad_batch,
)

__all__ = [
    "SENTINEL",
    "RouteTrace",
    "RouteTraceError",
    "Turn",
    "from_megatron",
    "pack",
    "pad_batch",
    "to_megatron",
    "topk_sets_equal",
    "unpack",
    "unpad_batch",
]
