"""The CPU worker with routes (its own module: vLLM's CPU worker imports CPU-only code).

It also fixes an engine-killing vLLM-CPU bug that our users meet through us. When a request's
prefill is chunked, vLLM samples a token after every chunk and throws away all but the last one;
to keep a seeded request reproducible it then rewinds that request's generator with
``gen.set_offset(gen.get_offset() - 4)`` (``GPUModelRunner._bookkeeping_sync``, inherited by the
CPU runner). That is CUDA's Philox counter: a CPU ``torch.Generator`` (Mersenne Twister) has no
offset, so the call raises ``RuntimeError: CPU Generator does not use offset`` and the engine dies
on any seeded sampled request whose prompt spans more than one step. The CPU equivalent of the
rewind is to save the generator's state before sampling and restore it afterwards for the
requests whose sample is discarded; :func:`install_seeded_chunk_fix` does that on the worker's
model runner, and hides those generators from the CUDA rewind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from auxout.vllm.workers.worker import AuxoutWorkerMixin

MLA_ON_CPU = (
    "auxout routes need prefix caching, and vLLM-CPU turns prefix caching (and chunked prefill) off for "
    "models with multi-head latent attention (MLA: {arch}) whatever was requested. Serve this "
    "architecture on GPU, or use one vLLM-CPU runs with prefix caching (qwen3_moe, qwen2_moe, mixtral, "
    "olmoe, gpt_oss)."
)
AMX_MLA_SHAPE = (
    "vLLM-CPU picks its AMX MLA attention backend on this host (the CPU has AMX), and that backend runs "
    "only bfloat16 models with kv_lora_rank + qk_rope_head_dim = 576 (DeepSeek-V2/V3/R1); this model "
    "({arch}) has dtype {dtype} and {head} (vLLM would fail loading it). vLLM-CPU's other MLA backend "
    "turns prefix caching off, which auxout routes need. Serve this model in bfloat16 with DeepSeek's "
    "shapes, on GPU, or use an architecture vLLM-CPU runs with prefix caching (qwen3_moe, qwen2_moe, "
    "mixtral, olmoe, gpt_oss)."
)
AMX_MLA_HEAD_SIZE = 576  # vllm.v1.attention.backends.mla.amx_mla.AMXMLABackend.get_supported_head_sizes


MOE_DP_ON_CPU = (
    "vLLM-CPU cannot run a mixture-of-experts model with data parallelism (data_parallel_size={dp}): "
    "its CPU communicator has no all_gatherv, which the MoE layers' data-parallel dispatch calls, so "
    "the engine would start, pass /health and die at the first request (NotImplementedError in "
    "base_device_communicator.all_gatherv, with or without --enable-expert-parallel). Run one engine "
    "per replica (data_parallel_size=1) behind a router, or data parallelism on GPU."
)


EP_ON_CPU = (
    "vLLM-CPU cannot run expert parallelism (enable_expert_parallel with {ranks} ranks: {layout}): its "
    "fused-MoE experts (CPUUnquantizedExperts.apply) ignore expert_map and hand global expert ids to "
    "cpu_fused_moe while each rank holds only its share of the experts, so the first forward reads "
    "past that share (SIGSEGV in csrc/cpu/cpu_fused_moe.cpp, fused_moe_impl) and the engine core stops "
    "with 'RuntimeError: cancelled': every request then gets HTTP 500. Leave --enable-expert-parallel off (tensor parallelism alone "
    "shards every expert), or run expert parallelism on GPU."
)


def _ep_ranks(parallel: Any) -> tuple[int, str]:
    """The ranks vLLM splits the experts over when expert parallelism is on (``FusedMoEParallelConfig``:
    tensor x data x prefill-context parallel), and that layout in words."""
    sizes = {
        "tensor_parallel_size": int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        "data_parallel_size": int(getattr(parallel, "data_parallel_size", 1) or 1),
        "prefill_context_parallel_size": int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
    }
    ranks = sizes["tensor_parallel_size"] * sizes["data_parallel_size"] * sizes["prefill_context_parallel_size"]
    return ranks, ", ".join(f"{k}={v}" for k, v in sizes.items() if v > 1)


def check_cpu_config(vllm_config: Any) -> None:
    """Refuse, with the reason, a configuration whose routes vLLM-CPU cannot serve.

    Runs before the model loads. Data parallelism with an MoE model would fail inside vLLM-CPU at
    the first request (found by a probe: the server died on it); so would expert parallelism over
    more than one rank (a worker segfaults in the first MoE forward). Without an AMX unit vLLM-CPU
    turns prefix caching off for MLA (the plain "needs prefix caching" check would then point the
    wrong way); with one it keeps prefix caching and picks its AMX backend, which fails inside a
    kernel on any model but a bfloat16 DeepSeek-shaped one ("invalid weight input features 16"
    for the tiny model).
    """
    model = vllm_config.model_config
    parallel = getattr(vllm_config, "parallel_config", None)
    dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
    moe = int(getattr(model, "get_num_experts", lambda: 0)() or 0) > 0
    if dp > 1 and moe:
        raise ValueError(MOE_DP_ON_CPU.format(dp=dp))
    if moe and getattr(parallel, "enable_expert_parallel", False):
        ranks, layout = _ep_ranks(parallel)
        if ranks > 1:  # (one rank holds every expert: vLLM builds no expert_map, and it runs)
            raise ValueError(EP_ON_CPU.format(ranks=ranks, layout=layout))
    if not getattr(model, "use_mla", False):
        return
    arch = getattr(model.hf_config, "model_type", "?")
    if not vllm_config.cache_config.enable_prefix_caching:
        raise ValueError(MLA_ON_CPU.format(arch=arch))
    hf = model.hf_config
    lora, rope = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
    if lora is None or rope is None or arch == "deepseek_v4":
        return  # not a DeepSeek-V2/V3 layout: vLLM's own checks apply
    if model.dtype != torch.bfloat16 or lora + rope != AMX_MLA_HEAD_SIZE:
        head = f"kv_lora_rank + qk_rope_head_dim = {lora} + {rope} = {lora + rope}"
        raise ValueError(AMX_MLA_SHAPE.format(arch=arch, dtype=str(model.dtype).removeprefix("torch."), head=head))


def _discarded_generators(runner: Any) -> dict[int, torch.Generator]:
    """Generators of this step's requests whose sampled token vLLM will throw away (partial prefill)."""
    batch = runner.input_batch
    gens: dict[int, torch.Generator] = batch.generators
    if not gens:
        return {}
    hits = np.flatnonzero(runner.discard_request_mask.np[: batch.num_reqs]).tolist()
    return {i: gens[i] for i in hits if i in gens} if hits else {}


