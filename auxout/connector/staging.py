"""Bounded, preallocated staging pool for rows that cannot go to the store yet.

Two kinds of rows wait here: the incomplete tail block of each running request, and complete
blocks whose key is not known yet (a decode block's hash arrives one step after its rows).
Full aligned blocks with keys never enter the pool: they are published straight from the
step's rows. Slots are explicit integer handles; the owner (the worker connector) tracks which
request holds which slot.
"""

from __future__ import annotations

import math

import numpy as np

from auxout.errors import PoolExhaustedError
from auxout.profile import RouteProfile


def staging_pool_blocks(
    *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_concurrent_batches: int
) -> int:
    """Worst case: every in-flight step's full blocks wait for keys, plus one tail per request."""
    per_step = math.ceil(max_num_batched_tokens / block_size) + max_num_seqs
    return max_concurrent_batches * per_step + 2 * max_num_seqs


class StagingPool:
    """``num_blocks`` slots of one hash block of rows each."""

    def __init__(self, profile: RouteProfile, block_size: int, num_blocks: int) -> None:
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError(f"StagingPool needs positive block_size and num_blocks, got {block_size}, {num_blocks}")
        self.profile = profile
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = np.zeros((num_blocks, block_size, *profile.shape_per_token), dtype=profile.dtype)
        self.blocks.fill(0)  # fault the pages in now, not on the first steps that stage rows
        # the same memory as [num_blocks * block_size, token_nbytes]: row-wise copies in one call
        self.token_rows = self.blocks.reshape(num_blocks * block_size, -1)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` slots; fails closed (nothing taken) when fewer are free."""
        if n == 0:
            return np.empty(0, dtype=np.int64)
        if n > len(self._free):
            raise PoolExhaustedError(
                f"staging pool is exhausted: need {n} block slots, {len(self._free)} of {self.num_blocks} free "
                "(the pool is sized from max_num_seqs, max_num_batched_tokens and max_concurrent_batches; "
                "the engine scheduled beyond them)"
            )
        out = np.array(self._free[-n:][::-1], dtype=np.int64)
        del self._free[-n:]
        return out

    def free(self, slots: np.ndarray | list[int]) -> None:
        self._free.extend(np.asarray(slots, dtype=np.int64).ravel()[::-1].tolist())

    def reset(self) -> None:
        self._free = list(range(self.num_blocks - 1, -1, -1))
