"""Route sessions in a shared Redis: the in-memory store's answers, one turn at a time per session
across every replica, compare-and-set advances, TTL and size bounds (a real redis-server)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from auxout.testing.servers import redis_server
from auxout.vllm.server.redis_sessions import RedisSessionStore, SessionStoreError
from auxout.vllm.server.sessions import SessionBusyError, SessionStore

W = ("routing_weights",)


def store(redis_srv, **kw) -> RedisSessionStore:  # type: ignore[no-untyped-def]
    kw.setdefault("namespace", uuid.uuid4().hex)
    return RedisSessionStore(redis_srv.url + "/0", model="tiny", **kw)


@st.composite
def turns(draw: st.DrawFn) -> list[tuple[str, str, list[int], bool, list[int], str, str]]:
    """(session, how the prompt is made, new tokens, weights asked, output, outcome, weights version)."""
    out = []
    for _ in range(draw(st.integers(1, 12))):
        out.append((
            draw(st.sampled_from(["a", "b"])),
            draw(st.sampled_from(["extend", "extend", "rewrite", "other", "repeat"])),
            draw(st.lists(st.integers(0, 9), min_size=1, max_size=6)),
            draw(st.booleans()),
            draw(st.lists(st.integers(0, 9), min_size=1, max_size=4)),
            draw(st.sampled_from(["delivered", "delivered", "delivered", "released"])),
            draw(st.sampled_from(["v1", "v1", "v2"])),
        ))  # fmt: skip
    return out


@settings(max_examples=40)
@given(turns(), st.randoms(use_true_random=False))
def test_answers_equal_the_in_memory_store(redis_srv, steps, rnd) -> None:  # type: ignore[no-untyped-def]
    """Any sequence of turns (extended, rewritten, other conversations, failed turns, weights on
    and off, two sessions interleaved, turns under two weights versions): every start equals the
    in-memory store's."""
    shared, local = store(redis_srv), SessionStore()
    history: dict[str, list[int]] = {"a": [], "b": []}
    for i, (sid, how, new, weights, out, outcome, wv) in enumerate(steps):
        h = history[sid]
        prompt = (h + new if how == "extend" else h[: rnd.randint(0, len(h))] + [t + 10 for t in new]
                  if how == "rewrite" else [t + 20 for t in new] if how == "other" else h[:] or new)  # fmt: skip
        arrays = W if weights else ()
        turn = f"t{i}"
        got = shared.begin(sid, prompt, arrays, turn=turn, weights_version=wv)
        assert got == local.begin(sid, prompt, arrays, turn=turn, weights_version=wv)
        for v in ("v1", "v2"):
            assert shared.starts_for(sid, prompt, arrays, weights_version=v) == local.starts_for(
                sid, prompt, arrays, weights_version=v
            )
        if outcome == "released":
            shared.release(sid, turn)
            local.release(sid, turn)
            continue
        start = got["routed_experts"]
        shared.delivered(sid, prompt + out, start=start, arrays=arrays, turn=turn, weights_version=wv)
        local.delivered(sid, prompt + out, start=start, arrays=arrays, turn=turn, weights_version=wv)
        history[sid] = prompt + out
    for sid in ("a", "b"):
        probe = history[sid] + [1]
        for v in ("v1", "v2"):
            assert shared.starts_for(sid, probe, W, weights_version=v) == local.starts_for(
                sid, probe, W, weights_version=v
            )
    shared.close()