@contextlib.contextmanager
def _hidden(gens: dict[int, torch.Generator], hide: dict[int, torch.Generator]) -> Iterator[None]:
    """Take ``hide`` out of ``gens`` for the duration (vLLM's CUDA-only rewind then skips them)."""
    for i in hide:
        del gens[i]
    try:
        yield
    finally:
        gens.update(hide)


def install_seeded_chunk_fix(runner: Any) -> None:
    """Make seeded sampling with chunked prefill work on a CPU model runner (idempotent).

    ``_sample`` keeps the random state of discarded samples unchanged (as the CUDA rewind does),
    and ``_bookkeeping_sync`` no longer sees those generators, so it does not call ``set_offset``.
    """
    if getattr(runner, "_auxout_seed_fix", False):
        return
    sample = runner._sample
    bookkeeping = runner._bookkeeping_sync

    # (_sample and _bookkeeping_sync run back to back in one step: the second reuses the first's
    # answer, tagged with the step's logits tensor, which both get and the forward makes anew)
    step: list[Any] = [None, {}]

    def _sample(*args: Any, **kwargs: Any) -> Any:
        discarded = _discarded_generators(runner)
        step[:] = [args[0] if args else kwargs.get("logits"), discarded]
        if not discarded:
            return sample(*args, **kwargs)
        states = {i: g.get_state() for i, g in discarded.items()}
        try:
            return sample(*args, **kwargs)
        finally:
            for i, g in discarded.items():
                g.set_state(states[i])

    def _bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
        tag, discarded = step
        step[:] = [None, {}]
        if tag is None or tag is not (args[2] if len(args) > 2 else kwargs.get("logits")):
            discarded = _discarded_generators(runner)
        if not discarded:
            return bookkeeping(*args, **kwargs)
        with _hidden(runner.input_batch.generators, discarded):
            return bookkeeping(*args, **kwargs)

    runner._sample = _sample
    runner._bookkeeping_sync = _bookkeeping_sync
    runner._auxout_seed_fix = True


class AuxoutCPUWorker(AuxoutWorkerMixin, CPUWorker):
    """vLLM's CPU worker plus route capture, auxout's worker connector and the seeded-chunk fix."""

    def init_device(self) -> None:
        check_cpu_config(self.vllm_config)  # before the model loads: MLA backends may fail on it first
        super().init_device()
        install_seeded_chunk_fix(self.model_runner)

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().compile_or_warm_up_model(*args, **kwargs)
        ensure_pp_receive_buffers(self.model_runner)
        return result



def ensure_pp_receive_buffers(runner: Any) -> None:
    """Allocate the buffers a non-first PP stage receives hidden states into, if still missing.

    vLLM's GPU runner allocates them in its warm-up dummy run; vLLM-CPU skips that run when the
    model runs eagerly with an explicit KV cache size (``VLLM_CPU_KVCACHE_SPACE``), so the first
    real step of stage 2 fails (``assert self.intermediate_tensors is not None`` in
    ``sync_and_gather_intermediate_tensors``) and the engine core then dies with a ``KeyError``
    on a request id in ``Scheduler.update_from_output``. Same allocation as the dummy run.
    """
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )
