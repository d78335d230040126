"""The auxout HTTP fields are checked before a request reaches the engine; each error names its field."""

from __future__ import annotations

import numpy as np
import pytest

from auxout.vllm.options import VllmOptions
from auxout.vllm.server.responses import ChoiceRows, _FieldError, _num_prompts, check_route_fields

ARENA = VllmOptions()
REDIS = VllmOptions(store="redis", store_options={"url": "redis://h", "namespace": "n"})


def fields(extra, **kw):
    args = {"n": 1, "use_beam_search": False, "options": ARENA, "output_flag": None, **kw}
    return check_route_fields(extra, **args)


def test_defaults_and_good_values():
    assert fields({}) == {"format": "npy"}
    keys_server = VllmOptions(store="redis", output="keys", store_options={"url": "redis://h", "namespace": "n"})
    assert fields({"routed_experts_session": "s"}, output_flag="inline", options=keys_server)["session"] == "s"
    assert fields({"routed_experts_format": "packed", "routed_experts_session": "s"}) == {"format": "packed", "session": "s"}
    assert fields({}, output_flag="keys", options=REDIS) == {"format": "npy"}


@pytest.mark.parametrize(
    "extra, kw, field",
    [
        ({"routed_experts_format": "zip"}, {}, "routed_experts_format"),
        ({"routed_experts_format": None}, {}, "routed_experts_format"),
        ({"routed_experts_session": ["a"]}, {}, "routed_experts_session"),
        ({"routed_experts_session": "s"}, {"n": 3}, "routed_experts_session"),
        ({"routed_experts_session": "s"}, {"use_beam_search": True}, "routed_experts_session"),
        ({"routed_experts_session": "s"}, {"num_prompts": 2}, "routed_experts_session"),
        ({"return_routing_weights": 1}, {}, "return_routing_weights"),
        ({"return_routing_weights": True}, {}, "return_routing_weights"),
        ({}, {"output_flag": "keys"}, "routed_experts_output"),
        # a session sends deltas inline; keys-only output would never advance it
        ({"routed_experts_session": "s"}, {"output_flag": "keys", "options": REDIS}, "routed_experts_session"),
        ({"routed_experts_session": "s"}, {"options": VllmOptions(store="redis", output="keys", store_options={
            "url": "redis://h", "namespace": "n"})}, "routed_experts_session"),
    ],
)
def test_bad_fields_name_themselves(extra, kw, field):
    with pytest.raises(_FieldError) as ei:
        fields(extra, **kw)
    assert ei.value.field == field and field in str(ei.value)


def test_num_prompts():
    assert _num_prompts("text") == _num_prompts([1, 2, 3]) == _num_prompts(None) == 1
    assert _num_prompts(["a", "b"]) == _num_prompts([[1], [2]]) == 2


class _Out:
    def __init__(self, token_ids, routed_experts=None, chunks=None):
        self.token_ids, self.routed_experts = token_ids, routed_experts
        if chunks is not None:
            self.auxout_chunks = chunks


def test_choice_rows_follow_the_tokens_and_concatenate_exactly():
    rows = np.arange(20 * 2 * 2, dtype=np.uint8).reshape(20, 2, 2)
    chunks: list[np.ndarray] = []
    t = ChoiceRows(start=3)
    t.tokens = 10  # prompt of 10 tokens: rows 3..8 once the prefill ran
    chunks.append(rows[:6])  # prefill rows (positions 3..8)
    t.observe(_Out([], chunks=chunks), None)
    got = [t.take(False)]
    assert got[0][0] == 3 and len(got[0][1]) == 6
    chunks.append(rows[6:7])  # one decode step: the first output token's row arrives with the second
    t.observe(_Out([50]), None)
    got.append(t.take(False))
    assert got[-1][0] == 9 and len(got[-1][1]) == 1
    chunks.append(rows[7:9])  # rows ahead of the tokens are held back until the tokens cover them
    t.observe(_Out([51]), None)
    got.append(t.take(False))
    assert got[-1][0] == 10 and len(got[-1][1]) == 1
    t.observe(_Out([52], routed_experts=rows[:10]), None)  # finished: the whole array
    got.append(t.take(True))
    assert got[-1][0] == 11
    np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), rows[:10])


def test_large_routes_are_encoded_off_the_event_loop():
    """From OFFLOAD_SLOTS slots on, a response's routes are encoded on a worker thread: the event
    loop runs other tasks meanwhile (counted by a task that yields in a loop); smaller ones are
    encoded inline. Either way the fields are those route_fields writes."""
    import asyncio

    from auxout.vllm.server.responses import OFFLOAD_SLOTS, RouteResponder

    responder = RouteResponder(VllmOptions())
    responder.num_experts = 128
    big = np.random.default_rng(0).integers(0, 128, size=(OFFLOAD_SLOTS // 384 + 1, 48, 8)).astype(np.uint8)

    async def encode_while_ticking(rows):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        fields = await responder.route_fields_async(rows, 7, "packed")
        during = ticks - before
        task.cancel()
        return fields, during

    for rows, offloaded in ((big, True), (big[:10], False)):
        fields, during = asyncio.run(encode_while_ticking(rows))
        assert (during > 0) is offloaded
        assert fields == responder.route_fields(rows, 7, "packed")
