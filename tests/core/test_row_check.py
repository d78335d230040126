"""RowCheck flags exactly the impossible token rows: an id out of range, an expert twice in one
(token, layer) row (an all-zero row wherever top_k >= 2); never a row a router can produce."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from auxout.connector.row_check import RowCheck
from auxout.profile import RouteProfile

EXPERTS = [1, 2, 3, 8, 16, 60, 64, 127, 128, 129, 200, 255, 256, 257, 384, 65536]


def oracle(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """One token row at a time, in plain Python."""
    return np.array(
        [any(max(r) >= num_experts or len(set(r)) < len(r) for r in tok) for tok in ids.tolist()], dtype=bool
    )


@st.composite
def steps(draw: st.DrawFn) -> tuple[RouteProfile, np.ndarray, np.ndarray]:
    num_experts = draw(st.sampled_from(EXPERTS))
    top_k = draw(st.sampled_from(sorted({1, 2, 4, 6, 8, min(8, num_experts)} & set(range(1, num_experts + 1)))))
    profile = RouteProfile(draw(st.integers(1, 5)), top_k, num_experts, weights=draw(st.booleans()))
    n = draw(st.integers(0, 40))  # (with up to 5 layers: steps shorter and longer than one vector)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(n * profile.num_layers)]) if n else None
    ids = (np.zeros((0, profile.num_layers, top_k)) if ids is None else ids.reshape(n, profile.num_layers, top_k))
    ids = ids.astype(profile.id_dtype)
    top = int(np.iinfo(profile.id_dtype).max)
    for _ in range(draw(st.integers(0, 4)) if n else 0):  # faults a broken kernel path leaves
        t, layer = int(rng.integers(n)), int(rng.integers(profile.num_layers))
        kind = draw(st.sampled_from(["zeros", "repeat", "range"]))
        if kind == "zeros":
            ids[t, layer] = 0
        elif kind == "repeat" and top_k >= 2:
            a, b = rng.choice(top_k, 2, replace=False)
            ids[t, layer, a] = ids[t, layer, b]
        elif kind == "range" and num_experts <= top:
            ids[t, layer, int(rng.integers(top_k))] = int(rng.integers(num_experts, top + 1))
    rows = profile.empty(n)
    if profile.weights:
        rows["id"], rows["w"] = ids, rng.random(ids.shape, dtype=np.float32)
    else:
        rows[:] = ids
    return profile, rows, oracle(ids, num_experts)


@pytest.mark.parametrize("use_numba", [True, False])
@given(steps())
def test_flags_exactly_the_impossible_rows(use_numba: bool, case) -> None:  # type: ignore[no-untyped-def]
    profile, rows, expected = case
    check = RowCheck(profile)
    if not use_numba:  # the numpy path gives the same answers
        check._scan = None
    got = check(rows)
    if not expected.any():
        assert got is None
        return
    assert got is not None
    np.testing.assert_array_equal(got, expected)
    assert check.bad_rows == int(expected.sum())
    for i in np.flatnonzero(expected).tolist():
        why = check.reason(rows, i)
        assert "MoE layer" in why and ("experts" in why or "zeros" in why or "repeated" in why), why


def test_the_word_kernel_at_every_expert_count() -> None:
    """Top-8 one-byte ids (one 64-bit word per row): ids near every range edge, each slot repeated."""
    rng = np.random.default_rng(0)
    for num_experts in range(8, 257):
        check = RowCheck(RouteProfile(2, 8, num_experts))
        top = np.arange(num_experts - 8, num_experts, dtype=np.uint8)  # the largest valid ids
        rows = np.stack([np.stack([rng.permutation(top), rng.permutation(num_experts)[:8]])] * 3).astype(np.uint8)
        assert check(rows) is None, num_experts
        for a in range(8):
            for d in range(1, 8):  # every pair of slots
                bad = rows.copy()
                bad[1, 0, a] = bad[1, 0, (a + d) % 8]
                if num_experts < 256:
                    bad[2, 1, a] = num_experts + (d - 1) * (255 - num_experts) // 6
                mask = check(bad)
                assert mask is not None and mask.tolist() == [False, True, num_experts < 256], (num_experts, a, d)


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("num_experts", [40, 300])  # one-byte and two-byte ids
@pytest.mark.parametrize("top_k", [2, 3, 6, 8, 16])  # (32- and 16-byte vectors, lanes left over, none)
def test_every_pair_of_slots_and_the_range_edge_at_every_row(top_k: int, num_experts: int, weights: bool) -> None:
    """Each row of a step spanning several vectors and leftover rows: a repeat of each pair of
    slots, and the smallest id out of range in each slot, flag that token alone; the largest
    valid ids pass."""
    profile = RouteProfile(3, top_k, num_experts, weights=weights)
    check = RowCheck(profile)
    rng = np.random.default_rng(top_k)
    n = 6 if top_k > 8 else 11
    ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(n * 3)]).astype(profile.id_dtype)
    ids = ids.reshape(n, 3, top_k)
    ids[n // 2, 1] = np.arange(num_experts - top_k, num_experts)[::-1]  # the largest valid ids

    def rows_of(x: np.ndarray) -> np.ndarray:
        rows = profile.empty(n)
        if weights:
            rows["id"], rows["w"] = x, rng.random(x.shape, dtype=np.float32)
        else:
            rows[:] = x
        return rows

    rows = rows_of(ids)
    assert check(rows) is None
    # the one-pass scan itself passes them (a step it flags is looked at again, row by row)
    scanned = rows.reshape(-1).view(profile.id_dtype) if weights else rows
    assert check._scan is None or not check._scan(scanned, num_experts)
    for t in range(n):
        for layer in range(3):
            for a in range(top_k):
                bad = ids.copy()
                bad[t, layer, a] = num_experts
                cases = [bad]
                for b in range(a + 1, top_k):
                    bad = ids.copy()
                    bad[t, layer, b] = bad[t, layer, a]
                    cases.append(bad)
                for bad in cases:
                    mask = check(rows_of(bad))
                    assert mask is not None and np.flatnonzero(mask).tolist() == [t], (t, layer, a)


# -- in the data plane: a request with impossible rows is never stored nor returned ---------------
from auxout.testing import FakeMoE, SimEngine  # noqa: E402


def oracle_routes(model: FakeMoE, res) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The full forward of the router without glitches."""
    return FakeMoE.routes(model, res.tokens[: len(res.tokens) - 1], 0)[res.prompt_start :]