def test_one_turn_at_a_time_across_replicas(redis_srv) -> None:  # type: ignore[no-untyped-def]
    """Two replicas (two clients of one namespace): a turn in flight on one refuses the other's;
    once delivered, the other replica's next turn starts where the client's rows end."""
    ns = uuid.uuid4().hex
    a, b = store(redis_srv, namespace=ns), store(redis_srv, namespace=ns)
    assert a.begin("s", [1, 2, 3], turn="t1") == {"routed_experts": 0}
    with pytest.raises(SessionBusyError, match="has another turn in flight") as info:
        b.begin("s", [1, 2, 3], turn="t2")
    assert info.value.retry_after is not None and 0 < info.value.retry_after <= a.turn_lease
    a.delivered("s", [1, 2, 3, 4, 5], start=0, turn="t1")
    assert b.begin("s", [1, 2, 3, 4, 5, 6, 7], turn="t2") == {"routed_experts": 4}
    b.release("s", "t2")  # a failed turn: the session stays where it was
    assert a.begin("s", [1, 2, 3, 4, 5, 6, 7], turn="t3") == {"routed_experts": 4}
    a.delivered("s", [1, 2, 3, 4, 5, 6, 7, 8], start=4, turn="t3")
    assert b.starts_for("s", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == {"routed_experts": 7}
    other_model = RedisSessionStore(redis_srv.url + "/0", namespace=ns, model="other")
    assert other_model.starts_for("s", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == {"routed_experts": 0}


def test_concurrent_claims_let_exactly_one_turn_through(redis_srv) -> None:  # type: ignore[no-untyped-def]
    ns = uuid.uuid4().hex
    replicas = [store(redis_srv, namespace=ns) for _ in range(8)]
    go = threading.Barrier(len(replicas))
    won: list[int] = []
    busy: list[int] = []

    def run(i: int) -> None:
        go.wait()
        try:
            replicas[i].begin("race", [1, 2, 3], turn=f"t{i}")
            won.append(i)
        except SessionBusyError:
            busy.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(busy) == len(replicas) - 1


def test_a_turn_that_lost_its_claim_does_not_advance_the_session(redis_srv) -> None:  # type: ignore[no-untyped-def]
    """Compare-and-set: a turn whose lease ran out while another turn took the session and
    advanced it cannot overwrite it; a turn whose lease ran out unopposed still records."""
    ns = uuid.uuid4().hex
    a, b = store(redis_srv, namespace=ns, turn_lease=0.05), store(redis_srv, namespace=ns, turn_lease=0.05)
    a.begin("s", [1, 2, 3], turn="slow")
    time.sleep(0.2)  # (the slow turn's lease runs out)
    b.begin("s", [1, 2, 3], turn="fast")
    b.delivered("s", [1, 2, 3, 9, 9], start=0, turn="fast")
    a.delivered("s", [1, 2, 3, 4, 5, 6], start=0, turn="slow")  # not recorded
    assert a.starts_for("s", [1, 2, 3, 9, 9, 9]) == {"routed_experts": 4}
    a.begin("s", [1, 2, 3, 9, 9, 9], turn="late")
    time.sleep(0.2)
    a.delivered("s", [1, 2, 3, 9, 9, 9, 7], start=4, turn="late")  # nobody else came: recorded
    assert b.starts_for("s", [1, 2, 3, 9, 9, 9, 7, 1]) == {"routed_experts": 6}


def test_bounded_in_sessions_tokens_and_time(redis_srv) -> None:  # type: ignore[no-untyped-def]
    s = store(redis_srv, max_sessions=2, max_tokens=10)
    for sid in ("a", "b"):
        s.begin(sid, [1, 2, 3], turn=sid)
        s.delivered(sid, [1, 2, 3], turn=sid)
    s.begin("c", [1, 2, 3], turn="c")
    s.delivered("c", [1, 2, 3], turn="c")  # three sessions: the least recently used (a) goes
    assert len(s) == 2 and s.starts_for("a", [1, 2, 3, 4]) == {"routed_experts": 0}
    assert s.starts_for("c", [1, 2, 3, 4]) == {"routed_experts": 2}
    s.delivered("d", list(range(9)))  # 9 + 3 > 10 tokens: the oldest goes
    assert s.total_tokens <= 10 and len(s) == 1
    s.delivered("e", list(range(11)))  # longer than the whole budget: not kept
    assert s.starts_for("e", list(range(12))) == {"routed_experts": 0}
    short = store(redis_srv, ttl=0.2)
    short.delivered("x", [1, 2, 3])
    assert short.starts_for("x", [1, 2, 3, 4]) == {"routed_experts": 2}
    time.sleep(0.5)
    assert short.starts_for("x", [1, 2, 3, 4]) == {"routed_experts": 0}  # expired: the whole history again
    with pytest.raises(ValueError):
        store(redis_srv, max_sessions=0)


def test_an_unreachable_store_says_where_and_hides_the_password() -> None:
    with redis_server(password="pw-s3cret") as srv:
        s = RedisSessionStore(srv.auth_url + "/0", namespace="n", model="tiny", timeout=1)
        s.delivered("s", [1, 2, 3])
        assert s.starts_for("s", [1, 2, 3, 4]) == {"routed_experts": 2}
    with pytest.raises(SessionStoreError) as info:
        s.begin("s", [1, 2, 3, 4], turn="t")
    assert "could not claim a session" in str(info.value) and "pw-s3cret" not in str(info.value)
