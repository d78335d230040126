"""Store keys derived from the engine's chained KV block hashes.

A block hash identifies the whole prefix ending at that block (it is chained), so identical
prefixes share keys. Hashes do not encode model weights, so every key also carries the
prefix-cache *generation*: after a reset (an RL weight update) old routes can never be served.
The namespace separates engine instances and data-parallel ranks sharing one external store.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
    """Turns block hashes into store keys: ``auxout/r3/<namespace>/g<generation>/<hex>``."""

    namespace: str = "local"

    def __post_init__(self) -> None:
        if not self.namespace or any(c.isspace() for c in self.namespace) or ".." in self.namespace:
            raise ValueError(f"invalid key namespace {self.namespace!r}: non-empty, no spaces, no '..'")

    def prefix(self, generation: int) -> str:
        return f"{KEY_PREFIX}/{self.namespace}/g{generation}/"

    def keys(self, hashes: PackedHashes | Sequence[bytes], generation: int) -> list[str]:
        p = self.prefix(generation)
        if isinstance(hashes, PackedHashes):
            hx = hashes.data.hex()
            n = 2 * hashes.item_size
            return [p + hx[i : i + n] for i in range(0, len(hx), n)]
        return [p + h.hex() for h in hashes]

    @classmethod
    def for_instance(cls, instance: str, dp_rank: int = 0) -> KeySpace:
        """Namespace for one engine instance and data-parallel rank (never mixed in a shared store)."""
        return cls(f"{instance}/dp{dp_rank}")
