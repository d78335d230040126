"""Route formats of the engines' wire payloads and of the RL frameworks, to and from auxout's layout.

auxout's per-sample layout is the engines' ``[S-1, L, K]``: row ``i`` = experts of input token ``i``,
``L`` = MoE layers only, "no route" = a row of ``-1``. Each framework differs in one of: the layer
axis (SGLang counts every hidden layer), the padding around the sample (verl), the dtype
(int16 / int32) or what "no route" looks like. The converters here are pure numpy and refuse,
with the field and value, anything they cannot place unambiguously.

| framework / engine | convention | here |
|---|---|---|
| vLLM (>= 0.22) | ``choices[].routed_experts`` = base64 of an ``.npy`` ``[S-1, L, K]``, uint8/uint16 | :func:`decode_vllm` |
| SGLang | ``routed_experts`` = flat row-major base64, no shape; dtype in ``routed_experts_dtype`` (int32 if absent); L = ``num_hidden_layers`` | :func:`decode_sglang` |
| verl | int16 ``[total_len, L, K]`` placed in the ``[left-padded prompt, right-padded response]`` layout | :func:`to_verl` / :func:`from_verl` |
| slime / Miles | ``sample.rollout_routed_experts`` = ``[len(tokens)-1, L, K]`` int32 | :func:`to_slime` / :func:`from_slime` |
| NeMo-RL | int32, ``-1`` = no route (the live router decides) | :func:`to_nemo_rl` / :func:`from_nemo_rl` |
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from auxout.trainer.route_trace import SENTINEL, RouteTrace, RouteTraceError, is_index

SGLANG_DTYPES: dict[str, type[np.integer[Any]]] = {"int32": np.int32, "uint16": np.uint16, "uint8": np.uint8, "int16": np.int16, "int64": np.int64}


def _routes3(a: Any, name: str) -> np.ndarray:
    r = np.asarray(a)
    if r.dtype.kind not in "iu":
        raise RouteTraceError(f"{name} must have an integer dtype, got {r.dtype}")
    if r.ndim != 3:
        raise RouteTraceError(f"{name} must be [rows, L, K], got shape {r.shape}")
    return r


def _b64(payload: str | bytes, name: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RouteTraceError(f"{name} is not valid base64: {e}") from None


# ---------------------------------------------------------------------- engines' wire payloads
def decode_vllm(payload: str | bytes) -> np.ndarray:
    """vLLM's ``routed_experts`` (base64 of ``np.save`` bytes) -> ``[S-1, L, K]``; no pickles are loaded."""
    raw = _b64(payload, "routed_experts")
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise RouteTraceError(f"routed_experts is not an .npy array: {e}") from None
    return _routes3(arr, "routed_experts")


