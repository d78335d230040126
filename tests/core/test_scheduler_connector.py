"""SchedulerConnector: incremental metadata, exactly-once terminal events, output clipping, validation."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from fake_requests import Req, h
from hypothesis import given
from hypothesis import strategies as st

from auxout.connector.messages import NO_EMIT, StepOutput
from auxout.connector.scheduler import SchedulerConnector, validate_prompt_start
from auxout.errors import InvariantError, RequestValidationError, RoutesUnavailableError
from auxout.profile import RouteProfile
from auxout.stores import ArenaStore
from auxout.stores.rows import StoreRows, join_rows
from auxout.testing import FakeMoE

PROF = RouteProfile(num_layers=3, top_k=2, num_experts=16)
MODEL = FakeMoE(num_layers=3, top_k=2, num_experts=16, vocab_size=100, seed=7)


def reqs(*rs: Req) -> dict[str, Req]:
    return {r.request_id: r for r in rs}


def hashes_of(meta, rid: str) -> list[bytes]:
    return list(meta.block_hashes[rid])


def output(entries: dict[str, tuple[int, np.ndarray]], errors: dict[str, str] | None = None) -> StepOutput:
    """A StepOutput with ``rid -> (token_start, rows)``; an empty rows array still emits."""
    ids = list(entries)
    parts = [entries[r][1] for r in ids]
    lens = np.array([len(p) for p in parts], dtype=np.int64)
    lo = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if ids else np.zeros(0, np.int64)
    rows = np.concatenate(parts) if parts else PROF.empty(0)
    return StepOutput(
        ids,
        np.array([entries[r][0] for r in ids], dtype=np.int64),
        lo,
        lo + lens,
        rows,
        errors or {},
    )


ROWS = MODEL.routes(list(range(40)))


# -- metadata ------------------------------------------------------------------------------------


def test_builds_metadata_for_a_request_with_outputs() -> None:
    sc = SchedulerConnector()
    sc.add_request("r", prompt_len=4)
    r = Req("r", num_tokens=5, num_output_tokens=1, block_hashes=[h(1)])
    meta = sc.build_metadata(["r"], reqs(r))
    assert meta.generation == 0
    assert meta.requests == {"r": 4}  # num_tokens - 1
    assert hashes_of(meta, "r") == [h(1)]
    assert meta.block_hashes["r"].item_size == 8
    assert meta.finished == ()
    got = sc.take_output(output({"r": (0, ROWS[:4])}), r)
    assert got is not None and np.array_equal(got, ROWS[:4])


@pytest.mark.parametrize("prompt_start", [0, 2, 6])
def test_new_request_emits_from_prompt_start(prompt_start: int) -> None:
    sc = SchedulerConnector()
    sc.add_request("r", prompt_len=6, prompt_start=prompt_start)
    meta = sc.build_metadata(["r"], reqs(Req("r", 6, 0, [h(1)])))
    assert meta.requests == {"r": prompt_start}


def test_running_request_emits_from_last_token() -> None:
    sc = SchedulerConnector()
    sc.add_request("r", prompt_len=6, prompt_start=3)
    r = Req("r", 6, 0, [h(1)])
    assert sc.build_metadata(["r"], reqs(r)).requests == {"r": 3}
    r.num_tokens, r.num_output_tokens = 9, 3
    assert sc.build_metadata(["r"], reqs(r)).requests == {"r": 8}
    # numpy integer prompt starts are accepted too
    sc.add_request("q", prompt_len=6, prompt_start=np.int64(5))
    assert sc.build_metadata(["q"], reqs(r, Req("q", 6))).requests == {"q": 5}


def test_unregistered_request_uses_defaults() -> None:
    sc = SchedulerConnector()
    assert sc.build_metadata(["x"], reqs(Req("x", 3))).requests == {"x": 0}
    off = SchedulerConnector(default_return=False)
    assert off.build_metadata(["x"], reqs(Req("x", 3))).requests == {"x": NO_EMIT}


def test_each_block_hash_is_sent_once_and_incrementally() -> None:
    sc = SchedulerConnector()
    r = Req("r", 8, 0, [h(1), h(2)])
    m1 = sc.build_metadata(["r"], reqs(r))
    assert hashes_of(m1, "r") == [h(1), h(2)]
    m2 = sc.build_metadata(["r"], reqs(r))
    assert m2.block_hashes == {} and m2.requests == {"r": 0}
    r.block_hashes.append(h(3))
    m3 = sc.build_metadata(["r"], reqs(r))
    assert hashes_of(m3, "r") == [h(3)]
    r.block_hashes += [h(4), h(5)]
    assert hashes_of(sc.build_metadata(["r"], reqs(r)), "r") == [h(4), h(5)]


def test_request_without_hashes_sends_no_entry() -> None:
    sc = SchedulerConnector()
    meta = sc.build_metadata(["r"], reqs(Req("r", 3)))
    assert meta.requests == {"r": 0} and meta.block_hashes == {}


def test_hash_only_update_for_tracked_unscheduled_request() -> None:
    sc = SchedulerConnector()
    a, b = Req("a", 4, 0, [h(1)]), Req("b", 4, 0, [h(9)])
    sc.build_metadata(["a", "b"], reqs(a, b))
    a.block_hashes.append(h(2))
    meta = sc.build_metadata(["b"], reqs(a, b))
    assert meta.requests == {"b": 0}
    assert set(meta.block_hashes) == {"a"} and hashes_of(meta, "a") == [h(2)]
    # only once
    meta = sc.build_metadata([], reqs(a, b))
    assert meta.requests == {} and meta.block_hashes == {}
    # a hash-only update with nothing scheduled at all
    b.block_hashes.append(h(10))
    meta = sc.build_metadata([], reqs(a, b))
    assert meta.requests == {} and hashes_of(meta, "b") == [h(10)]


def test_shrinking_hash_history_is_an_invariant_error() -> None:
    sc = SchedulerConnector()
    r = Req("r", 8, 0, [h(1), h(2)])
    sc.build_metadata(["r"], reqs(r))
    r.block_hashes = [h(1)]
    with pytest.raises(InvariantError, match="'r' shrank from 2 to 1"):
        sc.build_metadata(["r"], reqs(r))
    sc2 = SchedulerConnector()
    sc2.build_metadata(["r"], reqs(Req("r", 8, 0, [h(1), h(2)])))
    with pytest.raises(InvariantError, match="shrank"):
        sc2.request_finished(Req("r", 8, 0, []))


# -- terminal events -------------------------------------------------------------------------------


def test_terminal_events_keep_order_and_are_delivered_once() -> None:
    sc = SchedulerConnector()
    a, b, c = Req("a", 4, 0, [h(1)]), Req("b", 4, 0, [h(2)]), Req("c", 4, 0, [h(3)])
    sc.build_metadata(["a", "b", "c"], reqs(a, b, c))
    sc.request_finished(c)
    sc.request_finished(a)
    sc.request_finished(b)
    meta = sc.build_metadata([], {})
    assert meta.finished == ("c", "a", "b")
    assert meta.block_hashes == {}  # no hash was new
    assert sc.build_metadata([], {}).finished == ()
    sc.request_finished(a)  # already terminated: nothing more
    assert sc.build_metadata([], {}).finished == ()


def test_terminal_event_carries_hashes_discovered_after_last_schedule() -> None:
    sc = SchedulerConnector()
    r = Req("r", 4, 0, [h(1)])
    sc.build_metadata(["r"], reqs(r))
    r.block_hashes += [h(2), h(3)]
    r.num_tokens = 12
    sc.request_finished(r)
    meta = sc.build_metadata([], {})
    assert meta.finished == ("r",)
    assert list(meta.final_hashes["r"]) == [h(2), h(3)] and "r" not in meta.block_hashes
    assert meta.requests == {}


def test_never_announced_request_has_no_terminal_event() -> None:
    sc = SchedulerConnector()
    sc.add_request("r", 4)
    sc.request_finished(Req("r", 4, 0, [h(1)]))
    assert sc.build_metadata([], {}).finished == ()


def test_preempted_request_is_re_sent_all_hashes() -> None:
    sc = SchedulerConnector()
    sc.add_request("r", prompt_len=8, prompt_start=2)
    r = Req("r", 8, 0, [h(1), h(2)])
    sc.build_metadata(["r"], reqs(r))
    r.num_tokens, r.num_output_tokens = 10, 2
    r.block_hashes.append(h(3))
    sc.build_metadata(["r"], reqs(r))
    sc.request_finished(r, preempted=True)
    meta = sc.build_metadata([], {})
    assert meta.finished == ("r",) and meta.block_hashes == {}
    meta = sc.build_metadata(["r"], reqs(r))  # resumed
    assert hashes_of(meta, "r") == [h(1), h(2), h(3)]
    assert meta.requests == {"r": 9}
    assert meta.finished == ()
    # preemption keeps the route options
    r2 = Req("r", 8, 0, [h(1), h(2), h(3)])
    sc.request_finished(r2, preempted=True)
    sc.build_metadata([], {})
    assert sc.build_metadata(["r"], reqs(r2)).requests == {"r": 2}


def test_finish_drops_route_options() -> None:
    sc = SchedulerConnector()
    sc.add_request("r", 4, return_routes=False)
    assert not sc.returns_routes("r")
    r = Req("r", 4)
    sc.build_metadata(["r"], reqs(r))
    sc.request_finished(r)
    assert sc.returns_routes("r")  # back to the default
    sc.add_request("q", 4, return_routes=False)
    sc.forget("q")
    assert sc.returns_routes("q")


# -- take_output ---------------------------------------------------------------------------------


def test_consumes_ordered_stale_outputs_with_clipping() -> None:
    sc = SchedulerConnector()
    r = Req("r", 6, 1)
    first = sc.take_output(output({"r": (0, ROWS[:5])}), r)
    assert first is not None and np.array_equal(first, ROWS[:5])
    # the next output covers 3 positions, but a stop cut the request at one more token
    r.num_tokens, r.num_output_tokens = 7, 2
    second = sc.take_output(output({"r": (5, ROWS[5:8])}), r, finished=True)
    assert second is not None and np.array_equal(second, ROWS[5:6])


def test_take_output_returns_a_view_of_the_step_rows() -> None:
    sc = SchedulerConnector()
    out = output({"a": (0, ROWS[:3]), "b": (4, ROWS[4:6])})
    a, b = Req("a", 4, 1), Req("b", 6, 1)
    got_b = sc.take_output(out, b)
    got_a = sc.take_output(out, a)
    assert got_a is not None and np.array_equal(got_a, ROWS[:3])
    assert got_b is not None and np.array_equal(got_b, ROWS[4:5])


def test_missing_output_is_an_invariant_error() -> None:
    sc = SchedulerConnector()
    r = Req("r", 4, 1)
    with pytest.raises(InvariantError, match="missing for request 'r'"):
        sc.take_output(None, r)
    with pytest.raises(InvariantError, match="worker output is missing request 'r'"):
        sc.take_output(output({}), r)
    with pytest.raises(InvariantError, match="missing request 'r'"):
        sc.take_output(output({"other": (0, ROWS[:3])}), r)
    silent = StepOutput(["r"], np.array([0]), np.array([-1]), np.array([-1]), ROWS[:3])
    with pytest.raises(InvariantError, match="missing request 'r'"):
        sc.take_output(silent, r)


def test_rows_shorter_than_accepted_range_are_an_invariant_error_at_finish() -> None:
    sc = SchedulerConnector()
    r = Req("r", 6, 1)
    with pytest.raises(InvariantError, match="invalid token range for request 'r'") as ei:
        sc.take_output(output({"r": (0, ROWS[:4])}), r, finished=True)
    assert "accepted end 5" in str(ei.value) and "[0, 4)" in str(ei.value)


def test_rows_returned_as_captured_advance_the_emit_start() -> None:
    """A prefill chunk that sampled nothing returns its rows; a restart resumes after them."""
    sc = SchedulerConnector()
    sc.add_request("r", prompt_len=10)
    r = Req("r", 10, 0)
    assert sc.build_metadata(["r"], reqs(r)).requests == {"r": 0}
    got = sc.take_output(output({"r": (0, ROWS[:4])}), r)
    assert got is not None and np.array_equal(got, ROWS[:4])
    sc.request_finished(r, preempted=True)  # e.g. a restart to recompute unreadable prefix rows
    assert sc.build_metadata(["r"], reqs(r)).requests == {"r": 4}


def test_finished_request_without_accepted_range_is_an_invariant_error() -> None:
    sc = SchedulerConnector()
    r = Req("r", 6, 1)
    out = output({"r": (6, ROWS[6:7])})
    assert sc.take_output(out, r) is None  # not finished: a stale output past the end
    with pytest.raises(InvariantError, match="finished request 'r' has no accepted token range") as ei:
        sc.take_output(out, r, finished=True)
    assert "token_end=5" in str(ei.value)


def test_empty_accepted_range_returns_empty_rows_even_when_finished() -> None:
    sc = SchedulerConnector()
    r = Req("r", 5, 1)
    got = sc.take_output(output({"r": (4, ROWS[4:4])}), r, finished=True)
    assert got is not None and got.shape == (0, 3, 2) and got.dtype == PROF.dtype


def test_worker_error_becomes_routes_unavailable_for_that_request_only() -> None:
    sc = SchedulerConnector()
    out = output({"ok": (0, ROWS[:3])}, errors={"bad": "ObjectMissingError: gone"})
    with pytest.raises(RoutesUnavailableError, match="'bad'.*gone") as ei:
        sc.take_output(out, Req("bad", 4, 1))
    assert ei.value.request_id == "bad" and "gone" in ei.value.reason
    got = sc.take_output(out, Req("ok", 4, 1))
    assert got is not None and np.array_equal(got, ROWS[:3])


def test_opt_out_returns_none_and_never_emits() -> None:
    sc = SchedulerConnector()
    sc.add_request("r", 4, return_routes=False)
    r = Req("r", 5, 1, [h(1)])
    meta = sc.build_metadata(["r"], reqs(r))
    assert meta.requests == {"r": NO_EMIT}
    assert hashes_of(meta, "r") == [h(1)]  # rows are still published for prefix reuse
    assert sc.take_output(None, r) is None
    assert sc.take_output(output({}), r, finished=True) is None


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (-1, "must be non-negative"),
        (5, "must not exceed the prompt length 4"),
        (True, "must be an integer, not bool"),
        (False, "must be an integer, not bool"),
        (1.0, "must be an integer, not float"),
        ("2", "must be an integer, not str"),
        (None, "must be an integer, not NoneType"),
    ],
)
def test_prompt_start_validation(value: object, fragment: str) -> None:
    sc = SchedulerConnector()
    with pytest.raises(RequestValidationError) as ei:
        sc.add_request("r", prompt_len=4, prompt_start=value)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.field == "routed_experts_prompt_start"
    assert err.value == value and type(err.value) is type(value)
    assert fragment in str(err)
    assert f"routed_experts_prompt_start={value!r}" in str(err)
    assert sc.build_metadata(["r"], reqs(Req("r", 4))).requests == {"r": 0}  # nothing was registered


def test_prompt_start_equal_to_prompt_length_is_accepted() -> None:
    assert validate_prompt_start(4, 4) == 4
    assert validate_prompt_start(0, 0) == 0
    sc = SchedulerConnector()
    sc.add_request("r", prompt_len=4, prompt_start=4)
    r = Req("r", 4)
    assert sc.build_metadata(["r"], reqs(r)).requests == {"r": 4}
    r.num_tokens, r.num_output_tokens = 5, 1
    first = sc.take_output(output({"r": (4, ROWS[4:4])}), r)
    assert first is not None and len(first) == 0 and first.shape[1:] == (3, 2)
    r.num_tokens, r.num_output_tokens = 6, 2
    second = sc.take_output(output({"r": (4, ROWS[4:5])}), r, finished=True)
    assert second is not None and np.array_equal(second, ROWS[4:5])


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_return_routes_must_be_boolean(value: object) -> None:
    sc = SchedulerConnector()
    with pytest.raises(RequestValidationError, match="return_routed_experts") as ei:
        sc.add_request("r", 4, return_routes=value)
    assert ei.value.field == "return_routed_experts" and ei.value.value == value


def test_request_validation_error_pickles() -> None:
    import pickle

    err = RequestValidationError("routed_experts_prompt_start", -3, "must be non-negative")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RequestValidationError and str(back) == str(err) and back.value == -3


# -- reset ----------------------------------------------------------------------------------------


def test_reset_bumps_generation_and_re_sends_everything() -> None:
    sc = SchedulerConnector()
    r = Req("r", 5, 1, [h(1)])
    d = Req("d", 4, 0, [h(7)])
    sc.build_metadata(["r", "d"], reqs(r, d))
    sc.request_finished(d)  # pending terminal event, dropped by the reset
    sc.reset()
    empty = sc.build_metadata([], reqs(r))
    assert empty.generation == 1
    assert empty.requests == {} and empty.block_hashes == {} and empty.finished == ()
    meta = sc.build_metadata(["r"], reqs(r))
    assert meta.generation == 1
    assert meta.requests == {"r": 4}
    assert hashes_of(meta, "r") == [h(1)]
    sc.reset()
    assert sc.build_metadata([], {}).generation == 2


def test_step_output_survives_pickling_for_ipc() -> None:
    sc = SchedulerConnector()
    out = output({"a": (0, ROWS[:3]), "b": (4, ROWS[4:6])}, errors={"c": "ObjectMissingError: gone"})
    assert out.rows_for("a") is not None  # build the span cache before pickling
    back = pickle.loads(pickle.dumps(out))
    got = sc.take_output(back, Req("b", 6, 1))
    assert got is not None and np.array_equal(got, ROWS[4:5])
    got = sc.take_output(back, Req("a", 4, 1))
    assert got is not None and np.array_equal(got, ROWS[:3])
    with pytest.raises(RoutesUnavailableError, match="gone"):
        sc.take_output(back, Req("c", 2, 1))
    silent = StepOutput(["a"], np.array([0]), np.array([-1]), np.array([-1]), ROWS[:1])
    assert pickle.loads(pickle.dumps(silent)).rows_for("a") is None


def test_take_outputs_equals_per_request_calls() -> None:
    """The batched call returns exactly what one call per request returns (rows and extra rows)."""
    from auxout.testing import FakeMoE, SimEngine

    model = FakeMoE(num_layers=2, top_k=2, num_experts=8, vocab_size=50, seed=9)
    eng = SimEngine(model, block_size=4, max_num_batched_tokens=12, num_speculative_tokens=2, async_scheduling=True)
    calls: list[tuple[list, list]] = []
    real_batch = eng.scheduler.take_outputs

    def spy(output, requests, finished=None):  # type: ignore[no-untyped-def]
        batched = real_batch(output, requests, finished)
        one_by_one = [
            SchedulerConnector.take_output(eng.scheduler, output, r, finished=f)
            for r, f in zip(requests, finished or [False] * len(requests))
        ]
        calls.append((batched, one_by_one))
        return batched

    eng.scheduler.take_outputs = spy  # type: ignore[method-assign]
    rng = np.random.default_rng(3)
    base = rng.integers(0, 50, 9).tolist()
    for i in range(5):
        eng.add_request(f"r{i}", base + rng.integers(0, 50, 5).tolist(), 6, prompt_start=int(rng.integers(0, 10)))
    eng.run()
    assert calls and any(len(b) > 1 for b, _ in calls)
    for batched, one in calls:
        assert len(batched) == len(one)
        for a, b in zip(batched, one):
            assert (a is None and b is None) or np.array_equal(a, b)


def store_head(rows: np.ndarray, bs: int) -> StoreRows:
    """``rows`` (padded to whole blocks of ``bs``) written to an ``ArenaStore`` and read back
    uncopied, sliced to ``len(rows)``: a head as the worker hands it over from an in-process store."""
    n_blocks = -(-len(rows) // bs)
    padded = np.concatenate([rows, ROWS[: n_blocks * bs - len(rows)]])
    nbytes = bs * PROF.token_nbytes
    store = ArenaStore(max_bytes=8 * n_blocks * nbytes, object_nbytes=nbytes)
    keys = [f"k{b}" for b in range(n_blocks)]
    store.put([(k, padded[b * bs : (b + 1) * bs].tobytes()) for b, k in enumerate(keys)])
    got = store.read_rows(keys[::-1], PROF.dtype, (bs, *PROF.shape_per_token))  # slots out of key order
    assert got is not None
    whole = StoreRows(got.src, got.slots[::-1].copy())
    return whole[: len(rows)]


@pytest.mark.parametrize("kind", ["array", "store"])
@pytest.mark.parametrize("num_tokens", [3, 5, 6, 9, 10])
def test_a_two_part_output_is_clipped_and_joined_like_one(num_tokens: int, kind: str) -> None:
    """A prefix hit's rows come as a head (an array, or rows left in the store) plus its own rows."""
    head, own = ROWS[:5], ROWS[5:9]
    h = head.copy() if kind == "array" else store_head(head, 2)
    # the span counts as if the own rows followed the head: [4 + 0, 4 + 5 + 4)
    out = StepOutput(["r"], np.array([0]), np.array([4]), np.array([13]), own.copy(), heads={"r": (h, 0)})
    sc = SchedulerConnector()
    r = Req("r", num_tokens=num_tokens, num_output_tokens=1)
    want = ROWS[: min(num_tokens - 1, 9)]
    got = sc.take_output(out, r, finished=num_tokens <= 10)
    assert isinstance(got, np.ndarray) and np.array_equal(got, want)
    parts = SchedulerConnector().take_output_parts(out, r, finished=num_tokens <= 10)
    assert isinstance(parts, list) and len(parts) == (1 if num_tokens - 1 <= 5 else 2)  # clipped inside the head: one
    assert np.array_equal(join_rows(parts), want)
    joined = out.rows_for("r")
    assert joined is not None and joined[0] == 0 and np.array_equal(joined[1], ROWS[:9])
    back = pickle.loads(pickle.dumps(out))  # another process gets plain arrays
    assert all(type(x) is np.ndarray for x in back.heads["r"][:1])
    got = SchedulerConnector().take_output(back, r, finished=num_tokens <= 10)
    assert isinstance(got, np.ndarray) and np.array_equal(got, want)


