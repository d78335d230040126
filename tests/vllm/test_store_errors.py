"""A store too small for the KV cache: a prefix hit whose routes were evicted is recomputed.

The KV cache still holds the prefix, the store does not: the scheduler clips the hit to the
readable routes, the engine recomputes the rest, and the routes are exact (never an error,
never partial). Retrying the same prompt keeps working.
"""

from __future__ import annotations

import numpy as np
import pytest
from routes_oracle import Oracle, close_llm, greedy, make_llm, random_prompt

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_tiny_moe

    return build_tiny_moe("qwen3_moe")


@pytest.fixture(scope="module")
def llm(model_path: str):
    from auxout.vllm import engine_kwargs

    # Two route objects (32 tokens x 2 layers x 4 experts, uint8 = 256 B each).
    kw = engine_kwargs(max_bytes=2 * 256)
    engine = make_llm(model_path, max_model_len=512, additional_config=kw["additional_config"])
    yield engine
    close_llm(engine)


def test_evicted_prefix_is_recomputed_with_exact_routes(llm, model_path):
    oracle = Oracle(model_path)
    rng = np.random.default_rng(40)
    prompts = [random_prompt(rng, 100) for _ in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(10), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        oracle.check(p, o.outputs[0])
    again = prompts[0] + list(outs[0].outputs[0].token_ids) + random_prompt(rng, 5)
    recomputed = []
    for _ in range(2):  # the same prompt twice: never a sticky failure
        (hit,) = llm.generate([{"prompt_token_ids": again}], greedy(10), use_tqdm=False)
        assert hit.outputs[0].finish_reason == "length", hit.outputs[0].stop_reason
        oracle.check(again, hit.outputs[0])
        recomputed.append((hit.kv_transfer_params or {}).get("auxout_recomputed_tokens", 0))
    assert recomputed[0] > 0, "the KV cache held the prefix, the 2-object store did not: recomputed"
    fresh = random_prompt(rng, 20)
    (ok,) = llm.generate([{"prompt_token_ids": fresh}], greedy(5), use_tqdm=False)
    oracle.check(fresh, ok.outputs[0])
