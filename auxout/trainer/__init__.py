"""Trainer side of R3: align returned routes with training samples and lay them out for replay."""

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
