"""P/D routes through Mooncake and through shared memory on one host (slow tier: 4 engines).

Same scenario as ``test_pd_routes.py`` (which uses Redis): a prefill engine saves KV with vLLM's
``ExampleConnector``; a decode engine loads it and returns the whole sequence's routes, equal to
transformers' full forward, without recomputing the prompt. Mooncake: both engines are clients
of one real ``mooncake_master`` (the prefill engine's objects live in its segment). Shared
memory: each engine writes its own segment; the decode engine reads the prefill's through
``read_from``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from routes_oracle import Oracle, close_llm, random_prompt
from test_pd_routes import gen, pd_engine

from auxout.testing.servers import mooncake_master

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@contextmanager
def mooncake() -> Iterator[tuple[dict, dict]]:
    with mooncake_master() as m:
        opts = {"store": "mooncake", "namespace": "pd", "store_options": {"master_addr": m.master_addr}}
        yield opts, opts


@contextmanager
def shm() -> Iterator[tuple[dict, dict]]:
    name = f"auxout-pdtest-{os.getpid()}"
    prefill = {"store": "shm", "namespace": "pd", "store_options": {"shm_name": name}}
    decode = {
        "store": "shm", "namespace": "pd",
        "store_options": {"shm_name": name + "-d", "read_from": [f"shm://{name}"]},
    }  # fmt: skip
    yield prefill, decode


@pytest.mark.parametrize("backend", [mooncake, shm], ids=["mooncake", "shm"])
def test_decode_side_routes_through_backend(backend, tmp_path):  # type: ignore[no-untyped-def]
    from auxout.testing.models import build_tiny_moe

    model = build_tiny_moe("qwen3_moe")
    oracle = Oracle(model)
    with backend() as (p_opts, d_opts):
        prefill = pd_engine(model, str(tmp_path), "kv_producer", **p_opts)
        decode = pd_engine(model, str(tmp_path), "kv_consumer", **d_opts)
        try:
            for length in (100, 128):
                prompt = random_prompt(np.random.default_rng(length), length)
                gen(prefill, prompt, 1)
                d = gen(decode, prompt, 10)
                assert d.num_cached_tokens == (length - 2) // 32 * 32
                assert "auxout_recomputed_tokens" not in (d.kv_transfer_params or {}), d.kv_transfer_params
                oracle.check(prompt, d.outputs[0])
        finally:
            close_llm(decode)
            close_llm(prefill)
