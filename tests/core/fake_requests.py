"""The smallest engine request the scheduler connector reads, and block hashes for it (shared by tests)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Req:
    request_id: str
    num_tokens: int
    num_output_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)


def h(i: int) -> bytes:
    """A distinct fake block hash per integer."""
    return i.to_bytes(8, "big")
