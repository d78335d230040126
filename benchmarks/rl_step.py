"""A GRPO step's training time with routing replay vs without, in ONE run (TRL + vLLM-CPU, colocated).

One ``R3GRPOTrainer`` trains; before each step a callback switches replay on or off in the order
on, off, off, on (repeated), so both arms see the same engine, process, weights trajectory and
batch shapes. A step's training time is what replay touches: the no-grad old-logprob forward
(TRL's importance-sampling correction, chunked) plus the loss forward and backward; generation,
weight sync and reward scoring are left out (replay does not run there). The metrics forward is
off (``routing_metrics=False``). Prints, for wall time and for the process's CPU time (less moved by
other processes on a shared machine), the median of each arm, their ratio and the median of the
per-cycle ratios, with the on/on and off/off pairs as the instrument's own noise.

    python benchmarks/rl_step.py                          # routing-sensitive model, 40 steps
    python benchmarks/rl_step.py --model DIR --steps 80 --checkpointing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ORDER = (True, False, False, True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: auxout's routing-sensitive MoE)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4, help="first steps left out")
    p.add_argument("--batch", type=int, default=16, help="completions per step")
    p.add_argument("--completion", type=int, default=32, help="tokens per completion")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (TRL's default) on")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback

    from auxout.trainer.trl import R3GRPOConfig, R3GRPOTrainer

    if args.model:
        path = args.model
    else:
        from auxout.testing.models import build_routing_moe

        path = build_routing_moe()
    cfg = R3GRPOConfig(
        output_dir="/tmp/auxout-rl-step", use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=False,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, max_steps=args.steps,
        per_device_train_batch_size=args.batch, num_generations=8, max_completion_length=args.completion,
        generation_kwargs={"min_tokens": args.completion}, learning_rate=1e-4,
        gradient_checkpointing=args.checkpointing, routing_metrics=False,
        vllm_engine_kwargs=dict(dtype="bfloat16", enforce_eager=True, block_size=32, max_model_len=512),
    )  # fmt: skip
    prompts = [" ".join(f"w{(i * 7 + j) % 50}" for j in range(12 + i % 9)) for i in range(64)]
    data = Dataset.from_dict({"prompt": prompts * (1 + args.steps * args.batch // (8 * len(prompts)))})

    def reward(completion_ids: Any, **_: Any) -> list[float]:
        return [float(sum(c) % 5) for c in completion_ids]

    trainer = R3GRPOTrainer(model=path, reward_funcs=reward, args=cfg, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}  # CPU time: less moved by other processes
    step_time: dict[str, dict[bool, list[float]]] = {c: {True: [], False: []} for c in clocks}
    current: dict[str, float] = {}

    def add(key: str, started: dict[str, float]) -> None:
        for c, clock in clocks.items():
            current[f"{key}.{c}"] = current.get(f"{key}.{c}", 0.0) + clock() - started[c]

    def now() -> dict[str, float]:
        return {c: clock() for c, clock in clocks.items()}

    prepare = trainer._prepare_inputs
    logps = trainer._get_per_token_logps_and_entropies
    train_step = trainer.training_step

    def timed_prepare(batch: Any) -> Any:
        t = now()
        try:
            return prepare(batch)
        finally:
            add("prepare", t)

    def timed_logps(*a: Any, **kw: Any) -> Any:
        t = now()
        try:
            return logps(*a, **kw)
        finally:
            if trainer._r3_phase == "rollout":  # the old-logprob forward, inside generation
                add("old", t)

    def timed_step(*a: Any, **kw: Any) -> Any:
        t = now()
        try:
            return train_step(*a, **kw)
        finally:
            add("train", t)

    trainer._prepare_inputs = timed_prepare  # type: ignore[method-assign]
    trainer._get_per_token_logps_and_entropies = timed_logps  # type: ignore[method-assign]
    trainer.training_step = timed_step  # type: ignore[method-assign]

    class Toggle(TrainerCallback):
        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            trainer.routing_replay = ORDER[state.global_step % len(ORDER)]
            current.clear()

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step > args.warmup:
                arm = ORDER[(state.global_step - 1) % len(ORDER)]
                for c in clocks:
                    step_time[c][arm].append(current[f"train.{c}"] - current[f"prepare.{c}"] + current[f"old.{c}"])

    trainer.add_callback(Toggle())
    trainer.train()
    print(f"model {path}; {args.batch} completions x {args.completion} tokens per step, checkpointing "
          f"{'on' if args.checkpointing else 'off'}; {len(step_time['wall'][True])} steps with replay, "
          f"{len(step_time['wall'][False])} without (old-logprob forward + loss forward/backward per step)")
    for c in clocks:
        on, off = step_time[c][True], step_time[c][False]
        n = min(len(on), len(off)) // 2 * 2
        pairs = [(on[i] + on[i + 1]) / (off[i] + off[i + 1]) for i in range(0, n, 2)]
        same_on = [on[i] / on[i + 1] for i in range(0, n, 2)]
        same_off = [off[i] / off[i + 1] for i in range(0, n, 2)]
        q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
        print(f"{c:4s} time: median {statistics.median(on) * 1e3:.1f} ms with replay, {statistics.median(off) * 1e3:.1f} "
              f"ms without; ratio {statistics.median(on) / statistics.median(off):.3f} (medians of the arms), "
              f"{statistics.median(pairs):.3f} (median of {len(pairs)} cycle ratios, quartiles {q[0]:.3f}-{q[2]:.3f}); "
              f"noise: on/on {statistics.median(same_on):.3f}, off/off {statistics.median(same_off):.3f}")
    print(f"replay counts {dict(trainer.replay_counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
