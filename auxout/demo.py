"""``make demo``: a multi-turn rollout on vLLM with routes, every route checked against transformers.

Each conversation's turn k prompt is turn k-1's prompt + its output + new "user" tokens, so from
turn 2 on most of the prompt is a prefix-cache hit whose routes come from auxout's store. Each
turn asks only for the routes it has not returned yet (``routed_experts_prompt_start``); the
stitched routes of a conversation must equal one transformers fp32 full forward over the whole
conversation, bit for bit. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Conversation:
    tokens: list[int]
    routes: list[np.ndarray] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    num_generated: int = 0


@dataclass
class RolloutStats:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="auxout demo", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen3_moe", help="tiny MoE architecture (qwen3_moe, mixtral, olmoe, qwen2_moe)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=int, default=40, help="new tokens added to the prompt each turn")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens generated per turn")
    p.add_argument("--out", default="out", help="directory for routes (.npz per conversation + manifest.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the routes-off throughput run")
    return p.parse_args(list(argv))


def _engine(path: str, routes: bool) -> Any:
    from vllm import LLM

    from auxout.vllm import engine_kwargs

    extra = engine_kwargs() if routes else {"enable_prefix_caching": True}
    return LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=2048,
        seed=0,
        **extra,
    )


def _warm_up(llm: Any) -> None:
    """One short request first, so lazy engine initialization is not timed."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [7] * 40}], params, use_tqdm=False)


def _shutdown(llm: Any) -> None:
    from auxout.vllm.caller.engine import stop_engine

    stop_engine(llm)
    del llm
    gc.collect()


def rollout(llm: Any, args: argparse.Namespace, routes: bool, progress: Any = None) -> tuple[list[Conversation], RolloutStats]:
    """Run all conversations turn by turn (one batch per turn); same token stream for any engine."""
    from vllm import SamplingParams

    rng = np.random.default_rng(args.seed)
    convs = [Conversation(rng.integers(3, 1000, size=args.user_tokens).tolist()) for _ in range(args.conversations)]
    stats = RolloutStats()
    for turn in range(args.turns):
        if turn:
            for c in convs:
                c.tokens += rng.integers(3, 1000, size=args.user_tokens).tolist()
        params = []
        for c in convs:
            start = sum(len(r) for r in c.routes)  # rows already returned: only new ones
            params.append(
                SamplingParams(
                    max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                    routed_experts_prompt_start=start,
                )  # fmt: skip
            )
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(c.tokens)} for c in convs], params, use_tqdm=False)
        stats.seconds += time.perf_counter() - t0
        for c, o in zip(convs, outs, strict=True):
            comp = o.outputs[0]
            stats.requests += 1
            stats.prompt_tokens += len(c.tokens)
            stats.generated_tokens += len(comp.token_ids)
            stats.cached_tokens += o.num_cached_tokens or 0
            if routes:
                c.turn_starts.append(sum(len(r) for r in c.routes))
                c.routes.append(comp.routed_experts)
            c.tokens += list(comp.token_ids)
            c.num_generated += len(comp.token_ids)
        if progress is not None:
            progress.update(1)
    return convs, stats


def verify(path: str, convs: list[Conversation]) -> tuple[int, int]:
    """(mismatched (token, layer) pairs, checked pairs) of stitched routes vs one full forward each."""
    import torch
    from transformers import AutoModelForCausalLM

    from auxout.trainer.hf import capture_routes

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bad = total = 0
    for c in convs:
        expected = capture_routes(model, c.tokens)[: len(c.tokens) - 1]
        if any(r is None for r in c.routes):
            bad += expected.shape[0] * expected.shape[1]
            total += expected.shape[0] * expected.shape[1]
            continue
        got = np.concatenate(c.routes)
        if got.shape != expected.shape:
            bad += expected.shape[0] * expected.shape[1]
        else:  # top-k order inside a row is a kernel detail; the expert sets must be equal
            bad += int((np.sort(got, -1) != np.sort(expected, -1)).any(-1).sum())
        total += expected.shape[0] * expected.shape[1]
    return bad, total


def write_routes(out: Path, convs: list[Conversation], meta: dict[str, Any]) -> int:
    """One ``conv-XXX.npz`` (tokens, routes, turn_starts) per conversation and ``manifest.json``."""
    out.mkdir(parents=True, exist_ok=True)
    files = []
    nbytes = 0
    for i, c in enumerate(convs):
        routes = np.concatenate(c.routes)
        nbytes += routes.nbytes
        name = f"conv-{i:03d}.npz"
        np.savez(out / name, tokens=np.asarray(c.tokens, dtype=np.int32), routes=routes,
                 turn_starts=np.asarray(c.turn_starts, dtype=np.int64))  # fmt: skip
        files.append({"file": name, "tokens": len(c.tokens), "routes_shape": list(routes.shape),
                      "dtype": str(routes.dtype), "turn_starts": c.turn_starts})  # fmt: skip
    manifest = {**meta, "route_rows": "routes[i] = experts of tokens[i] (as input); len = len(tokens) - 1",
                "conversations": files}  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return nbytes


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    from tqdm import tqdm

    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from auxout.testing.models import build_tiny_moe

    path = build_tiny_moe(args.arch, seed=args.seed)
    steps = args.turns * (1 if args.no_baseline else 2)
    with tqdm(total=steps, desc="rollout turns (routes on, then off)", unit="turn") as bar:
        llm = _engine(path, routes=True)
        _warm_up(llm)
        convs, on = rollout(llm, args, routes=True, progress=bar)
        _shutdown(llm)
        off = None
        if not args.no_baseline:
            llm = _engine(path, routes=False)
            _warm_up(llm)
            base, off = rollout(llm, args, routes=False, progress=bar)
            _shutdown(llm)
            if [c.tokens for c in base] != [c.tokens for c in convs]:
                print("warning: the routes-off run generated different tokens")
    bad, total = verify(path, convs)
    nbytes = write_routes(Path(args.out), convs, {"arch": args.arch, "model": path, "seed": args.seed})
    tok_s = (on.prompt_tokens - on.cached_tokens + on.generated_tokens) / on.seconds
    print(f"requests            {on.requests} ({args.conversations} conversations x {args.turns} turns)")
    print(f"tokens              {on.prompt_tokens} prompt, {on.generated_tokens} generated")
    print(f"cached tokens       {on.cached_tokens} reused from the prefix cache (routes served from the store)")
    print(f"route bytes         {nbytes} written to {args.out}/ ({len(convs)} .npz + manifest.json)")
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(path).decode(convs[0].tokens[-args.max_tokens :])
    print(f"last turn's text    {text[:100]!r} (conversation 0; random weights, so gibberish)")
    print(f"mismatches          {bad} of {total} (token, layer) routes vs transformers full forward")
    print(f"throughput on       {on.generated_tokens / on.seconds:.1f} generated tok/s ({tok_s:.1f} computed tok/s)")
    if off is not None:
        print(f"throughput off      {off.generated_tokens / off.seconds:.1f} generated tok/s")
        print(f"ratio on/off        {off.seconds / on.seconds:.3f} (one short run; benchmarks/toggle_overhead.py measures it)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
