"""Route sessions: resume where the client's rows end or the history differs; bounded, LRU."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from auxout.vllm.server.sessions import SessionStore, common_prefix_len


@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.integers(0, 5), max_size=30))
def test_common_prefix_len_matches_a_loop(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_len(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)) == n


def test_start_is_rows_delivered_when_the_prompt_extends_the_history() -> None:
    s = SessionStore()
    assert s.start_for("a", [1, 2, 3]) == 0  # unknown session (new, expired, server restarted): all rows
    s.delivered("a", [1, 2, 3, 4, 5])  # rows of positions 0..3 delivered (5 has no row yet)
    assert s.start_for("a", [1, 2, 3, 4, 5, 6, 7]) == 4
    assert s.start_for("a", [1, 2, 9, 4, 5, 6]) == 2  # edited history: from the first difference
    assert s.start_for("a", [7, 7]) == 0  # another conversation under the same id
    assert s.start_for("a", [1, 2]) == 2  # a shorter prompt: never past its own length


def test_sessions_are_bounded_lru_in_count_and_tokens() -> None:
    s = SessionStore(max_sessions=2, max_tokens=10)
    s.delivered("a", [1, 2, 3])
    s.delivered("b", [1, 2, 3])
    s.start_for("a", [1, 2, 3])  # touch a: b is now least recently used
    s.delivered("c", [1, 2, 3])
    assert len(s) == 2 and s.start_for("b", [1, 2, 3, 4]) == 0 and s.start_for("a", [1, 2, 3, 4]) == 2
    s.delivered("d", list(range(9)))  # 9 + 3 > 10 tokens: the oldest goes
    assert s.total_tokens <= 10
    s.delivered("e", list(range(11)))  # larger than the whole budget: not kept, next turn starts at 0
    assert s.start_for("e", list(range(12))) == 0
    with pytest.raises(ValueError):
        SessionStore(max_sessions=0)


def test_weights_lag_the_ids_after_a_turn_without_them() -> None:
    """Turns with weights, without, with: the third turn's weights start where the client's end."""
    s = SessionStore()
    w = ("routing_weights",)
    s.delivered("a", list(range(10)), start=0, arrays=w)  # ids and weights of rows 0..8
    assert s.starts_for("a", list(range(14)), w) == {"routed_experts": 9, "routing_weights": 9}
    s.delivered("a", list(range(16)), start=9)  # ids only: rows 9..14
    assert s.starts_for("a", list(range(20)), w) == {"routed_experts": 15, "routing_weights": 9}
    assert s.starts_for("a", [0, 1, 2, 7], w) == {"routed_experts": 3, "routing_weights": 3}  # an edit first
    s.delivered("a", [0, 1, 2, 7, 8], start=3)  # an edited turn without weights: the client cuts them at 3
    assert s.starts_for("a", [0, 1, 2, 7, 8, 9], w) == {"routed_experts": 4, "routing_weights": 3}


def test_a_turn_under_other_weights_starts_at_zero() -> None:
    """Rows computed with other weights are not the client's: every array from row 0; turns with the
    weights the session was recorded with go on with deltas."""
    s = SessionStore()
    w = ("routing_weights",)
    s.delivered("a", list(range(10)), arrays=w, weights_version="v1")
    assert s.starts_for("a", list(range(14)), w, weights_version="v1") == {"routed_experts": 9, "routing_weights": 9}
    assert s.starts_for("a", list(range(14)), w, weights_version="v2") == {"routed_experts": 0, "routing_weights": 0}
    assert s.begin("a", list(range(14)), turn="t", weights_version="v2") == {"routed_experts": 0}
    s.delivered("a", list(range(16)), start=0, turn="t", weights_version="v2")
    assert s.start_for("a", list(range(20)), weights_version="v2") == 15
    assert s.start_for("a", list(range(20)), weights_version="v1") == 0


# -- the client's stitching rule, over random conversations -------------------------------------
L, K, E = 2, 3, 64


def _truth(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Stand-in for a full forward: row i depends on tokens[: i + 1] only (a causal model)."""
    n = max(len(tokens) - 1, 0)
    ids = np.zeros((n, L, K), np.uint8)
    weights = np.zeros((n, L, K), np.float32)
    h = 0
    for i in range(n):
        h = (h * 1000003 + tokens[i] + 1) % (1 << 61)
        rng = np.random.default_rng(h)
        ids[i] = np.stack([rng.permutation(E)[:K] for _ in range(L)])
        weights[i] = rng.random((L, K), dtype=np.float32)
    return ids, weights


