"""Helpers shared by the vLLM tests: engines with auxout, and the transformers full-forward oracle."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

ENGINE_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "float32",
    "enforce_eager": True,
    "block_size": 32,  # the CPU attention backend needs multiples of 32
    "seed": 0,
    "disable_log_stats": False,
}
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def make_llm(path: str, auxout: dict[str, Any] | None = None, **kw: Any) -> Any:
    """An ``LLM`` with auxout (``auxout``: its options, e.g. ``{"routing_weights": True}``)."""
    from vllm import LLM

    from auxout.vllm import engine_kwargs

    return LLM(model=path, **{**ENGINE_ARGS, **engine_kwargs(**(auxout or {})), **kw})


def greedy(max_tokens: int, **kw: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, **kw)


def random_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 1000, size=n).tolist()


def metric(llm: Any, name: str) -> float:
    """Sum of one counter across labels (0 if absent)."""
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name:
            total += float(getattr(m, "value", 0) or 0)
    return total


class Oracle:
    """transformers fp32 full forward of the same checkpoint: the routes every engine output must equal."""

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def routes(self, tokens: Sequence[int]) -> np.ndarray:
        try:
            from auxout.trainer.hf import capture_routes
        except ImportError:  # pragma: no cover - before auxout.trainer.hf existed
            capture_routes = _hook_routes
        return capture_routes(self.model, list(tokens))

    def routes_and_weights(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, weights)`` ``[S, L, K]`` as transformers' routers return them (fp32 combine weights)."""
        import torch

        routers = [m for m in self.model.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]
        outs: list[tuple[torch.Tensor, torch.Tensor]] = []
        hooks = [
            r.register_forward_hook(lambda mod, a, out: outs.append((out[2].detach().clone(), out[1].detach().clone())))
            for r in routers
        ]
        try:
            with torch.no_grad():
                self.model(input_ids=torch.tensor([list(tokens)]), use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        ids = torch.stack([i for i, _ in outs], dim=1).numpy()
        weights = torch.stack([w for _, w in outs], dim=1).float().numpy()
        return ids, weights

    def check_weights(self, prompt: Sequence[int], completion: Any, prompt_start: int = 0) -> np.ndarray:
        """Assert the completion's routing weights equal transformers' (fp32, per expert id); return them."""
        tokens = list(prompt) + list(completion.token_ids)
        ids, weights = completion.routed_experts, getattr(completion, "routing_weights", None)
        assert weights is not None, "routing weights missing"
        assert weights.dtype == np.float32 and weights.shape == ids.shape
        exp_ids, exp_w = self.routes_and_weights(tokens)
        exp_ids, exp_w = exp_ids[prompt_start : len(tokens) - 1], exp_w[prompt_start : len(tokens) - 1]
        # slot order is a kernel detail: compare (id, weight) pairs sorted by id
        order, exp_order = np.argsort(ids, axis=-1), np.argsort(exp_ids, axis=-1)
        got_ids, want_ids = np.take_along_axis(ids, order, -1), np.take_along_axis(exp_ids, exp_order, -1)
        assert np.array_equal(got_ids, want_ids.astype(got_ids.dtype)), "expert ids differ from transformers'"
        got_w, want_w = np.take_along_axis(weights, order, -1), np.take_along_axis(exp_w, exp_order, -1)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)
        return weights

    def check(self, prompt: Sequence[int], completion: Any, prompt_start: int = 0) -> np.ndarray:
        """Assert the completion's routes equal the oracle's on prompt+output; return them."""
        tokens = list(prompt) + list(completion.token_ids)
        got = completion.routed_experts
        assert got is not None, "routes missing"
        expected = self.check_rows(tokens, got, prompt_start)
        assert got.shape == (len(tokens) - 1 - prompt_start, *expected.shape[1:])
        assert got.dtype == expected.dtype
        return got

    def check_rows(self, tokens: Sequence[int], rows: np.ndarray, start: int = 0, what: str = "") -> np.ndarray:
        """Assert ``rows`` are the oracle's routes of ``tokens`` from position ``start`` (the last
        token has none); return the oracle's. Top-k order inside a row is a kernel detail (vLLM's CPU
        top-k and transformers' differ): the expert set per (token, layer) must match exactly."""
        expected = self.routes(tokens)[start : len(tokens) - 1]
        at = f"{what}: " if what else ""
        assert rows.shape == expected.shape, f"{at}routes {rows.shape}, expected {expected.shape}"
        bad = np.argwhere(~(np.sort(rows, axis=-1) == np.sort(expected, axis=-1)).all(axis=-1))
        assert bad.size == 0, f"{at}{len(bad)} (token, layer) route mismatches, first at {bad[:5].tolist()}"
        return expected


def _hook_routes(model: Any, tokens: list[int]) -> np.ndarray:  # pragma: no cover
    import torch

    routers = [m for m in model.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]
    ids: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda mod, a, out: ids.append(out[2].detach().clone())) for r in routers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(ids, dim=1).numpy().astype(np.uint8)


def close_llm(llm: Any) -> None:
    """Stop the engine-core process now (module teardown), not whenever the LLM is collected."""
    import gc

    from auxout.vllm.caller.engine import stop_engine

    stop_engine(llm)
    gc.collect()


def negate_embeddings(worker: Any) -> int:
    """Run in each engine's worker (``llm.collective_rpc``, which needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``): an in-place weight update that reroutes every token
    (the token embeddings negated: each router's logits flip; applied twice it restores the
    weights exactly). vLLM-CPU computes its linear layers, the routers' gates included, from
    packed copies made at load time, so the embedding, which it reads as is, is the weight an
    in-place update reaches."""
    n = 0
    for name, p in worker.model_runner.get_model().named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.data.neg_()
            n += 1
    return n


def negate_oracle_embeddings(oracle: Oracle) -> None:
    """The same update on the oracle's model (twice restores it)."""
    for name, p in oracle.model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.data.neg_()
