"""Engine arguments that turn routed experts on in a vLLM engine."""

from __future__ import annotations

import hashlib
import logging
import uuid
from typing import Any

from auxout.credentials import export_store_url
from auxout.keys import KeySpace, checkpoint_digest, model_keyspace, route_fingerprint
from auxout.profile import id_dtype_for
from auxout.vllm.options import CONFIG_KEY, LIFE_KEY, VllmOptions

logger = logging.getLogger("vllm.auxout")  # under vLLM's logger: its handlers and format

SCHEDULER_CLS = "auxout.vllm.engine_core.async_scheduler.AuxoutSchedulerSelector"
CPU_WORKER_CLS = "auxout.vllm.workers.cpu.AuxoutCPUWorker"
GPU_WORKER_CLS = "auxout.vllm.workers.worker.AuxoutGPUWorker"


def default_worker_cls() -> str:
    """The auxout worker matching vLLM's current platform."""
    from vllm.platforms import current_platform

    return CPU_WORKER_CLS if current_platform.is_cpu() else GPU_WORKER_CLS


def engine_kwargs(**options: Any) -> dict[str, Any]:
    """Keyword arguments to merge into ``vllm.LLM(...)`` / ``EngineArgs(...)``.

    ``options`` are :class:`VllmOptions` fields (``store``, ``max_bytes``, ``default_return``,
    ``namespace``, ``store_options``, ``output``, ``routing_weights``); they travel in
    ``additional_config["auxout"]``, which vLLM pickles into its engine-core and worker processes.

    A store URL's user and password (``store_options={"url": "redis://:secret@host:port/0"}``)
    are not put in ``additional_config``, which vLLM logs at startup and pickles to its processes:
    they go to ``AUXOUT_STORE_URL`` in this process's environment, which vLLM's engine and worker
    processes inherit (:mod:`auxout.credentials`; giving them only there, or in ``REDIS_URL``,
    works too).

    Prefix caching is not set here (vLLM turns it on by default for every model that supports it),
    so ``LLM(path, enable_prefix_caching=True, **engine_kwargs())`` works; the worker refuses to
    start, saying why, if it ends up off.

    Side effect, once per process: this is where vLLM builds requests and their outputs, so four
    methods of vLLM's classes are replaced here by wrappers that call them: ``InputProcessor``'s
    ``_validate_params`` and ``_validate_model_input`` (auxout's request checks: a bad input
    fails alone with a clear error, before the engine; ``caller.request_checks``) and
    ``RequestState``'s ``make_request_output`` and ``_new_completion_output`` (each completion's
    routing weights and its own manifest and facts; ``caller.completion_fields``). Every
    replacement auxout makes is listed in docs/architecture.md.
    """
    from auxout.vllm.caller.completion_fields import install_completion_fields
    from auxout.vllm.caller.request_checks import install_request_validation

    opts, secret_url = VllmOptions.from_dict(options).without_credentials()
    if secret_url is not None:
        export_store_url(secret_url)
    install_request_validation()
    install_completion_fields()
    return {
        "scheduler_cls": SCHEDULER_CLS,
        "worker_cls": default_worker_cls(),
        # one token per engine lifetime: routes of weights updated in place stay its own (KeySpace)
        "additional_config": {CONFIG_KEY: opts.to_dict(), LIFE_KEY: uuid.uuid4().hex[:12]},
        # async_scheduling is left to vLLM: the scheduler class follows the final setting.
    }


