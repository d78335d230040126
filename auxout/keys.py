"""Store keys derived from the engine's chained KV block hashes.

A block hash identifies the whole prefix ending at that block (it is chained: tokens, cache
salt and whatever else the engine hashes), so identical prefixes share keys, in every process
whose engine derives hashes from the same seed. Hashes do not encode the model, so the
namespace ends in a *route fingerprint* (model, its weights, compute dtype, route profile, hash
block size, hash algorithm): two models, two checkpoints or route shapes never share a key. Every
key also carries the prefix-cache *generation*: after a reset (an RL weight update) old routes
can never be served.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KEY_PREFIX = "auxout/r3"


@dataclass(frozen=True, slots=True)
class PackedHashes:
    """New block hashes of one request, packed into one bytes object for cheap IPC."""

    data: bytes
    item_size: int

    @classmethod
    def pack(cls, hashes: Sequence[bytes]) -> PackedHashes:
        if not hashes:
            raise ValueError("cannot pack an empty hash list")
        size = len(hashes[0])
        data = b"".join(hashes)
        if len(data) != size * len(hashes):
            raise ValueError("block hashes in one pack must have equal length")
        return cls(data, size)

    def __len__(self) -> int:
        return len(self.data) // self.item_size

    def __iter__(self) -> Iterator[bytes]:
        s = self.item_size
        return (self.data[i : i + s] for i in range(0, len(self.data), s))


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Turns block hashes into store keys: ``auxout/r3/<namespace>/g<generation>/<hex>``.

    Generation 0 holds the routes of the weights the engine loaded (the fingerprint names them),
    so replicas and restarts share it. A later generation follows weights updated in place:
    - ``weights``, a digest of the weights themselves (the vLLM worker reads every parameter
      when a generation starts), names it ``w<weights>``: every engine holding those weights, a
      P/D peer, a replica or a restarted engine, shares its routes, and no other weights do;
    - else ``life``, a token of this engine's lifetime, names it ``g<generation>-<life>``: another
      engine, or this engine's previous life, that counted its updates the same way but may
      have updated differently never meets it (nothing is shared: peers recompute).
    """

    namespace: str = "local"
    life: str = ""
    weights: str = ""

    def __post_init__(self) -> None:
        if not self.namespace or any(c.isspace() for c in self.namespace) or ".." in self.namespace:
            raise ValueError(f"invalid key namespace {self.namespace!r}: non-empty, no spaces, no '..'")
        if self.life and not self.life.isalnum():
            raise ValueError(f"invalid key-space life {self.life!r}: letters and digits only")
        if self.weights and not self.weights.isalnum():
            raise ValueError(f"invalid key-space weights digest {self.weights!r}: letters and digits only")

    def prefix(self, generation: int) -> str:
        if generation and self.weights:
            return f"{KEY_PREFIX}/{self.namespace}/w{self.weights}/"
        if generation and self.life:
            return f"{KEY_PREFIX}/{self.namespace}/g{generation}-{self.life}/"
        return f"{KEY_PREFIX}/{self.namespace}/g{generation}/"

    def keys(self, hashes: PackedHashes | Sequence[bytes], generation: int) -> list[str]:
        if isinstance(hashes, PackedHashes):
            return self.keys_batch([hashes], generation)[0]
        p = self.prefix(generation)
        return [p + h.hex() for h in hashes]

    def keys_batch(self, packs: Sequence[PackedHashes], generation: int) -> list[list[str]]:
        """``keys`` of several requests' hashes at once: one prefix, one hex text for the step.

        A prefill step derives hundreds of keys; a decode step a few, each of its own request.
        """
        if not packs:
            return []
        size = packs[0].item_size
        if any(p.item_size != size for p in packs):
            return [self.keys(p, generation) for p in packs]
        data = b"".join([p.data for p in packs])
        prefix = self.prefix(generation)
        if len(data) >= _BULK_MIN * size:
            flat = _bulk_keys(prefix, data, size)
        else:
            hx = data.hex()
            n = 2 * size
            flat = [prefix + hx[i : i + n] for i in range(0, len(hx), n)]
        if len(packs) == 1:
            return [flat]
        out: list[list[str]] = []
        pos = 0
        for p in packs:
            end = pos + len(p.data) // size
            out.append(flat[pos:end])
            pos = end
        return out

    @classmethod
    def for_instance(cls, instance: str, dp_rank: int = 0) -> KeySpace:
        """Namespace for one engine instance and data-parallel rank (never mixed in a shared store)."""
        return cls(f"{instance}/dp{dp_rank}")


class ChainKeys:
    """Keys of recently finished hash chains, reused when a new request re-sends the same prefix.

    The next turn of a conversation re-sends its whole history, whose block hashes are the
    previous turn's (they are chained), so their keys are strings derived when that turn ran.
    Reusing them skips deriving them again, and the store's dictionaries then meet the same
    string objects (hash cached, compared by identity). A key is a function of its hash bytes
    alone, and reuse is decided by comparing those bytes, so a reused key is always its hash's
    key. Entries are keyed by a chain's first hash, least recently used out first, within
    ``capacity`` chains and ``max_keys`` keys in all (the strings of evicted routes stay alive
    while remembered: 65,536 keys are about 9 MB).
    """

    def __init__(self, keyspace: KeySpace, capacity: int, max_keys: int = 1 << 16) -> None:
        self.keyspace = keyspace
        self.capacity = capacity
        self.max_keys = max_keys
        self.generation = 0
        self._chains: OrderedDict[bytes, tuple[bytes, int, list[str]]] = OrderedDict()
        self._num_keys = 0

    def _enter(self, generation: int) -> None:
        """Forget every chain when the generation moves: keys name their generation."""
        if generation != self.generation:
            self._chains.clear()
            self._num_keys = 0
            self.generation = generation

    def remember(self, data: bytes, item_size: int, keys: list[str], generation: int) -> None:
        """The chain ``data`` (hashes of ``item_size`` bytes) has ``keys``, under ``generation``."""
        self._enter(generation)
        if not _REUSE_MIN <= len(keys) <= self.max_keys or len(data) != len(keys) * item_size:
            return
        chains = self._chains
        head = data[:item_size]
        old = chains.pop(head, None)
        if old is not None:
            self._num_keys -= len(old[2])
        chains[head] = (data, item_size, keys)
        self._num_keys += len(keys)
        while len(chains) > self.capacity or self._num_keys > self.max_keys:
            self._num_keys -= len(chains.popitem(last=False)[1][2])

    def keys_batch(
        self,
        packs: Sequence[PackedHashes],
        generation: int,
        sources: list[tuple[list[str], int] | None] | None = None,
    ) -> list[list[str]]:
        """``KeySpace.keys_batch``, with the leading keys of a remembered chain reused.

        ``sources``, if given, gets one entry per pack: ``(remembered key list, n)`` when its
        first ``n`` keys are that list's (the very list passed to ``remember``), else None.
        """
        self._enter(generation)
        chains = self._chains
        found = [chains.get(p.data[: p.item_size]) for p in packs] if chains else []
        if found.count(None) == len(found):  # (a new conversation, a decode step's hashes)
            if sources is not None:
                sources.extend([None] * len(packs))
            return self.keyspace.keys_batch(packs, generation)
        reused: list[list[str]] = []
        rest: list[PackedHashes] = []
        for p, chain in zip(packs, found):
            n = _shared_prefix(p, chain)
            if chain is None or not n:
                reused.append([])
                rest.append(p)
                if sources is not None:
                    sources.append(None)
                continue
            chains.move_to_end(p.data[: p.item_size])
            reused.append(chain[2][:n])
            if sources is not None:
                sources.append((chain[2], n))
            rest.append(PackedHashes(p.data[n * p.item_size :], p.item_size))
        todo = [i for i, p in enumerate(rest) if p.data]
        derived = self.keyspace.keys_batch([rest[i] for i in todo], generation)
        for i, keys in zip(todo, derived):
            reused[i] = reused[i] + keys if reused[i] else keys
        return reused


def _shared_prefix(pack: PackedHashes, chain: tuple[bytes, int, list[str]] | None) -> int:
    """How many leading hashes ``pack`` shares with a remembered chain (0 if none)."""
    if chain is None or chain[1] != pack.item_size:
        return 0
    old, size = chain[0], chain[1]
    m = min(len(old), len(pack.data))
    if pack.data[:m] == old[:m]:  # the usual case: the new turn extends the whole old chain
        return m // size
    diff = np.flatnonzero(np.frombuffer(pack.data, np.uint8, m) != np.frombuffer(old, np.uint8, m))
    return int(diff[0]) // size


# A chain this short is derived again (cheaper than looking it up).
_REUSE_MIN = 8

# From this many keys on, one numpy fill and one C-level split beat a string concatenation per
# key (measured break-even ~64 keys of 32-byte hashes; 512 keys: 0.68x the time).
_BULK_MIN = 64


def _bulk_keys(prefix: str, data: bytes, item_size: int) -> list[str]:
    """``prefix + hash.hex()`` for every hash in ``data``, built as one newline-separated text."""
    n = len(data) // item_size
    head = np.frombuffer(prefix.encode(), dtype=np.uint8)  # namespaces hold no whitespace
    text = np.empty((n, len(head) + 2 * item_size + 1), dtype=np.uint8)
    text[:, : len(head)] = head
    text[:, len(head) : -1] = np.frombuffer(data.hex().encode(), dtype=np.uint8).reshape(n, -1)
    text[:, -1] = ord("\n")
    return text.tobytes()[:-1].decode().split("\n")


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
_SAMPLE = 1 << 16  # bytes read at the start, middle and end of each weight file


def checkpoint_digest(path: str | os.PathLike[str]) -> str:
    """Digest of the weights at a local checkpoint path ("" where the path is not local).

    Routes depend on the weights, and RL jobs write each new checkpoint to the same path: the
    model's name alone would hand a restarted engine the routes of the previous weights. Reads
    each weight file's name and size and three 64 KiB samples (start, middle, end; a training
    step changes every tensor), plus ``config.json``: milliseconds for any model size.
    """
    root = Path(path)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(f for f in root.iterdir() if f.is_file() and (f.suffix in _WEIGHT_SUFFIXES or f.name == "config.json"))
    else:
        return ""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            for offset in sorted({0, max(size // 2 - _SAMPLE // 2, 0), max(size - _SAMPLE, 0)}):
                fh.seek(offset)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()[:16]


def route_fingerprint(
    model: str, *, num_layers: int, top_k: int, num_experts: int, dtype: str, block_size: int, hash_algo: str,
    weights: str = "",
) -> str:
    """Short stable digest of what makes route objects interchangeable across instances.

    Same model name/path, weights (``weights``: :func:`checkpoint_digest`, and the compute dtype
    and quantization, which route differently too), route shape, hash block size and hash
    algorithm give the same fingerprint in every process and after restarts; anything else
    gives another one.
    """
    ident = {
        "weights": weights,
        "model": model,
        "layers": num_layers,
        "top_k": top_k,
        "experts": num_experts,
        "dtype": dtype,
        "block": block_size,
        "hash": hash_algo,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def model_keyspace(namespace: str, fingerprint: str, life: str = "") -> KeySpace:
    """``<namespace>/m<fingerprint>``: the keyspace an engine publishes and reads under."""
    return KeySpace(f"{namespace}/m{fingerprint}", life)
