"""A session turn in the server's request path (``RouteResponder.generate``): it claims its session,
records what it delivered, and lets go when it fails or the client leaves; another turn meanwhile
gets HTTP 409; a session store that cannot be reached costs only a larger response (start 0).

The engine is a plain async generator of vLLM-shaped outputs; the session stores are the real ones
(in memory, and Redis on a real redis-server). The whole path against real servers behind vLLM's
router is ``test_fleet.py``.
"""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from auxout.testing.servers import free_port, redis_server
from auxout.vllm.fields import INTERNAL_KEY
from auxout.vllm.options import VllmOptions
from auxout.vllm.server.redis_sessions import RedisSessionStore
from auxout.vllm.server.responses import RouteResponder
from auxout.vllm.server.sessions import SessionStore
from auxout.vllm.server.weights_version import LOAD_PATH_METHOD, VERSION_METHOD, SyncError

pytestmark = pytest.mark.vllm

PROMPT = list(range(10, 30))


def params(session: str) -> Any:
    from vllm.sampling_params import RequestOutputKind

    return SimpleNamespace(extra_args={INTERNAL_KEY: {"session": session}}, routed_experts_prompt_start=0,
                           output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip


def engine(out_ids: list[int], gate: asyncio.Event | None = None, fail: bool = False) -> Any:
    """``AsyncLLM.generate`` as the responder calls it: one finished output (after ``gate``)."""

    async def generate(_engine: Any, prompt: Any, sp: Any, request_id: str, *a: Any, **kw: Any) -> Any:
        if gate is not None:
            yield SimpleNamespace(outputs=[], finished=False)  # (a first step: the turn is under way)
            await gate.wait()
        if fail:
            raise RuntimeError("engine failed")
        n = len(prompt["prompt_token_ids"]) + len(out_ids) - 1 - sp.routed_experts_prompt_start
        choice = SimpleNamespace(index=0, token_ids=out_ids, finish_reason="length",
                                 routed_experts=np.zeros((n, 2, 4), np.uint8))  # fmt: skip
        yield SimpleNamespace(outputs=[choice], finished=True)

    return generate


class Client:
    """The engine client calls a weight sync makes (``AsyncLLM``'s), in order; weights named by a version."""

    def __init__(self, version: str = "v1") -> None:
        self.version = version
        self.events: list[str] = []
        self.refuse: str | None = None

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: Any = None) -> Any:
        if method == VERSION_METHOD:
            return [self.version]
        assert method == LOAD_PATH_METHOD and args == ("/weights",)
        self.events.append("load")
        if self.refuse is not None:
            return [{"error": self.refuse}]
        self.version = "v2"
        return [{"num_tensors": 3, "moe_layers_repacked": 1}]

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        assert mode == "wait"
        self.events.append("pause")

    async def reset_prefix_cache(self) -> bool:
        self.events.append("reset")
        return True

    async def resume_generation(self) -> None:
        self.events.append("resume")


async def run(responder: RouteResponder, generate: Any, session: str, prompt: list[int], rid: str,
              client: Any = None) -> list[Any]:  # fmt: skip
    sp = params(session)
    client = SimpleNamespace() if client is None else client
    outs = [o async for o in responder.generate(client, generate, {"prompt_token_ids": prompt}, sp, rid)]
    return outs


@pytest.fixture(params=["memory", "redis"])
def sessions(request):  # type: ignore[no-untyped-def]
    if request.param == "memory":
        yield SessionStore()
        return
    with redis_server() as srv:
        yield RedisSessionStore(srv.url + "/0", namespace=uuid.uuid4().hex, model="tiny")


def test_a_second_turn_while_one_runs_gets_409_and_then_goes_on(sessions) -> None:  # type: ignore[no-untyped-def]
    from vllm.exceptions import GracefulHTTPError

    responder = RouteResponder(VllmOptions(), sessions=sessions)

    async def scenario() -> None:
        gate = asyncio.Event()
        first = asyncio.ensure_future(run(responder, engine([1, 2, 3], gate), "s", PROMPT, "r1"))
        await asyncio.sleep(0.2)
        with pytest.raises(GracefulHTTPError) as info:
            await run(responder, engine([4]), "s", PROMPT, "r2")
        assert info.value.http_status == 409 and "has another turn in flight" in str(info.value)
        gate.set()
        outs = await first
        assert outs[-1].auxout_route_start == 0
        nxt = await run(responder, engine([4]), "s", [*PROMPT, 1, 2, 3, 9], "r3")
        assert nxt[-1].auxout_route_start == len(PROMPT) + 2  # the first turn's rows are the client's

    asyncio.run(scenario())


