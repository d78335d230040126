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
  routing, and DEFLATE on top wins where routing is skewed. Where it cannot win (large
  near-uniform routes) the zlib stream holds stored blocks (level 0) instead of level 1's
  output, which would be slightly longer and ~10x slower to make: any zlib decoder reads both.

Fields written for a payload named ``P`` (``routed_experts`` or ``routing_weights``):
``P`` (the base64 text), ``P_format``, ``P_dtype``, ``P_shape`` and, for ``"packed"`` ids,
``P_bits``. The specification clients decode from (byte and bit order, framing, every field):
docs/wire.md.
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
_SAMPLE_BYTES = 4096  # packed ids up to this size are always deflated; larger ones are sampled
_MIN_SAVING = 0.02  # deflate packed ids only where their byte histogram promises at least this


def _deflate_level(packed: np.ndarray) -> int:
    """zlib level for packed ids: 1, or 0 (stored blocks) where DEFLATE cannot pay for its time.

    Bit-packed uniform routes are incompressible, and DEFLATE at level 1 spends ~20 ns a byte
    (more than packing and base64 together) to make them 20 bytes longer. Packed routes rarely
    repeat byte strings, so what DEFLATE can save is what its Huffman stage can, bounded by the
    order-0 entropy of the bytes: a histogram of ``_SAMPLE_BYTES`` sampled evenly says whether
    that reaches ``_MIN_SAVING``. Either level writes a standard zlib stream (decoders cannot
    tell which was used), and where level 1 is chosen its bytes are what it always wrote.
    """
    if packed.size <= _SAMPLE_BYTES:
        return _ZLIB_LEVEL
    chunks = packed[: packed.size // 64 * 64].reshape(-1, 64)
    sample = chunks[:: max(1, len(chunks) // (_SAMPLE_BYTES // 64))].reshape(-1)
    counts = np.bincount(sample, minlength=256)
    freq = counts[counts > 0] / sample.size
    entropy = float(-(freq * np.log2(freq)).sum())
    return _ZLIB_LEVEL if entropy <= 8 * (1 - _MIN_SAVING) else 0


class WireFormatError(ValueError):
    """A payload or its metadata does not describe a valid array."""


def id_bits(num_experts: int) -> int:
    """Bits per expert id: enough for ``num_experts - 1`` (at least 1)."""
    if num_experts <= 0:
        raise WireFormatError(f"num_experts must be positive, got {num_experts}")
    return max(1, int(num_experts - 1).bit_length())


def _lane_mask(lane: int, width: int) -> np.uint64:
    """A 64-bit word whose ``lane``-bit lanes each hold ``width`` low one-bits."""
    return np.uint64(sum(((1 << width) - 1) << s for s in range(0, 64, lane)))


def _squeeze(words: np.ndarray, scratch: np.ndarray, lane: int, width: int) -> None:
    """Join each pair of ``lane/2``-bit lanes (``width`` bits used in each) into one ``lane``-bit
    lane holding ``2 * width`` bits, the upper half's bits first (in place)."""
    low = _lane_mask(lane, width)
    np.right_shift(words, np.uint64(lane // 2 - width), out=scratch)
    scratch &= low << np.uint64(width)
    words &= low
    words |= scratch


def _spread(words: np.ndarray, scratch: np.ndarray, lane: int, width: int) -> None:
    """Inverse of :func:`_squeeze` (in place)."""
    low = _lane_mask(lane, width)
    np.bitwise_and(words, low << np.uint64(width), out=scratch)
    scratch <<= np.uint64(lane // 2 - width)
    words &= low
    words |= scratch


def _windows(buf: np.ndarray, first: int, stride: int, count: int) -> np.ndarray:
    """``count`` big-endian 8-byte windows of ``buf`` at ``first + i * stride`` (unaligned, and
    overlapping where ``stride < 8``)."""
    return np.ndarray((count,), dtype=">u8", buffer=buf, offset=first, strides=(stride,))


def _store(out: np.ndarray, words: np.ndarray, first: int, stride: int) -> None:
    """OR word ``i`` into zeroed ``out`` at byte ``first + i * stride`` (``stride >= 8``: stores
    do not overlap), most significant byte first."""
    _windows(out, first, stride, words.size)[...] |= words


def _store_groups(out: np.ndarray, words: np.ndarray, nbytes: int) -> None:
    """Write each word's leading ``nbytes`` bytes at ``out[i * nbytes:]`` (``nbytes < 8``).

    Each word is written whole, as an unaligned 8-byte store, after the next words' leading bytes
    are ORed into its trailing ones: the overlapping stores then agree on every byte they share,
    so their order does not matter."""
    window = np.empty_like(words)
    np.right_shift(words[1:], np.uint64(8 * nbytes), out=window[:-1])
    window[-1:] = 0
    window |= words
    for j in range(2, -(-8 // nbytes)):
        window[:-j] |= words[j:] >> np.uint64(8 * nbytes * j)
    _windows(out, 0, nbytes, words.size)[...] = window


def _pack(flat: np.ndarray, bits: int) -> np.ndarray:
    """The packed stream of checked ids ``flat`` as a uint8 array (see :func:`pack_ids`)."""
    n = flat.size
    nbytes = (n * bits + 7) // 8
    if bits == 8:
        return np.ascontiguousarray(flat, dtype=np.uint8)
    if bits == 16:
        return flat.astype(">u2").view(np.uint8)
    groups = -(-n // 8)
    lane_type = np.dtype(np.uint8) if bits < 8 else np.dtype(">u2")
    if n == groups * 8:
        lanes = flat.astype(lane_type)
    else:
        lanes = np.zeros(groups * 8, dtype=lane_type)
        lanes[:n] = flat
    words = lanes.view(np.uint64)
    words.byteswap(inplace=True)  # first id in the top lane: 8 ids a word (bits < 8), or 4
    scratch = np.empty_like(words)
    if bits < 8:
        for lane, width in ((16, bits), (32, 2 * bits), (64, 4 * bits)):
            _squeeze(words, scratch, lane, width)
        words <<= np.uint64(64 - 8 * bits)  # a group's `bits` bytes lead its word
        out = np.empty(groups * bits + 8, dtype=np.uint8)
        _store_groups(out, words, bits)
        return out[:nbytes]
    _squeeze(words, scratch, 32, bits)
    _squeeze(words, scratch, 64, 2 * bits)  # 4 ids in the low 4 * bits bits: half a group
    half = 4 * bits
    words <<= np.uint64(64 - half)
    words[1::2] >>= np.uint64(half % 8)  # (odd bits: a group's second half starts mid-byte)
    out = np.zeros(groups * bits + 16, dtype=np.uint8)
    _store(out, words[0::2], 0, bits)
    _store(out, words[1::2], half // 8, bits)
    return out[:nbytes]


def _check_ids(flat: np.ndarray, bits: int) -> None:
    if not 1 <= bits <= 16:
        raise WireFormatError(f"bits must be in 1..16, got {bits}")
    if flat.size and flat.dtype.kind not in "iub":
        raise WireFormatError(f"ids must be integers, got dtype {flat.dtype}")
    if flat.size:
        high, low = int(flat.max()), int(flat.min())
        if high >> bits or low < 0:
            raise WireFormatError(f"an id ({high if high >> bits else low}) does not fit {bits} bits")


def pack_ids(ids: np.ndarray, bits: int) -> bytes:
    """Integer ids (< 2**bits, bits <= 16) as a big-endian bit stream, ``bits`` per id.

    Eight ids fill exactly ``bits`` bytes, so the stream is built with whole-array 64-bit
    shifts and masks (no Python loop over ids): ids one per byte (bits < 8) or per 16 bits
    (bits > 8) of a word are squeezed together lane pair by lane pair, then each word's bytes
    are stored at their place in the stream.
    """
    flat = np.asarray(ids).reshape(-1)
    _check_ids(flat, bits)
    return _pack(flat, bits).tobytes()


def unpack_ids(data: bytes, bits: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`pack_ids`: ``count`` ids of ``dtype``."""
    if not 1 <= bits <= 16:
        raise WireFormatError(f"bits must be in 1..16, got {bits}")
    if len(data) * 8 < count * bits:
        raise WireFormatError(f"packed payload holds {len(data) * 8} bits, {count} ids of {bits} bits need {count * bits}")
    if bits == 8:
        return np.frombuffer(data, dtype=np.uint8, count=count).astype(dtype)
    if bits == 16:
        return np.frombuffer(data, dtype=">u2", count=count).astype(dtype)
    groups = -(-count // 8)
    buf = np.zeros(groups * bits + 8, dtype=np.uint8)  # (room for the last group's 8-byte window)
    body = np.frombuffer(data, dtype=np.uint8)[: groups * bits]
    buf[: body.size] = body
    if bits < 8:
        words = _windows(buf, 0, bits, groups).astype(np.uint64)  # a group's bytes lead its window
        words >>= np.uint64(64 - 8 * bits)
        scratch = np.empty_like(words)
        for lane, width in ((64, 4 * bits), (32, 2 * bits), (16, bits)):
            _spread(words, scratch, lane, width)
        words.byteswap(inplace=True)
        return words.view(np.uint8)[:count].astype(dtype)
    half = 4 * bits
    whole, nibble = divmod(half, 8)
    words = np.empty(2 * groups, dtype=np.uint64)  # the two halves of each group, 4 ids each
    words[0::2] = _windows(buf, 0, bits, groups) >> np.uint64(64 - half)
    second = _windows(buf, whole, bits, groups).astype(np.uint64)
    second >>= np.uint64(64 - nibble - half)
    second &= np.uint64((1 << half) - 1)
    words[1::2] = second
    scratch = np.empty_like(words)
    _spread(words, scratch, 64, 2 * bits)
    _spread(words, scratch, 32, bits)
    words.byteswap(inplace=True)
    return words.view(">u2")[:count].astype(dtype)


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
        flat = arr.reshape(-1)
        _check_ids(flat, bits)
        packed = _pack(flat, bits)
        payload = zlib.compress(packed.data, _deflate_level(packed))
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
