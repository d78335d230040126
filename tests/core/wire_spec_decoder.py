"""A decoder of auxout's route payloads and manifests written from docs/wire.md alone.

It imports nothing from auxout (numpy and the standard library only), so a test that feeds it
auxout's output checks the page, not auxout against itself.
"""

from __future__ import annotations

import base64
import io
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def decode(choice: Mapping[str, Any], name: str = "routed_experts") -> np.ndarray:
    """The array ``choice[name]`` encodes, per its ``name_format``/``_dtype``/``_shape``/``_bits``."""
    raw = base64.b64decode(choice[name], validate=True)
    fmt = choice[f"{name}_format"]
    shape = tuple(choice[f"{name}_shape"])
    dtype = np.dtype(choice[f"{name}_dtype"])
    count = int(np.prod(shape))
    if fmt == "npy":
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
        assert arr.shape == shape and arr.dtype == dtype
        return arr
    if fmt == "sglang":  # flat little-endian values, C order, no header
        wire = np.dtype("<i4") if dtype.kind in "iu" else np.dtype("<f4")
        return np.frombuffer(raw, dtype=wire).reshape(shape)
    assert fmt == "packed", fmt
    data = zlib.decompress(raw)  # zlib framing (RFC 1950)
    if dtype.kind == "f":  # weights: float32 little-endian, C order
        return np.frombuffer(data, dtype="<f4").reshape(shape)
    bits = int(choice[f"{name}_bits"])
    assert len(data) == (count * bits + 7) // 8
    # the bit stream, most significant bit of byte 0 first; id i is bits [i*b, (i+1)*b), MSB first
    stream = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="big")[: count * bits]
    weights = 1 << np.arange(bits - 1, -1, -1, dtype=np.uint64)
    values = (stream.reshape(count, bits).astype(np.uint64) * weights).sum(axis=1)
    return values.astype(dtype).reshape(shape)


def read_manifest(manifest: Mapping[str, Any], get: Callable[[Sequence[str]], Sequence[bytes]]) -> np.ndarray:
    """The rows a manifest names; ``get(keys)`` returns the objects' bytes in order."""
    assert manifest["version"] == 1
    layers, top_k = manifest["shape_per_token"]
    if manifest["num_rows"] == 0:
        assert not manifest["keys"]
    ids, _, w = manifest["dtype"].partition("+w")
    slot = np.dtype([("id", ids), ("w", w)]) if w else np.dtype(ids)  # packed: no padding
    blob = b"".join(get(list(manifest["keys"])))
    n_keys = len(manifest["keys"])
    stored = 0 if n_keys == 0 else (n_keys - 1) * manifest["block_size"] + manifest["last_object_rows"]
    assert len(blob) == stored * layers * top_k * slot.itemsize
    rows = np.frombuffer(blob, dtype=slot).reshape(stored, layers, top_k)
    return rows[manifest["row_offset"] : manifest["row_offset"] + manifest["num_rows"]]


def redis_address(store: str) -> tuple[str, str]:
    """``(URL a Redis client connects to, namespace NS)`` of a ``redis://...?namespace=NS`` store:
    the URL without its ``namespace`` parameter."""
    from urllib.parse import parse_qsl, urlencode, urlsplit

    parts = urlsplit(store)
    query = parse_qsl(parts.query)
    namespace = next(v for k, v in query if k == "namespace")
    rest = urlencode([(k, v) for k, v in query if k != "namespace"])
    return f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{rest}" if rest else ""), namespace
