"""Wire formats for route arrays in HTTP responses, and the one decoder clients need.

Engine-agnostic: the server encodes ``[tokens, layers, top_k]`` arrays (expert ids, or routing
weights) into one of :data:`FORMATS` and states the format, dtype, shape and first position
next to the payload, so a client never guesses. ``decode_routes`` turns any of them back into
the array.

- ``"npy"`` (default): base64 of a ``.npy`` file (vLLM's existing ``routed_experts`` contract).
- ``"sglang"``: base64 of the flat little-endian array with the dtype echoed (ids as ``int32``,
  the contract SGLang clients decode with ``np.frombuffer(..., np.int32)``).
- ``"packed"``: ids bit-packed at ``ceil(log2(num_experts))`` bits, then DEFLATE (zlib); float
  weights are DEFLATE of their bytes. Chosen by measurement (``benchmarks/wire.py``,
  docs/performance.md): bit packing is the only lossless step that still wins on uniform
  routing, and DEFLATE on top wins where routing is skewed, at no loss where it is not.

Fields written for a payload named ``P`` (``routed_experts`` or ``routing_weights``):
``P`` (the base64 text), ``P_format``, ``P_dtype``, ``P_shape`` and, for ``"packed"`` ids,
``P_bits``.
"""

from __future__ import annotations

import base64
import binascii
import io
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

FORMATS = ("npy", "sglang", "packed")
DEFAULT_FORMAT = "npy"
_ZLIB_LEVEL = 1


class WireFormatError(ValueError):
    """A payload or its metadata does not describe a valid array."""


def id_bits(num_experts: int) -> int:
    """Bits per expert id: enough for ``num_experts - 1`` (at least 1)."""
    if num_experts <= 0:
        raise WireFormatError(f"num_experts must be positive, got {num_experts}")
    return max(1, int(num_experts - 1).bit_length())