def test_a_failed_or_abandoned_turn_lets_go_without_advancing(sessions) -> None:  # type: ignore[no-untyped-def]
    responder = RouteResponder(VllmOptions(), sessions=sessions)

    async def scenario() -> None:
        await run(responder, engine([1, 2]), "s", PROMPT, "r1")
        with pytest.raises(RuntimeError, match="engine failed"):
            await run(responder, engine([5], fail=True), "s", [*PROMPT, 1, 2, 7], "r2")
        gen = responder.generate(SimpleNamespace(), engine([6], asyncio.Event()), {"prompt_token_ids": PROMPT},
                                 params("s"), "r3")  # fmt: skip
        await gen.__anext__()  # under way...
        await gen.aclose()  # ...and the client is gone
        outs = await run(responder, engine([3]), "s", [*PROMPT, 1, 2, 7], "r4")  # not refused: both let go
        assert outs[-1].auxout_route_start == len(PROMPT) + 1  # where the first (recorded) turn left it

    asyncio.run(scenario())


def test_an_unreachable_session_store_sends_the_whole_history(caplog) -> None:  # type: ignore[no-untyped-def]
    dead = RedisSessionStore(f"redis://127.0.0.1:{free_port()}/0", namespace="n", model="tiny", timeout=1)
    responder = RouteResponder(VllmOptions(), sessions=dead)
    outs = asyncio.run(run(responder, engine([1, 2]), "s", PROMPT, "r1"))
    assert outs[-1].auxout_route_start == 0 and outs[-1].outputs[0].routed_experts.shape[0] == len(PROMPT) + 1
    assert "could not claim a session" in caplog.text and "sends the whole history" in caplog.text


def test_a_weight_sync_waits_for_session_turns_and_the_next_turn_restarts(sessions) -> None:  # type: ignore[no-untyped-def]
    """A sync waits for the session turn in flight, a turn arriving meanwhile waits for the sync,
    and runs under the new weights from row 0; the turn after it has deltas again."""
    responder = RouteResponder(VllmOptions(), sessions=sessions)
    client = Client()

    async def scenario() -> None:
        gate = asyncio.Event()
        first = asyncio.ensure_future(run(responder, engine([1, 2, 3], gate), "s", PROMPT, "r1", client))
        await asyncio.sleep(0.1)
        sync = asyncio.ensure_future(responder.weights_version.sync(client, "/weights"))
        await asyncio.sleep(0.1)
        assert not sync.done() and client.events == []  # (the turn in flight runs on the old weights)
        late = asyncio.ensure_future(run(responder, engine([4]), "s", [*PROMPT, 1, 2, 3, 9], "r2", client))
        await asyncio.sleep(0.1)
        assert not late.done()
        gate.set()
        assert (await first)[-1].auxout_route_start == 0
        result = await sync
        assert client.events == ["pause", "load", "reset", "resume"]
        assert result["weights_version"] == "v2" and result["num_tensors"] == 3
        assert (await late)[-1].auxout_route_start == 0  # the client's rows came from v1: all rows again
        nxt = await run(responder, engine([5]), "s", [*PROMPT, 1, 2, 3, 9, 4, 8], "r3", client)
        assert nxt[-1].auxout_route_start == len(PROMPT) + 4  # same weights: deltas again

    asyncio.run(scenario())


def test_a_refused_sync_touches_nothing_and_the_session_goes_on(sessions) -> None:  # type: ignore[no-untyped-def]
    responder = RouteResponder(VllmOptions(), sessions=sessions)
    client = Client()
    client.refuse = "weights: 'x' not in the engine's checkpoint"

    async def scenario() -> None:
        await run(responder, engine([1, 2]), "s", PROMPT, "r1", client)
        with pytest.raises(SyncError, match="not in the engine's checkpoint") as info:
            await responder.weights_version.sync(client, "/weights")
        assert info.value.status == 400 and client.events == ["pause", "load", "resume"]  # no reset
        outs = await run(responder, engine([3]), "s", [*PROMPT, 1, 2, 7], "r2", client)
        assert outs[-1].auxout_route_start == len(PROMPT) + 1

    asyncio.run(scenario())
