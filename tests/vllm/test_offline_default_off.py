"""An offline engine whose routes are off by default (``engine_kwargs(default_return=False)``).

A request that sends a route field (a prompt start, routing weights, an output kind) asks for
routes by sending it, as over HTTP (``auxout serve --auxout-default-return false``): it gets them,
equal to transformers' forward. A request that both opts out and asks for routes is refused,
naming the field, and the engine keeps serving.
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
    engine = make_llm(
        model_path, auxout={"default_return": False, "routing_weights": True}, max_model_len=512, max_num_seqs=4
    )
    yield engine
    close_llm(engine)


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return Oracle(model_path)


def one(llm, prompt, params):  # type: ignore[no-untyped-def]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out.outputs[0]


def test_no_route_field_no_routes(llm):
    c = one(llm, random_prompt(np.random.default_rng(1), 30), greedy(4))
    assert c.routed_experts is None


@pytest.mark.parametrize(
    "kw, start",
    [
        ({"routed_experts_prompt_start": 7}, 7),
        ({"extra_args": {"return_routing_weights": True}}, 0),
        ({"extra_args": {"routed_experts_output": "inline"}}, 0),
        ({"extra_args": {"return_routed_experts": True}}, 0),
    ],
)
def test_a_route_field_asks_for_routes(llm, oracle, kw, start):
    prompt = random_prompt(np.random.default_rng(2 + start), 40)
    c = one(llm, prompt, greedy(6, **kw))
    oracle.check(prompt, c, start)
    if "return_routing_weights" in str(kw):
        oracle.check_weights(prompt, c, start)


@pytest.mark.parametrize("field, kw", [
    ("return_routing_weights", {"extra_args": {"return_routing_weights": True}}),
    ("routed_experts_output", {"extra_args": {"routed_experts_output": "inline"}}),
    ("routed_experts_prompt_start", {"routed_experts_prompt_start": 5}),
])
def test_opting_out_while_asking_is_refused_and_the_engine_serves_on(llm, oracle, field, kw):
    from vllm.exceptions import VLLMValidationError

    prompt = random_prompt(np.random.default_rng(3), 25)
    extra = {"return_routed_experts": False, **kw.get("extra_args", {})}
    with pytest.raises(VLLMValidationError, match=f"{field}.*return_routed_experts=false"):
        one(llm, prompt, greedy(4, **{**kw, "extra_args": extra}))
    c = one(llm, prompt, greedy(4, routed_experts_prompt_start=3))
    oracle.check(prompt, c, 3)


def test_a_prompt_start_of_none_is_unset(llm, oracle):
    """``routed_experts_prompt_start=None`` is "not set" (as null over HTTP), not vLLM's TypeError."""
    prompt = random_prompt(np.random.default_rng(4), 20)
    c = one(llm, prompt, greedy(3, routed_experts_prompt_start=None, extra_args={"return_routed_experts": True}))
    oracle.check(prompt, c, 0)
