"""Route scenarios shared by the parallel-engine modules (one engine per topology per module).

Each scenario compares every request's routes with transformers' full forward: a cold request,
chunked prefill (64-token steps), a prefix-cache hit on a second turn, and a batch large
enough for the engine's small KV cache (``num_gpu_blocks_override``) to preempt.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from routes_oracle import Oracle, greedy, metric, random_prompt

# small enough that the concurrent batch below preempts, large enough for any one request
ENGINE_KW: dict[str, Any] = {
    "max_model_len": 1024, "max_num_batched_tokens": 64, "max_num_seqs": 8, "num_gpu_blocks_override": 40,
}  # fmt: skip


def run(llm: Any, prompts: list[list[int]], params: Any) -> tuple[list[Any], list[Any]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs], outs


def chunked_prefill_and_prefix_hit(llm: Any, oracle: Oracle, seed: int) -> None:
    rng = np.random.default_rng(seed)
    first = random_prompt(rng, 150)  # three prefill chunks
    (c1,), (o1,) = run(llm, [first], greedy(10))
    assert o1.num_cached_tokens == 0
    oracle.check(first, c1)
    second = first + list(c1.token_ids) + random_prompt(rng, 25)
    (c2,), (o2,) = run(llm, [second], greedy(10))
    assert o2.num_cached_tokens >= 128, o2.num_cached_tokens
    rows = oracle.check(second, c2)
    # the prefix served from the store equals what the first request computed, bit for bit
    assert np.array_equal(rows[: len(first) + 9], c1.routed_experts)


def concurrent_with_preemption(llm: Any, oracle: Oracle, seed: int) -> None:
    rng = np.random.default_rng(seed)
    base = random_prompt(rng, 64)
    prompts = [base + random_prompt(rng, 30 + 25 * i) for i in range(8)]
    before = metric(llm, "vllm:num_preemptions")
    comps, _ = run(llm, prompts, greedy(60))
    for p, c in zip(prompts, comps, strict=True):
        oracle.check(p, c)
    assert metric(llm, "vllm:num_preemptions") > before, "the KV cache must be small enough to preempt"
