"""What a KV hit without routes costs: recompute-on-miss vs a hit with routes, and route bytes per P/D request.

A prefill engine saves each prompt's KV with vLLM's ``ExampleConnector`` and its routes in Redis.
Two decode engines load that KV: one reaches the routes in Redis (a hit: routes read from the
store), one has only an in-process store (a miss: auxout clips the hit and recomputes the
prompt). Both must return the same exact routes; the script prints the median latency ratio
miss/hit per prompt length (same run, alternating, so machine noise hits both alike) and the
bytes the decode engine read from Redis per request next to the size of the routes it returned.

    python benchmarks/pd_recompute.py [--lengths 256 1024] [--reps 5] [--gen 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def engine(model: str, kv_dir: str, role: str, routes: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from auxout.vllm import engine_kwargs

    kv = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role=role, kv_connector_extra_config={"shared_storage_path": kv_dir}
    )
    return LLM(
        model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
        max_model_len=2048, max_num_batched_tokens=2048, kv_transfer_config=kv, disable_log_stats=True,
        **engine_kwargs(**routes),
    )  # fmt: skip


def timed(llm: Any, prompt: list[int], gen: int) -> tuple[float, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--arch", default="qwen3_moe")
    args = ap.parse_args()

    import redis

    from auxout.testing.models import build_tiny_moe
    from auxout.testing.servers import redis_server

    model = build_tiny_moe(args.arch)
    rng = np.random.default_rng(0)
    with redis_server() as srv, tempfile.TemporaryDirectory() as kv_dir:
        shared = {"store": "redis", "namespace": "bench", "store_options": {"url": srv.url, "namespace": "b"}}
        prefill = engine(model, kv_dir, "kv_producer", shared)
        hit_engine = engine(model, kv_dir, "kv_consumer", shared)
        miss_engine = engine(model, kv_dir, "kv_consumer", {})
        client = redis.Redis.from_url(srv.url)
        print(f"{'prompt':>7} {'hit ms':>8} {'miss ms':>8} {'miss/hit':>8} {'cached hit/miss':>16} "
              f"{'redis B read':>12} {'routes B':>9}")  # fmt: skip
        for n in args.lengths:
            ratios, hits, misses, read, sizes = [], [], [], [], []
            for _ in range(args.reps):
                prompt = rng.integers(3, 1000, n).tolist()  # fresh prompt: no local prefix hits
                timed(prefill, prompt, 1)
                before = int(client.info("stats")["total_net_output_bytes"])
                t_hit, out_hit = timed(hit_engine, prompt, args.gen)
                read.append(int(client.info("stats")["total_net_output_bytes"]) - before)
                t_miss, out_miss = timed(miss_engine, prompt, args.gen)
                a, b = out_hit.outputs[0].routed_experts, out_miss.outputs[0].routed_experts
                assert np.array_equal(np.sort(a, -1), np.sort(b, -1)), "hit and recompute must return the same routes"
                sizes.append(a.nbytes)
                hits.append(t_hit)
                misses.append(t_miss)
                ratios.append(t_miss / t_hit)
                cached = (out_hit.num_cached_tokens, out_miss.num_cached_tokens)
            print(
                f"{n:>7} {1e3 * statistics.median(hits):>8.1f} {1e3 * statistics.median(misses):>8.1f} "
                f"{statistics.median(ratios):>8.2f} {str(cached):>16} {int(statistics.median(read)):>12} "
                f"{int(statistics.median(sizes)):>9}"
            )
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
