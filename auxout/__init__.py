"""auxout: routed-experts capture, storage and replay for MoE RL."""

from __future__ import annotations

from typing import Any

__all__ = ["RouteManifest", "decode_routes", "fetch"]


def __getattr__(name: str) -> Any:  # lazy: `import auxout` stays cheap (no store clients)
    if name in ("fetch", "RouteManifest"):
        from auxout import manifest

        return getattr(manifest, name)
    if name == "decode_routes":
        from auxout.wire import decode_routes

        return decode_routes
    raise AttributeError(f"module 'auxout' has no attribute {name!r}")
