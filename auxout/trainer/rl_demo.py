"""``make rl`` / ``auxout rl``: GRPO with routing replay on a toy pattern-completion task, several seeds.

Each prompt is a repeating pattern of 2-3 words (``" ka to ri ka to ri ka"``); the exact reward is the
fraction of the next words the completion continues correctly, compared token by token. TRL's
``GRPOTrainer`` (:class:`auxout.trainer.trl.R3GRPOTrainer`) samples with its colocated vLLM engine in
bfloat16 and trains in float32, replaying the rollout's routes; after every step auxout's
``update_weights`` loads the new weights into the engine. Every step logs the rollout->train k3 KL
of the same rollout with and without replay, so one run gives the A/B. The seeds run one after the
other in one process on one engine (each new trainer's first weight sync loads its own weights).

Writes ``rl.json`` (per seed and step: reward, KL with and without replay, their ratio, top-k
agreements, fallback rows, step times) and ``rl.png``, and prints the median ratio
KL(with replay) / KL(without). Exit status 1 when a target is missed: median ratio above
``--max-ratio``, replayed top-k agreement below 100%, or fallback rows other than each sample's
last token.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

WORDS = (" ka", " to", " ri", " me", " an", " su", " lo", " ne", " di", " pa")
"""Pattern words: one token each in the tiny models' tokenizer (checked when the dataset is built)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="auxout rl", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: auxout's routing-sensitive MoE)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=80, help="optimizer steps per seed")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (GRPO group size)")
    p.add_argument("--answer-words", type=int, default=6, help="words each completion is scored on")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warm-steps", type=int, default=70,
                   help="supervised steps on the task before GRPO (cached; 0: start from --model as is)")
    p.add_argument("--no-replay", action="store_true", help="train without replay (the KL of both arms is still logged)")
    p.add_argument("--max-ratio", type=float, default=0.2, help="target: median KL(with) / KL(without)")
    p.add_argument("--out", default="out/rl", help="directory for rl.json and rl.png")
    p.add_argument("--no-progress", action="store_true")
    return p


def pattern_rows(tokenizer: Any, n: int, seed: int, answer_words: int) -> list[dict[str, Any]]:
    """``n`` dataset rows: ``prompt`` (text) and ``target_ids`` (the continuation's token ids)."""
    ids = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in WORDS]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"pattern words must be single tokens in this tokenizer: {dict(zip(WORDS, ids))}")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        period = int(rng.integers(2, 4))
        unit = [int(w) for w in rng.choice(len(WORDS), size=period, replace=False)]
        shown = int(rng.integers(3 * period, 4 * period + 1))
        seq = [unit[i % period] for i in range(shown + answer_words)]
        rows.append({"prompt": "".join(WORDS[w] for w in seq[:shown]).lstrip(),
                     "target_ids": [ids[w][0] for w in seq[shown:]]})
    return rows


def pattern_reward(completion_ids: Sequence[Sequence[int]], target_ids: Sequence[Sequence[int]],
                   **_: Any) -> list[float]:
    """Fraction of the target's tokens the completion reproduces at the same position (exact)."""
    return [sum(int(a == b) for a, b in zip(c, t)) / len(t) for c, t in zip(completion_ids, target_ids)]


