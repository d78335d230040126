"""P/D disaggregation with routes: a prefill engine and a decode engine share KV and routes.

KV moves through vLLM's ``ExampleConnector`` (a directory); routes move through a Redis store
both engines reach, under the same namespace. The decode engine loads the prompt's KV instead
of computing it, and still returns the routes of the whole sequence, equal to a full forward.

    .venv/bin/python examples/pd_routes.py      # starts its own redis-server on 127.0.0.1

With an in-process store on the decode side (``engine_kwargs()``) the same run still returns
exact routes: the external KV hit is clipped and the prompt recomputed (auxout warns at start).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def engine(model: str, kv_dir: str, role: str, redis_url: str):  # type: ignore[no-untyped-def]
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from auxout.vllm import engine_kwargs

    routes = engine_kwargs(store="redis", namespace="pd-demo", store_options={"url": redis_url, "namespace": "demo"})
    kv = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role=role, kv_connector_extra_config={"shared_storage_path": kv_dir}
    )
    return LLM(
        model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
        max_model_len=1024, kv_transfer_config=kv, **routes,
    )  # fmt: skip


def main() -> None:
    from vllm import SamplingParams

    from auxout.testing.models import build_tiny_moe
    from auxout.testing.servers import redis_server

    model = build_tiny_moe("qwen3_moe")
    prompt = np.random.default_rng(0).integers(3, 1000, 100).tolist()
    with redis_server() as redis, tempfile.TemporaryDirectory() as kv_dir:
        prefill = engine(model, kv_dir, "kv_producer", redis.url)
        decode = engine(model, kv_dir, "kv_consumer", redis.url)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        prefill.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        params = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False)
        (out,) = decode.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        routes = out.outputs[0].routed_experts
        print(f"decode side: {out.num_cached_tokens} prompt tokens loaded through the connector")
        print(f"routes for the whole sequence: {routes.shape} {routes.dtype}")


if __name__ == "__main__":
    main()
