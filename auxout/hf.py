"""Compatibility alias: transformers capture/replay lives in :mod:`auxout.trainer.hf`."""

from auxout.trainer.hf import (  # noqa: F401
    SENTINEL,
    MoELayer,
    MoELayers,
    ReplayContext,
    RouteRecorder,
    capture_routes,
    moe_layers,
    replay,
    routing_weights,
)