@st.composite
def conversations(draw: st.DrawFn) -> list[tuple[str, list[int], bool, str, list[int]]]:
    """Turns: (how the prompt is made, new tokens, weights asked, format or 'stream', output)."""
    turns = []
    for _ in range(draw(st.integers(1, 7))):
        how = draw(st.sampled_from(["extend", "extend", "extend", "rewrite", "other", "repeat"]))
        new = draw(st.lists(st.integers(0, 9), min_size=1, max_size=6))
        weights = draw(st.booleans())
        fmt = draw(st.sampled_from(["npy", "sglang", "packed", "stream"]))
        out = draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
        turns.append((how, new, weights, fmt, out))
    return turns


@given(conversations(), st.randoms(use_true_random=False))
def test_stitched_session_arrays_equal_a_full_forward(turns, rnd) -> None:  # type: ignore[no-untyped-def]
    """The server side of a session (``SessionStore``, the responder's per-array fields) and the
    client's rule from the README: per array, keep ``[0, its start)`` and append; a response
    without weights cuts them at ``routed_experts_start``. The ids and weights the client holds
    always equal the full forward's over the conversation so far, whatever the turns' weights,
    formats, streaming or rewritten histories."""
    from auxout.vllm.options import VllmOptions
    from auxout.vllm.server.responses import RouteResponder
    from auxout.wire import decode_routes

    responder = RouteResponder(VllmOptions(routing_weights=True))
    responder.num_experts = E
    store = responder.sessions
    history: list[int] = []
    ids = np.zeros((0, L, K), np.uint8)
    weights = np.zeros((0, L, K), np.float32)
    for how, new, want_w, fmt, out in turns:
        if how == "extend":
            prompt = history + new
        elif how == "rewrite":  # re-tokenized or edited history: differs from some position on
            cut = rnd.randint(0, len(history))
            prompt = history[:cut] + [t + 10 for t in new]
        elif how == "other":
            prompt = [t + 20 for t in new]
        else:
            prompt = history[:] or new
        arrays = ("routing_weights",) if want_w else ()
        starts = store.starts_for("s", prompt, arrays)  # (RouteResponder.generate)
        engine_start = min(starts.values())
        tokens = prompt + out
        true_ids, true_w = _truth(tokens)
        rows_ids, rows_w = true_ids[engine_start:], true_w[engine_start:]
        rows = np.empty(rows_ids.shape, [("id", "u1"), ("w", "<f4")]) if want_w else rows_ids
        if want_w:
            rows["id"], rows["w"] = rows_ids, rows_w
        # the response: one choice, or stream chunks that concatenate per array
        cuts = sorted(rnd.sample(range(len(rows) + 1), min(3, len(rows) + 1))) if fmt == "stream" else [0]
        bounds = [0, *[c for c in cuts if c > 0], len(rows)]
        got: dict[str, list[np.ndarray]] = {"routed_experts": [], "routing_weights": []}
        first: dict[str, int] = {}
        for lo, hi in zip(bounds, bounds[1:] if len(bounds) > 1 else [len(rows)]):
            fields = responder.route_fields(rows[lo:hi], engine_start + lo, "npy" if fmt == "stream" else fmt,
                                            ids_start=starts["routed_experts"])  # fmt: skip
            for name, start_field in (("routed_experts", "routed_experts_start"), ("routing_weights", "routing_weights_start")):
                part = decode_routes(fields, name)
                if part is None:
                    continue
                if name in first:  # streamed parts are contiguous
                    assert fields[start_field] == first[name] + sum(len(p) for p in got[name])
                else:
                    first[name] = fields[start_field]
                got[name].append(part)
        # the client's rule
        start = first["routed_experts"]
        assert start <= len(ids)
        ids = np.concatenate([ids[:start], *got["routed_experts"]])
        weights = weights[: min(len(weights), start)]
        if want_w:
            w_start = first["routing_weights"]
            assert w_start <= start and w_start == len(weights), (w_start, start, len(weights))
            weights = np.concatenate([weights[:w_start], *got["routing_weights"]])
            assert len(weights) == len(ids)
        else:
            assert not got["routing_weights"]
        store.delivered("s", tokens, start=starts["routed_experts"], arrays=arrays)
        history = tokens
        np.testing.assert_array_equal(ids, true_ids)
        np.testing.assert_array_equal(weights, true_w[: len(weights)])