def encode_vllm(routes: Any) -> str:
    """Inverse of :func:`decode_vllm` (what vLLM's OpenAI server writes)."""
    buf = io.BytesIO()
    np.save(buf, _routes3(routes, "routes"), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_sglang(payload: str | bytes, num_layers: int, top_k: int, dtype: str | None = None,
                  moe_layers: Sequence[int] | None = None) -> np.ndarray:
    """SGLang's flat base64 ids -> ``[S-1, L, K]``.

    SGLang sends no shape: ``num_layers`` is the model's ``num_hidden_layers`` (SGLang keeps a row
    per hidden layer, dense ones included) and ``top_k`` its ``num_experts_per_tok``. ``dtype`` is
    the echoed ``meta_info.routed_experts_dtype`` (int32 when absent: older servers). ``moe_layers``
    (hidden-layer numbers of the MoE layers, e.g. ``MoELayers.moe_to_hidden``) drops the dense rows.
    """
    name = dtype or "int32"
    if name not in SGLANG_DTYPES:
        raise RouteTraceError(f"routed_experts_dtype={dtype!r}: expected one of {sorted(SGLANG_DTYPES)}")
    dt = np.dtype(SGLANG_DTYPES[name])
    raw = _b64(payload, "routed_experts")
    per_row = num_layers * top_k * dt.itemsize
    if num_layers <= 0 or top_k <= 0 or len(raw) % per_row:
        raise RouteTraceError(
            f"routed_experts has {len(raw)} bytes, not a multiple of num_layers={num_layers} x top_k={top_k} x "
            f"{dt.itemsize} B ({name}): wrong layer count (SGLang uses num_hidden_layers) or dtype?"
        )
    arr = np.frombuffer(raw, dtype=dt).reshape(-1, num_layers, top_k)
    if moe_layers is not None:
        idx = np.asarray(moe_layers, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= num_layers):
            raise RouteTraceError(f"moe_layers {idx.tolist()} outside [0, {num_layers})")
        arr = arr[:, idx, :]
    return arr.copy()


def encode_sglang(routes: Any, dtype: str = "int32") -> tuple[str, str]:
    """Inverse of :func:`decode_sglang`: ``(base64, dtype name)``; refuses ids the dtype cannot hold."""
    r = _routes3(routes, "routes")
    if dtype not in SGLANG_DTYPES:
        raise RouteTraceError(f"dtype={dtype!r}: expected one of {sorted(SGLANG_DTYPES)}")
    info = np.iinfo(np.dtype(SGLANG_DTYPES[dtype]))
    if r.size and (r.min() < info.min or r.max() > info.max):
        raise RouteTraceError(f"ids in [{r.min()}, {r.max()}] do not fit {dtype} (SGLang falls back to int32)")
    return base64.b64encode(np.ascontiguousarray(r, dtype=SGLANG_DTYPES[dtype]).tobytes()).decode("ascii"), dtype


# ---------------------------------------------------------------------- verl
def to_verl(trace: RouteTrace, max_prompt_len: int, max_response_len: int,
            pad_token: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """verl's sample layout: ``(input_ids, attention_mask, routes)`` over ``max_prompt_len + max_response_len``.

    The prompt is left-padded to ``max_prompt_len`` and the response right-padded to
    ``max_response_len``; each route row lands at its token's column (verl places the engine's rows
    at the left-pad offset) as int16. Padding rows and the last token's row are ``-1``: never a
    route, unlike a zero-filled buffer (expert 0 repeated).
    """
    p, s = trace.prompt_len, len(trace.tokens)
    if p > max_prompt_len or s - p > max_response_len:
        raise RouteTraceError(
            f"prompt {p} / response {s - p} tokens exceed max_prompt_len={max_prompt_len} / "
            f"max_response_len={max_response_len}"
        )
    total = max_prompt_len + max_response_len
    ids = np.full(total, pad_token, dtype=np.int64)
    mask = np.zeros(total, dtype=np.int64)
    routes = np.full((total, trace.num_layers, trace.top_k), SENTINEL, dtype=np.int16)
    off = max_prompt_len - p
    ids[off : off + s], mask[off : off + s] = trace.tokens, 1
    routes[off : off + s] = trace.routes
    return ids, mask, routes


def from_verl(routes: Any, attention_mask: Any) -> np.ndarray:
    """verl's padded ``[total_len, L, K]`` + attention mask -> engine layout ``[S-1, L, K]``."""
    r = _routes3(routes, "routes")
    m = np.asarray(attention_mask).astype(bool)
    if m.shape != (r.shape[0],):
        raise RouteTraceError(f"attention_mask shape {m.shape} does not match routes rows {r.shape[0]}")
    return r[m][:-1].astype(np.int32)


# ---------------------------------------------------------------------- slime / Miles
def to_slime(trace: RouteTrace) -> np.ndarray:
    """``sample.rollout_routed_experts``: ``[len(tokens)-1, L, K]`` int32 (rows without a route stay -1)."""
    return trace.per_sample().astype(np.int32)


def from_slime(tokens: Sequence[int] | np.ndarray, rollout_routed_experts: Any, prompt_len: int) -> RouteTrace:
    """A slime/Miles sample -> :class:`RouteTrace`; refuses a row count other than ``len(tokens)-1``."""
    t = np.asarray(tokens)
    r = _routes3(rollout_routed_experts, "rollout_routed_experts")
    if len(r) != len(t) - 1:
        raise RouteTraceError(f"rollout_routed_experts has {len(r)} rows for {len(t)} tokens (expected {len(t) - 1})")
    if not is_index(prompt_len) or not 0 <= prompt_len <= len(t):
        raise RouteTraceError(f"prompt_len must be an int in [0, {len(t)}] (the sample's tokens), got {prompt_len!r}")
    return RouteTrace.from_output(t[:prompt_len], t[prompt_len:], r)


# ---------------------------------------------------------------------- NeMo-RL
def from_nemo_rl(routes: Any) -> np.ndarray:
    """NeMo-RL's routes (``-1`` = no route) -> auxout's (a row of ``-1``).

    A row that mixes ``-1`` with expert ids is ambiguous (part of a top-k cannot be left to the
    router) and is refused with its position and layer.
    """
    r = _routes3(routes, "routes").astype(np.int32)
    neg = r == SENTINEL
    mixed = neg.any(-1) & ~neg.all(-1)
    if mixed.any():
        pos, layer = (int(v) for v in np.argwhere(mixed)[0])
        raise RouteTraceError(
            f"routes[position={pos}, moe_layer={layer}] = {r[pos, layer].tolist()} mixes -1 with expert ids"
        )
    return r


def to_nemo_rl(trace_or_routes: RouteTrace | Any) -> np.ndarray:
    """auxout routes -> NeMo-RL's int32 ``[S-1, L, K]`` (no-route rows stay ``-1``)."""
    if isinstance(trace_or_routes, RouteTrace):
        return trace_or_routes.per_sample().astype(np.int32)
    return from_nemo_rl(trace_or_routes)


# ---------------------------------------------------------------------- layer axis
def select_moe_layers(routes: Any, moe_to_hidden: Sequence[int]) -> np.ndarray:
    """``[rows, num_hidden_layers, K]`` (a row per hidden layer, as SGLang/Miles send) -> MoE layers only."""
    r = _routes3(routes, "routes")
    idx = np.asarray(moe_to_hidden, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= r.shape[1]):
        raise RouteTraceError(f"moe_to_hidden {idx.tolist()} outside the {r.shape[1]} layers of routes")
    return r[:, idx, :].copy()


def expand_layers(routes: Any, moe_to_hidden: Sequence[int], num_hidden_layers: int) -> np.ndarray:
    """Inverse of :func:`select_moe_layers`: dense layers get ``-1`` rows."""
    r = _routes3(routes, "routes")
    idx = np.asarray(moe_to_hidden, dtype=np.int64)
    if len(idx) != r.shape[1]:
        raise RouteTraceError(f"routes have {r.shape[1]} MoE layers, moe_to_hidden lists {len(idx)}")
    if idx.size and (idx.min() < 0 or idx.max() >= num_hidden_layers or len(set(idx.tolist())) != len(idx)):
        raise RouteTraceError(f"moe_to_hidden {idx.tolist()} is not distinct layers of the {num_hidden_layers} hidden layers")
    out = np.full((r.shape[0], num_hidden_layers, r.shape[2]), SENTINEL, dtype=np.int32)
    out[:, idx, :] = r
    return out