def test_a_two_part_output_past_its_rows_is_an_error_for_a_finished_request() -> None:
    out = StepOutput(["r"], np.array([0]), np.array([2]), np.array([7]), ROWS[3:5].copy(), heads={"r": (ROWS[:3].copy(), 0)})
    with pytest.raises(InvariantError, match=r"rows cover \[0, 5\)"):
        SchedulerConnector().take_output(out, Req("r", num_tokens=7, num_output_tokens=1), finished=True)


@given(st.integers(0, 6), st.integers(0, 6), st.sampled_from([0, 1, 2, 3]), st.data())
def test_span_rows_of_a_head_and_own_rows_equal_the_joined_rows(n_head: int, n_own: int, bs: int, data) -> None:  # type: ignore[no-untyped-def]
    """Any sub-span of a head (an array, or StoreRows in blocks of ``bs``) and own rows joins to the same rows."""
    head_rows, rows = ROWS[5 : 5 + n_head], ROWS[20 : 24 + n_own]  # own rows at rows[1:]
    head = head_rows.copy() if bs == 0 or n_head == 0 else store_head(head_rows, bs)
    n = len(rows)
    out = StepOutput(["r"], np.array([0]), np.array([n]), np.array([n + n_head + n_own]), rows, heads={"r": (head, 1)})
    joined = np.concatenate([head_rows, rows[1 : 1 + n_own]])
    lo = data.draw(st.integers(0, n_head + n_own))
    hi = data.draw(st.integers(lo, n_head + n_own))
    got = out.span_rows("r", n + lo, n + hi)
    got = join_rows(got) if isinstance(got, list) else got
    assert got.shape == joined[lo:hi].shape and np.array_equal(got, joined[lo:hi])