def route_keyspace(vllm_config: Any, opts: VllmOptions, hash_block: int) -> KeySpace:
    """The keyspace both the scheduler and the worker use: ``<namespace>/m<fingerprint>``.

    The fingerprint covers the model (name or path), its weights (a digest of a local
    checkpoint's files, else the revision), the compute dtype and quantization, the route shape
    (decoder layers, top-k, experts, id dtype), the hash block size and the prefix-cache hash
    algorithm, so two models, two checkpoints at one path or route profiles never share a key,
    while the same model on any instance, after a restart or on both sides of a P/D split, always
    does (given block hashes from the same seed).
    """
    mc = vllm_config.model_config
    experts = int(mc.get_num_experts())
    fp = route_fingerprint(
        str(mc.model),
        num_layers=int(getattr(mc.hf_text_config, "num_hidden_layers", 0) or 0),
        top_k=int(mc.get_num_experts_per_tok()),
        num_experts=experts,
        # with weights the objects hold (id, float32 weight) slots: another layout, another key
        dtype=id_dtype_for(experts).name + ("+w:float32" if opts.routing_weights else ""),
        block_size=hash_block,
        hash_algo=str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")),
        # the same path may hold a new checkpoint after a restart; bf16 and fp32 route differently
        weights="|".join(
            [checkpoint_digest(str(mc.model)), *(str(getattr(mc, k, None)) for k in ("revision", "dtype", "quantization"))]
        ),
    )
    from auxout.vllm.workers.topology import dp_keyspace

    life = str((getattr(vllm_config, "additional_config", None) or {}).get(LIFE_KEY, ""))
    return model_keyspace(dp_keyspace(opts.namespace, vllm_config.parallel_config).namespace, fp, life)


_DIGEST_SAMPLES = 256  # elements read per parameter tensor


_DIGEST_ROW = 1024
_ODD = 0x9E3779B97F4A7C15 - (1 << 64)  # (odd, as a signed int64: multiplications wrap mod 2**64)


def _bits_digest(bits: Any) -> bytes:
    """Every element of a flat integer view, where it sits: the elements as rows of 1024, each
    row's sum and each column's sum weighted by an odd multiple of its index (int64, wrapping:
    exact and the same on any device), and the last partial row as is. Changing one element
    changes a row and a column sum; swapping two elements moves two row sums or two column sums
    by opposite amounts, which the different weights do not cancel."""
    import torch

    n = bits.numel()
    m = n // _DIGEST_ROW
    tail = bits[m * _DIGEST_ROW :].cpu().numpy().tobytes()
    if m == 0:
        return tail
    grid = bits[: m * _DIGEST_ROW].view(m, _DIGEST_ROW)
    out = [tail]
    for dim, size in ((1, m), (0, _DIGEST_ROW)):
        sums = grid.sum(dim=dim, dtype=torch.int64)
        weights = torch.arange(1, size + 1, dtype=torch.int64, device=bits.device) * _ODD
        out.append(str(int(torch.sum(sums * weights))).encode())
    return b"\0".join(out)


def weights_digest(model: Any) -> str:
    """A digest of the weights ``model`` runs now (16 hex digits), "" if it cannot be taken.

    Names a generation after a prefix-cache reset (``KeySpace.weights``): engines holding the same
    weights, however they got them (an RL weight sync to every replica and to both sides of a P/D
    split, or a restart from a checkpoint of them), derive the same keys and share routes, which
    are a function of the weights. Reads each parameter's name, shape, dtype, ``_DIGEST_SAMPLES``
    evenly spaced elements and, over all its elements' bits, position-weighted sums of its
    1024-element rows and of its columns (``_bits_digest``: any changed element changes them, and
    so does swapping any two elements; a plain sum missed swaps no sample read). Once per reset,
    on the device, in exact integer arithmetic. Shards are what this rank holds, so peers share
    only with the same tensor/pipeline-parallel layout (others recompute).
    """
    import torch

    int_views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    h = hashlib.sha256()
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                flat = p.detach().reshape(-1)
                n = flat.numel()
                h.update(f"{name}\0{tuple(p.shape)}\0{p.dtype}\0".encode())
                if n:
                    k = min(n, _DIGEST_SAMPLES)  # evenly spaced, in integers (float32 rounds past 2**24)
                    idx = torch.arange(k, dtype=torch.int64, device=flat.device) * (n - 1) // max(k - 1, 1)
                    h.update(flat.index_select(0, idx).contiguous().view(torch.uint8).cpu().numpy().tobytes())
                    # and every element (a low learning rate in bf16 moves only a few percent of them)
                    bits = flat.contiguous().view(int_views.get(flat.element_size(), torch.uint8))
                    h.update(_bits_digest(bits))
    except Exception as exc:  # never stop the engine for a digest: its routes are then its own
        logger.warning(
            "auxout: could not take a digest of the weights (%s: %s); routes after this prefix-cache reset "
            "are not shared with other engines (they recompute)", type(exc).__name__, exc,
        )  # fmt: skip
        return ""
    return h.hexdigest()[:16]