def warm_start(base: str, steps: int, *, seed: int = 0, answer_words: int = 6) -> str:
    """``base`` after ``steps`` supervised steps on the pattern task (next-token loss, 16 sequences a step),
    written next to auxout's cached models and reused: a policy that continues some patterns, so GRPO's
    groups differ in reward from the first step. Returns the checkpoint directory."""
    import hashlib
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from auxout.testing.models import default_cache_dir

    h = hashlib.sha256(f"{steps}|{seed}|{answer_words}|1".encode())
    for f in sorted(Path(base).glob("*.safetensors")) + [Path(base) / "config.json"]:
        h.update(f.read_bytes())  # (a rebuilt base model gets its own warm start)
    tag = h.hexdigest()[:12]
    out = default_cache_dir() / "models" / f"pattern-warm-{tag}"
    if (out / ".auxout-warm-complete").is_file():
        return str(out)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(seed)
    for step in range(steps):
        rows = pattern_rows(tok, 16, 10_000 + seed * steps + step, answer_words)
        seqs = [tok(r["prompt"])["input_ids"] + r["target_ids"] for r in rows]
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for i, q in enumerate(seqs):
            ids[i, : len(q)] = labels[i, : len(q)] = torch.tensor(q)
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / ".auxout-warm-complete").write_text(json.dumps({"base": base, "steps": steps, "seed": seed}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _config(args: argparse.Namespace, seed: int, out: str) -> Any:
    from auxout.trainer.trl import R3GRPOConfig

    batch = args.prompts_per_step * args.generations
    return R3GRPOConfig(
        output_dir=out, use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=False, report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=seed, max_steps=args.steps,
        per_device_train_batch_size=batch, num_generations=args.generations,
        max_completion_length=args.answer_words, learning_rate=args.lr, lr_scheduler_type="constant",
        gradient_checkpointing=False, temperature=1.0, beta=0.0,
        generation_kwargs={"min_tokens": args.answer_words},
        routing_replay=not args.no_replay,
        vllm_engine_kwargs=dict(dtype="bfloat16", enforce_eager=True, block_size=32, max_model_len=256),
    )  # fmt: skip


def _steps(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    keep = ("reward", "step_time", "r3/kl_k3_replay", "r3/kl_k3_no_replay", "r3/kl_ratio",
            "r3/max_abs_log_ratio_replay", "r3/max_abs_log_ratio_no_replay", "r3/live_topk_agreement",
            "r3/replayed_topk_agreement", "r3/fallback_rows", "r3/fallback_rows_not_last_token",
            "r3/weight_sync_seconds")
    return [{"step": h["step"], **{k.removeprefix("r3/"): h[k] for k in keep if k in h}}
            for h in history if "reward" in h]


def _step_printer(seed: int, steps: int) -> Any:
    """A TrainerCallback printing one line per logged step: reward and the KL of both arms."""
    from transformers import TrainerCallback

    class StepLine(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            logs = logs or {}
            if "reward" not in logs:
                return
            kl = ""
            if "r3/kl_k3_replay" in logs:
                kl = (f"  KL {logs['r3/kl_k3_replay']:.2e} with replay, {logs['r3/kl_k3_no_replay']:.2e} without"
                      f" (ratio {logs.get('r3/kl_ratio', math.nan):.3f})")
            print(f"seed {seed} step {state.global_step:3d}/{steps}  reward {logs['reward']:.3f}{kl}"
                  f"  {logs.get('step_time', math.nan):.2f} s", flush=True)

    return StepLine()


def run_seed(path: str, seed: int, args: argparse.Namespace, engine: Any) -> tuple[Any, dict[str, Any]]:
    """Train one seed; returns (its trainer, whose engine the next seed reuses, and its record)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from auxout.trainer.trl import R3GRPOTrainer

    tok = AutoTokenizer.from_pretrained(path)
    n = args.steps * args.prompts_per_step
    data = Dataset.from_list(pattern_rows(tok, n, seed, args.answer_words))
    t0 = time.perf_counter()
    trainer = R3GRPOTrainer(model=path, reward_funcs=pattern_reward, args=_config(args, seed, f"{args.out}/seed{seed}"),
                            train_dataset=data, processing_class=tok, vllm_engine=engine)
    from transformers import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if not args.no_progress:
        trainer.add_callback(_step_printer(seed, args.steps))
    t1 = time.perf_counter()
    trainer.train()
    t2 = time.perf_counter()
    steps = _steps(trainer.state.log_history)
    ratios = [s["kl_ratio"] for s in steps if "kl_ratio" in s]
    return trainer, {
        "seed": seed,
        "steps": steps,
        "median_kl_ratio": statistics.median(ratios) if ratios else None,
        "reward_first": statistics.mean(s["reward"] for s in steps[: max(1, len(steps) // 4)]),
        "reward_last": statistics.mean(s["reward"] for s in steps[-max(1, len(steps) // 4) :]),
        "replay_counts": dict(trainer.replay_counts),
        "setup_seconds": t1 - t0,
        "train_seconds": t2 - t1,
    }


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, run in enumerate(report["seeds"]):
        color = f"C{i}"
        steps = run["steps"]
        x = [s["step"] for s in steps]
        ax_r.plot(x, [s["reward"] for s in steps], color=color, label=f"seed {run['seed']}")
        kx = [s["step"] for s in steps if "kl_k3_replay" in s]
        ax_k.plot(kx, [s["kl_k3_no_replay"] for s in steps if "kl_k3_replay" in s], color=color, ls="--")
        ax_k.plot(kx, [s["kl_k3_replay"] for s in steps if "kl_k3_replay" in s], color=color)
    ax_r.set_xlabel("step")
    ax_r.set_ylabel("reward (fraction of the pattern continued)")
    ax_r.set_ylim(0, 1)
    ax_r.legend(fontsize=8)
    ax_k.set_yscale("log")
    ax_k.set_xlabel("step")
    ax_k.set_ylabel("rollout->train k3 KL")
    ax_k.set_title(f"solid: with replay, dashed: without (median ratio {report['median_kl_ratio']:.3f})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; exit 0 iff every target holds (see the module docstring)."""
    args = _parser().parse_args(list(argv) if argv is not None else None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    start = time.perf_counter()
    if args.model:
        path = args.model
    else:
        from auxout.testing.models import build_routing_moe

        path = build_routing_moe()
    base = path
    if args.warm_steps > 0:
        path = warm_start(base, args.warm_steps, answer_words=args.answer_words)
    warm_seconds = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, engine = [], None
    for seed in args.seeds:
        trainer, run = run_seed(path, seed, args, engine)
        engine = trainer.vllm_generation.llm
        runs.append(run)
        last = run["steps"][-1] if run["steps"] else {}
        print(f"seed {seed}: reward {run['reward_first']:.3f} -> {run['reward_last']:.3f}, median KL ratio "
              f"{run['median_kl_ratio']:.4f}, {run['train_seconds']:.1f} s ({len(run['steps'])} steps; last step "
              f"KL {last.get('kl_k3_replay', math.nan):.2e} with replay, {last.get('kl_k3_no_replay', math.nan):.2e} "
              "without)")
    ratios = [s["kl_ratio"] for r in runs for s in r["steps"] if "kl_ratio" in s]
    agreement = min((s["replayed_topk_agreement"] for r in runs for s in r["steps"] if "replayed_topk_agreement" in s),
                    default=math.nan)
    stray = max((s["fallback_rows_not_last_token"] for r in runs for s in r["steps"]
                 if "fallback_rows_not_last_token" in s), default=0.0)
    report = {
        "model": base,
        "warm_started": path if path != base else None,
        "routing_replay": not args.no_replay,
        "median_kl_ratio": statistics.median(ratios) if ratios else math.nan,
        "min_replayed_topk_agreement": agreement,
        "max_fallback_rows_not_last_token": stray,
        "seconds": time.perf_counter() - start,
        "model_and_warm_start_seconds": warm_seconds,
        "config": {k: v for k, v in vars(args).items() if k != "no_progress"},
        "seeds": runs,
    }
    (out / "rl.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "rl.png")
    ok = report["median_kl_ratio"] <= args.max_ratio and agreement == 1.0 and stray == 0
    print(f"median KL(with replay) / KL(without) over {len(ratios)} steps and {len(runs)} seeds: "
          f"{report['median_kl_ratio']:.4f} (target <= {args.max_ratio})")
    print(f"replayed top-k agreement (min over steps): {agreement:.2%}; fallback rows other than each sample's last "
          f"token: {stray:.0f}")
    print(f"wrote {out / 'rl.json'} and {out / 'rl.png'}; {report['seconds']:.0f} s in all ({warm_seconds:.0f} s building "
          "or loading the model and its warm start)")
    if not ok:
        print("auxout rl: FAILED: a target was missed (see above)")
    return 0 if ok else 1
