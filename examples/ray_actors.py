"""Rollout engines as Ray actors, routes through a shared Redis, fetched by the trainer.

The layout verl and OpenRLHF use for their rollout workers: each actor holds one ``vllm.LLM`` with
auxout, writing routes to one Redis store under one namespace. An actor returns small keys-only
manifests instead of route arrays (Ray's object store never carries the routes); the trainer (here
the driver) fetches them with ``auxout.fetch``. Weight syncs go to every actor through
``auxout.vllm.update_weights``; each engine then keys its routes by its new weights, so an actor
still on the old weights never serves the new ones' routes through the shared store, nor the reverse.

    pip install "ray==2.60.*"
    .venv/bin/python examples/ray_actors.py       # starts its own redis-server on 127.0.0.1

``ray.init(num_cpus=N)`` needs one CPU per actor (``num_cpus=1`` each). Ray Serve's OpenAI app
(``ray.serve.llm``) builds vLLM's own HTTP front end, not ``auxout serve``'s: its responses carry
only vLLM's native ``routed_experts``, without auxout's request fields, sessions or keys-only
output. For an HTTP fleet, run ``auxout serve`` replicas behind vllm-router (README, "Run a fleet").
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

ENGINE = {"dtype": "float32", "enforce_eager": True, "block_size": 32, "max_model_len": 512, "seed": 0,
          "skip_tokenizer_init": True}  # fmt: skip


class RolloutEngine:
    """One rollout engine (a Ray actor class: ``ray.remote(num_cpus=1)(RolloutEngine)``)."""

    def __init__(self, model: str, store_url: str, namespace: str, **engine: Any) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        from auxout.vllm import engine_kwargs

        routes = engine_kwargs(store="redis", output="keys", namespace=namespace, store_options={"url": store_url, "namespace": "rl"})
        self.llm = LLM(model=model, **{**ENGINE, **engine, **routes})

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
        """Greedy completions, each with its keys-only route manifest (a plain dict)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [
            {"prompt_token_ids": list(o.prompt_token_ids or []), "token_ids": list(o.outputs[0].token_ids),
             "manifest": o.outputs[0].auxout_routes_manifest}
            for o in outs
        ]  # fmt: skip

    def update_weights(self, weights: dict[str, Any]) -> int:
        """Load new weights in place (transformers or checkpoint names); returns tensors loaded."""
        from auxout.vllm import update_weights

        return update_weights(self.llm, weights).num_tensors


def fetch_routes(samples: list[dict[str, Any]]) -> list[np.ndarray]:
    """The trainer's side: each sample's routes ``[prompt + completion - 1, layers, top_k]``."""
    import auxout
    from auxout.manifest import RouteManifest

    return [auxout.fetch(RouteManifest.from_dict(s["manifest"])) for s in samples]


def rollout(actors: list[Any], prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Prompts spread over the actors round-robin; samples back in prompt order."""
    import ray

    shards = [prompts[i :: len(actors)] for i in range(len(actors))]
    results = ray.get([a.generate.remote(s, max_tokens) for a, s in zip(actors, shards, strict=True)])
    out: list[dict[str, Any]] = [{}] * len(prompts)
    for i, shard in enumerate(results):
        for j, sample in enumerate(shard):
            out[i + j * len(actors)] = sample
    return out


def main() -> None:
    import ray

    from auxout.testing.models import build_tiny_moe
    from auxout.testing.servers import redis_server

    model = build_tiny_moe("qwen3_moe")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, int(n)).tolist() for n in rng.integers(20, 90, 6)]
    with redis_server() as redis:
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            actor = ray.remote(num_cpus=1)(RolloutEngine)
            actors = [actor.remote(model, redis.url, "ray-demo") for _ in range(2)]
            samples = rollout(actors, prompts, max_tokens=16)
            for s, routes in zip(samples, fetch_routes(samples), strict=True):
                n = len(s["prompt_token_ids"]) + len(s["token_ids"]) - 1
                print(f"{len(s['prompt_token_ids'])}-token prompt: routes {routes.shape} {routes.dtype} (rows {n})")
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