def pack_ids(ids: np.ndarray, bits: int) -> bytes:
    """Integer ids (< 2**bits, bits <= 16) as a big-endian bit stream, ``bits`` per id."""
    if not 1 <= bits <= 16:
        raise WireFormatError(f"bits must be in 1..16, got {bits}")
    flat = np.asarray(ids).reshape(-1)
    if flat.size and int(flat.max()) >> bits:
        raise WireFormatError(f"an id ({int(flat.max())}) does not fit {bits} bits")
    nbytes = (flat.size * bits + 7) // 8
    if bits <= 8:  # 8 ids fill exactly ``bits`` bytes: one 64-bit word per group, vectorized
        groups = np.zeros(-(-flat.size // 8) * 8, dtype=np.uint64)
        groups[: flat.size] = flat
        shifts = np.arange(7, -1, -1, dtype=np.uint64) * np.uint64(bits)
        words = np.bitwise_or.reduce(groups.reshape(-1, 8) << shifts, axis=1)
        return words.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - bits :].tobytes()[:nbytes]
    wide = np.ascontiguousarray(flat, dtype=">u2")
    all_bits = np.unpackbits(wide.view(np.uint8).reshape(-1, 2), axis=1)[:, 16 - bits :]
    return np.packbits(all_bits.reshape(-1)).tobytes()


def unpack_ids(data: bytes, bits: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`pack_ids`: ``count`` ids of ``dtype``."""
    if not 1 <= bits <= 16:
        raise WireFormatError(f"bits must be in 1..16, got {bits}")
    if len(data) * 8 < count * bits:
        raise WireFormatError(f"packed payload holds {len(data) * 8} bits, {count} ids of {bits} bits need {count * bits}")
    if bits <= 8:
        groups = -(-count // 8)
        raw = np.zeros((groups, 8), dtype=np.uint8)
        body = np.frombuffer(data, dtype=np.uint8)[: groups * bits]
        padded = np.zeros(groups * bits, dtype=np.uint8)
        padded[: body.size] = body
        raw[:, 8 - bits :] = padded.reshape(groups, bits)
        words = raw.view(">u8").reshape(groups, 1).astype(np.uint64)
        shifts = np.arange(7, -1, -1, dtype=np.uint64) * np.uint64(bits)
        ids = (words >> shifts) & np.uint64((1 << bits) - 1)
        return ids.reshape(-1)[:count].astype(dtype)
    buf = np.frombuffer(bytes(data) + b"\0\0", dtype=np.uint8).astype(np.uint32)
    offset = np.arange(count, dtype=np.int64) * bits
    byte = offset >> 3
    window = (buf[byte] << 16) | (buf[byte + 1] << 8) | buf[byte + 2]
    shift = (24 - bits - (offset & 7)).astype(np.uint32)
    return ((window >> shift) & ((1 << bits) - 1)).astype(dtype)


def encode(array: np.ndarray, fmt: str = DEFAULT_FORMAT, *, name: str = "routed_experts",
           num_experts: int | None = None) -> dict[str, Any]:
    """The response fields for ``array`` in format ``fmt`` under field name ``name``."""
    if fmt not in FORMATS:
        raise WireFormatError(f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    arr = np.asarray(array)
    fields: dict[str, Any] = {f"{name}_format": fmt, f"{name}_shape": list(arr.shape)}
    if fmt == "npy":
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        payload = buf.getvalue()
        fields[f"{name}_dtype"] = arr.dtype.name
    elif fmt == "sglang":
        wire_dtype = np.dtype("<i4") if arr.dtype.kind in "iu" else arr.dtype.newbyteorder("<")
        payload = np.ascontiguousarray(arr, dtype=wire_dtype).tobytes()
        fields[f"{name}_dtype"] = wire_dtype.name
    elif arr.dtype.kind in "iu":
        bits = id_bits(num_experts) if num_experts is not None else max(1, int(arr.max(initial=0)).bit_length())
        payload = zlib.compress(pack_ids(arr, bits), _ZLIB_LEVEL)
        fields[f"{name}_dtype"] = arr.dtype.name
        fields[f"{name}_bits"] = bits
    else:
        little = arr.dtype.newbyteorder("<")
        payload = zlib.compress(np.ascontiguousarray(arr, dtype=little).tobytes(), _ZLIB_LEVEL)
        fields[f"{name}_dtype"] = little.name
    fields[name] = base64.b64encode(payload).decode("ascii")
    return fields


def _get(source: Any, key: str) -> Any:
    if isinstance(source, Mapping):
        return source.get(key)
    value = getattr(source, key, None)
    if value is None:  # openai client objects keep unknown response fields in model_extra
        extra = getattr(source, "model_extra", None) or {}
        value = extra.get(key)
    return value


def decode_routes(source: Any, name: str = "routed_experts", *, fmt: str | None = None,
                  dtype: str | None = None, shape: Any = None, bits: int | None = None) -> np.ndarray | None:
    """The array a response carries, whatever its format.

    ``source`` is a response choice or stream chunk choice (a dict, or an ``openai`` client
    object), or the base64 text itself with ``fmt``/``dtype``/``shape``/``bits`` given. Returns
    None when the choice carries no payload under ``name`` (``"routed_experts"`` or
    ``"routing_weights"``). A bare ``.npy`` string decodes without metadata.
    """
    if isinstance(source, str):
        text: str | None = source
    else:
        text = _get(source, name)
        fmt = fmt or _get(source, f"{name}_format")
        dtype = dtype or _get(source, f"{name}_dtype")
        shape = shape if shape is not None else _get(source, f"{name}_shape")
        bits = bits if bits is not None else _get(source, f"{name}_bits")
    if text is None:
        return None
    fmt = fmt or DEFAULT_FORMAT
    if fmt not in FORMATS:
        raise WireFormatError(f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireFormatError(f"{name} is not valid base64: {exc}") from exc
    if fmt == "npy":
        try:
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except ValueError as exc:
            raise WireFormatError(f"{name} is not a .npy payload: {exc}") from exc
        if shape is not None and list(arr.shape) != list(shape):
            raise WireFormatError(f"{name} has shape {list(arr.shape)}, the response states {list(shape)}")
        return arr
    if dtype is None or shape is None:
        raise WireFormatError(f"format {fmt!r} needs {name}_dtype and {name}_shape")
    dt = np.dtype(dtype)
    shape_t = tuple(int(s) for s in shape)
    count = int(np.prod(shape_t, dtype=np.int64))
    try:
        if fmt == "sglang":
            flat = np.frombuffer(raw, dtype=dt)
        elif dt.kind in "iu":
            if bits is None:
                raise WireFormatError(f"format 'packed' ids need {name}_bits")
            packed = zlib.decompress(raw)
            if len(packed) != (count * int(bits) + 7) // 8:
                raise WireFormatError(
                    f"{name} holds {len(packed)} packed bytes, shape {list(shape_t)} at {bits} bits needs "
                    f"{(count * int(bits) + 7) // 8}"
                )
            flat = unpack_ids(packed, int(bits), count, dt)
        else:
            flat = np.frombuffer(zlib.decompress(raw), dtype=dt)
    except zlib.error as exc:
        raise WireFormatError(f"{name} is not a valid packed payload: {exc}") from exc
    if flat.size != count:
        raise WireFormatError(f"{name} holds {flat.size} values, shape {list(shape_t)} needs {count}")
    return flat.reshape(shape_t)


__all__ = ["DEFAULT_FORMAT", "FORMATS", "WireFormatError", "decode_routes", "encode", "id_bits"]