class GlitchyMoE(FakeMoE):
    """A fake router whose capture goes wrong on chosen forward calls (a kernel path that skipped
    selection): one layer of one row comes back all zeros, with a repeated expert, or out of range.
    ``always``: prompts starting with this token get impossible rows on every forward."""

    def __init__(self, glitches: dict[int, str], always: int | None = None, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kw)
        self.glitches, self.always, self.calls = glitches, always, 0
        self.glitched = 0

    def routes(self, token_ids, start=0):  # type: ignore[no-untyped-def]
        rows = super().routes(token_ids, start).copy()
        kind = self.glitches.get(self.calls)
        self.calls += 1
        if self.always is not None and len(token_ids) and token_ids[0] == self.always and len(rows):
            kind = "zeros"
        if kind is None or not len(rows):
            return rows
        ids = rows["id"] if self.profile.weights else rows
        t, layer = len(rows) // 2, self.calls % self.num_layers
        if kind == "zeros":
            ids[t, layer] = 0
        elif kind == "repeat":
            ids[t, layer, 1] = ids[t, layer, 0]
        else:
            ids[t, layer, 0] = self.num_experts + 3
        self.glitched += 1
        return rows


@given(
    st.dictionaries(st.integers(0, 60), st.sampled_from(["zeros", "repeat", "range"]), max_size=6),
    st.booleans(), st.booleans(), st.integers(0, 2**16),
)
def test_glitched_rows_are_recomputed_never_stored_or_returned(glitches, async_scheduling, weights, seed) -> None:  # type: ignore[no-untyped-def]
    """Requests sharing prefixes, some forwards glitched: every route returned equals the full
    forward (a glitched row was neither returned nor stored for a later prefix hit to read: the
    request recomputed), and the connector counted each request refused."""
    model = GlitchyMoE(glitches, num_layers=3, top_k=4, num_experts=16, weights=weights, seed=seed % 7)
    eng = SimEngine(model, block_size=8, max_num_batched_tokens=48, max_num_seqs=4, num_kv_blocks=128,
                    async_scheduling=async_scheduling, seed=seed)  # fmt: skip
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 900, 40).tolist()
    for i in range(6):  # later requests hit the earlier ones' prefix (and so their stored routes)
        prompt = shared[: 8 * int(rng.integers(1, 5))] + rng.integers(1, 900, int(rng.integers(1, 12))).tolist()
        eng.add_request(f"r{i}", prompt, max_tokens=int(rng.integers(1, 10)))
    results = eng.run()
    assert len(results) == 6
    for res in results.values():
        assert res.error is None, res.error
        want = oracle_routes(model, res)
        got = res.routed_experts
        assert got is not None and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), res.request_id
    assert (eng.worker.impossible_requests > 0) == (model.glitched > 0)


def test_a_request_whose_rows_stay_impossible_fails_alone() -> None:
    model = GlitchyMoE({}, always=999, num_layers=3, top_k=4, num_experts=16, vocab_size=1000)
    eng = SimEngine(model, block_size=8, max_num_batched_tokens=64, max_num_seqs=4)
    eng.add_request("bad", [999, *range(1, 30)], max_tokens=4)
    eng.add_request("good", list(range(1, 30)), max_tokens=4)
    results = eng.run()
    bad, good = results["bad"], results["good"]
    assert bad.finish_reason == "error" and bad.routed_experts is None
    assert bad.error is not None and "impossible routes at capture" in bad.error and "all zeros" in bad.error
    assert good.error is None and good.routed_experts is not None
    assert good.routed_experts.tobytes() == oracle_routes(model, good).tobytes()
    assert eng.worker.impossible_requests >= 1
