"""Shared by the weight-sync tests: a few real optimizer steps in transformers, in-process engines
(as TRL's colocate mode builds them), greedy outputs with logprobs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from routes_oracle import ENGINE_ARGS

from auxout.testing.servers import free_port

LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_ENABLE_V1_MULTIPROCESSING")


@contextlib.contextmanager
def launcher_env() -> Iterator[None]:
    """The environment ``external_launcher`` needs (a one-process torch.distributed group), restored
    afterwards together with vLLM's environment cache: vLLM sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    for it, which would build every later module's engine in process too."""
    old = {k: os.environ.get(k) for k in LAUNCHER_ENV}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import vllm.envs

        vllm.envs.disable_envs_cache()


def inprocess_llm(path: str, auxout: dict[str, Any] | None = None, *, plain: bool = False, **kw: Any) -> Any:
    """An in-process engine (``external_launcher``, TRL colocate's choice); ``plain``: without auxout."""
    from vllm import LLM

    from auxout.vllm import engine_kwargs

    args = {**ENGINE_ARGS, "max_model_len": 512, "distributed_executor_backend": "external_launcher", **kw}
    if not plain:
        args.update(engine_kwargs(**(auxout or {})))
    with launcher_env():
        return LLM(model=path, **args)


def greedy_outputs(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 12, **extra: Any) -> list[Any]:
    """Completions of greedy requests with the sampled tokens' logprobs."""
    from vllm import SamplingParams

    sp = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0, **extra
    )  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def ids_and_logprobs(completions: Sequence[Any]) -> list[tuple[list[int], list[float]]]:
    return [
        (list(c.token_ids), [float(step[t].logprob) for step, t in zip(c.logprobs, c.token_ids)]) for c in completions
    ]


class Trainer:
    """A transformers model of a checkpoint and AdamW on next-token loss over fixed random batches:
    each ``step()`` really changes every weight, deterministically."""

    def __init__(self, path: str, *, lr: float = 3e-3, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(seed)
        self.batch = torch.randint(3, 1000, (4, 48), generator=gen)

    def step(self, n: int = 2) -> None:
        for _ in range(n):
            loss = self.model(input_ids=self.batch, labels=self.batch).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()

    def state(self) -> dict[str, Any]:
        """A copy of the current weights in transformers' names."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, path: Path) -> str:
        self.model.save_pretrained(path, safe_serialization=True)
        return str(path)


def prompts(seed: int, lengths: Sequence[int] = (40, 75, 100)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, n).tolist() for n in lengths]
