"""auxout's vLLM options (engine-wide), and how they reach the engine-core and worker processes.

vLLM spawns EngineCore and worker processes and pickles ``VllmConfig`` to them, so options ride
in ``additional_config["auxout"]`` (a free-form dict vLLM keeps on the config). The
``AUXOUT_VLLM_OPTIONS`` environment variable (JSON) is the fallback for servers started by
other tools. Per-request fields are named in :mod:`auxout.vllm.fields`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from auxout.credentials import has_credentials, redact, split_credentials

CONFIG_KEY = "auxout"
ENV_VAR = "AUXOUT_VLLM_OPTIONS"
LIFE_KEY = "auxout_life"
"""``additional_config`` key of the engine's lifetime token (``KeySpace.life``), set by ``engine_kwargs``."""
SHARED_STORES = ("redis", "mooncake")
"""Stores the scheduler process can reach too: keys-only output needs one."""


def shares_routes(opts: VllmOptions) -> bool:
    """Whether other engines read this engine's routes (P/D peers, replicas, restarts): then a
    generation after a reset is keyed by a digest of the weights (``KeySpace.weights``), so every
    engine running those weights shares it."""
    return opts.store in SHARED_STORES or opts.store == "shm"


@dataclass(frozen=True)
class VllmOptions:
    """``store``: backend name for ``auxout.stores.make_store``; ``max_bytes``: store capacity
    (None = as many route blocks as the KV cache holds hash blocks); ``default_return``: whether
    requests get routes unless they say otherwise; ``namespace``: key namespace in shared stores;
    ``store_options``: extra keyword arguments for the store; ``output``: ``"inline"`` arrays or
    ``"keys"`` manifests by default (keys needs a shared store: redis or mooncake);
    ``routing_weights``: capture the router's top-k combine weights with the ids (for every
    request, so cached prefixes carry them; requests then ask for them with
    ``return_routing_weights``)."""

    store: str = "arena"
    max_bytes: int | None = None
    default_return: bool = True
    namespace: str = "local"
    store_options: dict[str, Any] = field(default_factory=dict)
    output: str = "inline"
    routing_weights: bool = False

    def __post_init__(self) -> None:
        if self.output not in ("inline", "keys"):
            raise ValueError(f"auxout option output must be 'inline' or 'keys', got {self.output!r}")
        if self.output == "keys" and self.store not in SHARED_STORES:
            raise ValueError(f"auxout output='keys' needs a store both processes reach {SHARED_STORES}, got {self.store!r}")
        if not isinstance(self.store, str) or not self.store:
            raise ValueError(f"auxout option store must be a non-empty string, got {self.store!r}")
        if self.max_bytes is not None and (
            isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes <= 0
        ):
            raise ValueError(f"auxout option max_bytes must be a positive int or None, got {self.max_bytes!r}")
        if not isinstance(self.routing_weights, bool):
            raise ValueError(f"auxout option routing_weights must be a bool, got {self.routing_weights!r}")
        if not isinstance(self.default_return, bool):
            raise ValueError(f"auxout option default_return must be a bool, got {self.default_return!r}")
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError(f"auxout option namespace must be a non-empty string, got {self.namespace!r}")
        if not isinstance(self.store_options, dict):
            raise ValueError(f"auxout option store_options must be a dict, got {redact(self.store_options)}")
        from auxout.stores import check_store_options

        check_store_options(self.store, self.store_options)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VllmOptions:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown auxout option(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def without_credentials(self) -> tuple[VllmOptions, str | None]:
        """These options with the store URL's user and password removed, and the URL that had
        them (None if it had none): vLLM logs and pickles its configuration, where the options
        travel, so the credentials go to the engine's processes another way (``engine_kwargs``)."""
        url = self.store_options.get("url")
        if not isinstance(url, str) or not has_credentials(url):
            return self, None
        clean = {**self.store_options, "url": split_credentials(url)[0]}
        return VllmOptions.from_dict({**self.to_dict(), "store_options": clean}), url


def options_from_vllm_config(vllm_config: Any) -> VllmOptions:
    """Options stored by ``engine_kwargs`` in the config, else from the environment, else defaults."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    if CONFIG_KEY in extra:
        raw = extra[CONFIG_KEY]
        return VllmOptions.from_dict(json.loads(raw) if isinstance(raw, str) else dict(raw))
    env = os.environ.get(ENV_VAR)
    if env:
        return VllmOptions.from_dict(json.loads(env))
    return VllmOptions()