@given(
    n=st.integers(1, 5),
    data=st.data(),
)
def test_take_step_equals_take_outputs_or_declines(n: int, data) -> None:  # type: ignore[no-untyped-def]
    """A decode step taken whole gives each request the row, and moves the delivered cursor,
    exactly as ``take_outputs``; any step it cannot take whole it declines and changes nothing."""
    whole, each = SchedulerConnector(), SchedulerConnector()
    ids = [f"r{i}" for i in range(n)]
    starts = [data.draw(st.integers(0, 30), label=f"start{i}") for i in range(n)]
    # accepted rows per request: 1 is the decode step; others are what a stale or unsampled chunk sees
    accepted = [data.draw(st.sampled_from([1, 1, 1, 0, -1, 2]), label=f"accepted{i}") for i in range(n)]
    opted = [data.draw(st.sampled_from([True, True, True, False]), label=f"opt{i}") for i in range(n)]
    for sc in (whole, each):
        for rid, ok in zip(ids, opted):
            sc.add_request(rid, 1, return_routes=ok)
    out = output({rid: (t, ROWS[t : t + 1]) for rid, t in zip(ids, starts)})
    if data.draw(st.booleans(), label="worker lane lists the starts"):
        out.one_row_starts = list(starts)  # (what the lane sets for one row each at rows[i])
    requests = [Req(rid, t + 1 + a) for rid, t, a in zip(ids, starts, accepted)]
    order = data.draw(st.permutations(range(n)), label="order")  # engines loop in their own order
    requests = [requests[i] for i in order]
    if data.draw(st.booleans(), label="drop one") and n > 1:
        requests = requests[1:]
    given_tokens = [r.num_tokens for r in requests] if data.draw(st.booleans(), label="engine passes num_tokens") else None
    rows = whole.take_step(out, requests, given_tokens)
    want = each.take_outputs(out, requests)
    if rows is None:
        assert len(requests) < n or not all(opted) or accepted != [1] * n
        assert whole._delivered == {}
        return
    assert len(requests) == n and all(opted) and accepted == [1] * n
    by_id = {r.request_id: w for r, w in zip(requests, want)}
    for i, rid in enumerate(out.req_ids):
        assert np.array_equal(rows[i : i + 1], by_id[rid])
    assert whole._delivered == each._delivered


