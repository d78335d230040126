"""The Ray actors recipe (``examples/ray_actors.py``): two rollout engines as Ray actors on one Redis
route store, keys-only manifests fetched by the driver, and a rolling weight sync.

The oracle is transformers' fp32 full forward of the weights each actor runs: every fetched route
equals it (top-k sets), before the sync on both actors, and after a sync of one actor only, on each
actor its own weights' routes, although both share the store, the namespace and the prompts.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from routes_oracle import Oracle
from weight_sync_helpers import Trainer, prompts

from auxout.testing.servers import redis_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ray = pytest.importorskip("ray", reason="the Ray recipe needs ray (pip install 'ray==2.60.*')")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_actors.py"


def _example(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The example as module ``ray_actors``, importable in Ray's worker processes too (they inherit
    ``PYTHONPATH``): Ray pickles the actor class by reference to its module."""
    where = str(EXAMPLE.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.syspath_prepend(where)
    return importlib.import_module("ray_actors")


def _assert_oracle(oracle: Oracle, sample: dict[str, Any], routes: np.ndarray, what: str) -> None:
    oracle.check_rows(sample["prompt_token_ids"] + sample["token_ids"], routes, 0, what)


def test_ray_actors_keys_only_routes_and_rolling_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from auxout.testing.models import build_tiny_moe

    ex = _example(monkeypatch)
    path = build_tiny_moe("qwen3_moe")
    batch = prompts(7, (40, 75, 100, 33))
    with redis_server() as redis:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            actor = ray.remote(num_cpus=1)(ex.RolloutEngine)
            actors = [actor.remote(path, redis.url, "ray-test") for _ in range(2)]

            samples = ex.rollout(actors, batch, max_tokens=12)
            assert all(s["manifest"] is not None for s in samples), "keys-only output: every sample has a manifest"
            old = Oracle(path)
            for i, (s, routes) in enumerate(zip(samples, ex.fetch_routes(samples), strict=True)):
                _assert_oracle(old, s, routes, f"sample {i} before the sync")

            # the same prompts on the other actor: its own routes, equal to the first's
            swapped = ex.rollout(actors[::-1], batch, max_tokens=12)
            for a, b in zip(ex.fetch_routes(samples), ex.fetch_routes(swapped), strict=True):
                assert np.array_equal(np.sort(a, axis=-1), np.sort(b, axis=-1))

            # a rolling sync: actor 0 gets changed weights, actor 1 stays on the old ones
            trainer = Trainer(path)
            trainer.step(3)
            new = Oracle(trainer.save(tmp_path / "new"))
            assert ray.get(actors[0].update_weights.remote(trainer.state())) > 0
            on_new = ray.get(actors[0].generate.remote(batch, 12))
            on_old = ray.get(actors[1].generate.remote(batch, 12))
            changed = 0
            for i, (a, b) in enumerate(zip(on_new, on_old, strict=True)):
                ra, rb = ex.fetch_routes([a, b])
                _assert_oracle(new, a, ra, f"prompt {i} on the synced actor")
                _assert_oracle(old, b, rb, f"prompt {i} on the actor not yet synced")
                n = min(len(ra), len(rb), len(batch[i]) - 1)
                changed += int((np.sort(ra[:n], -1) != np.sort(rb[:n], -1)).any(-1).sum())
            assert changed > 0, "the new weights route some prompt token differently (else the test proves nothing)"
        finally:
            ray.shutdown()
