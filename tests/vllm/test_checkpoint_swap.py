"""A new checkpoint written to the same path never gets the previous weights' routes.

RL jobs save each checkpoint to one path and restart (or add) rollout engines against the same
shared route store. Block hashes cover tokens, not weights, so a key that named only the model
path handed the restarted engine the old weights' routes on every prefix hit (found by a probe:
320 of 320 prefix rows wrong, no error). The route fingerprint now includes a digest of the
checkpoint's files: the same prompt after the swap must equal the new weights' full forward.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from routes_oracle import Oracle, close_llm, greedy, make_llm, random_prompt

from auxout.testing.servers import redis_server

pytestmark = pytest.mark.vllm


def _put_checkpoint(src: str, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


@pytest.mark.slow  # (three engine starts; in-place syncs with new weights are in the default tier: test_weight_sync)
def test_engine_restarted_on_new_weights_at_the_same_path_routes_them(tmp_path: Path) -> None:
    from auxout.testing.models import build_tiny_moe

    old, new = build_tiny_moe("qwen3_moe", seed=0), build_tiny_moe("qwen3_moe", seed=1)
    ckpt = tmp_path / "ckpt"
    prompt = random_prompt(np.random.default_rng(5), 5 * 32)
    with redis_server() as redis:
        opts = {"store": "redis", "namespace": "swap", "store_options": {"url": redis.url, "namespace": "r3"}}
        _put_checkpoint(old, ckpt)
        first = make_llm(str(ckpt), opts, max_model_len=512)
        try:
            (a,) = first.generate([{"prompt_token_ids": prompt}], greedy(2), use_tqdm=False)
        finally:
            close_llm(first)
        _put_checkpoint(new, ckpt)  # the trainer's next checkpoint, same path, same store
        oracle = Oracle(str(ckpt))
        second = make_llm(str(ckpt), opts, max_model_len=512)
        try:
            longer = prompt + [11, 12, 13]
            for _ in range(2):  # the second time its own prefix is cached (locally and in the store)
                (b,) = second.generate([{"prompt_token_ids": longer}], greedy(4), use_tqdm=False)
                oracle.check(longer, b.outputs[0])
        finally:
            close_llm(second)
    assert not np.array_equal(Oracle(old).routes(prompt), oracle.routes(prompt))  # the swap changes routes