def test_take_step_rechecks_options_when_a_request_comes_back() -> None:
    """The batch check is cached, but a request id re-added (here: opting out) is checked again."""
    sc = SchedulerConnector()
    sc.add_request("a", 1)
    sc.add_request("b", 1)
    requests = [Req("a", 12), Req("b", 7)]
    assert sc.take_step(output({"a": (10, ROWS[:1]), "b": (5, ROWS[1:2])}), requests) is not None
    requests[0].num_tokens, requests[1].num_tokens = 13, 8  # (the same request objects, a step later)
    assert sc.take_step(output({"a": (11, ROWS[:1]), "b": (6, ROWS[1:2])}), requests) is not None
    sc.add_request("b", 1, return_routes=False)  # (the same request objects: only the options changed)
    requests[0].num_tokens, requests[1].num_tokens = 14, 9
    assert sc.take_step(output({"a": (12, ROWS[:1]), "b": (7, ROWS[1:2])}), requests) is None
    two = output({"a": (12, ROWS[:2])})  # two rows for one request: not a decode step
    assert sc.take_step(two, [Req("a", 14)]) is None


@given(data=st.data())
def test_steady_metadata_equals_the_full_build(data) -> None:  # type: ignore[no-untyped-def]
    """build_metadata's shortcut for a repeated all-decode batch gives exactly what the full
    per-request build gives, through new hashes, opt-outs, finishes, preemptions and new requests."""
    fast, slow = SchedulerConnector(), SchedulerConnector()
    live: dict[str, Req] = {}
    order: list[str] = []
    next_id = 0
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        op = data.draw(st.sampled_from(["step", "step", "step", "step", "add", "finish"]), label="op")
        if op == "add" or not live:
            rid = f"r{next_id}"
            next_id += 1
            prompt = data.draw(st.integers(1, 12), label="prompt")
            start = data.draw(st.integers(0, prompt), label="prompt_start")
            ret = data.draw(st.sampled_from([True, True, True, False]), label="returns")
            for sc in (fast, slow):
                sc.add_request(rid, prompt, prompt_start=start, return_routes=ret)
            live[rid] = Req(rid, prompt)
            order.append(rid)
        elif op == "finish":
            rid = data.draw(st.sampled_from(order), label="finished")
            preempted = data.draw(st.booleans(), label="preempted")
            for sc in (fast, slow):
                sc.request_finished(live[rid], preempted=preempted)
            if not preempted:
                del live[rid]
                order.remove(rid)
        else:
            scheduled = list(order) if data.draw(st.booleans(), label="same batch") else data.draw(
                st.lists(st.sampled_from(order), unique=True, min_size=1), label="batch"
            )
            for rid in scheduled:
                if data.draw(st.integers(0, 5), label="new hash") == 0:
                    live[rid].block_hashes.append(h(data.draw(st.integers(0, 10**6), label="hash")))
            slow._meta_cache = None  # (the full build every time)
            a, b = fast.build_metadata(scheduled, live), slow.build_metadata(scheduled, live)
            assert a.requests == b.requests and a.finished == b.finished
            assert {r: bytes(p.data) for r, p in a.block_hashes.items()} == {r: bytes(p.data) for r, p in b.block_hashes.items()}
            assert {r: bytes(p.data) for r, p in a.final_hashes.items()} == {r: bytes(p.data) for r, p in b.final_hashes.items()}
            # each scheduled request emits one row from its emit start and accepts it
            emitting = {r: s for r, s in a.requests.items() if s != NO_EMIT}
            out = output({r: (s, ROWS[s % len(ROWS) : s % len(ROWS) + 1]) for r, s in emitting.items()})
            for rid, s in emitting.items():
                live[rid].num_tokens = max(live[rid].num_tokens, s + 2)
                live[rid].num_output_tokens += 1
            for sc in (fast, slow):
                sc.take_outputs(out, [live[r] for r in emitting])
            assert fast._delivered == slow._delivered


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), max_size=12))
def test_recomputed_positions_are_counted_once(spans):
    """An engine asks for the same hit again while a request waits for KV blocks, and clips its
    local and connector hits separately: each recomputed position counts once, per request and
    in the engine's total, so a request never reports more recomputed tokens than it has."""
    conn = SchedulerConnector()
    covered: set[int] = set()
    for lo, hi in spans:
        covered.update(range(lo, hi))
        assert conn.count_recompute("r", lo, hi) == len(covered)
        conn.count_recompute("other", lo, lo + 1)
    assert conn.count_recompute("r", 0, 0) == len(covered) <= 200
    others = len({lo for lo, hi in spans})
    assert conn.recomputed_tokens == len(covered) + others
    conn.request_finished(Req("r", 4), preempted=False)  # a finished request's spans go
    assert conn.count_recompute("r", 0, 0) == 0
