"""Fail closed on impossible route rows: one vectorized check of each step's captured rows.

A router's top-k picks ``top_k`` distinct experts out of ``num_experts`` for every (token, layer).
A row that breaks this (an id out of range, an expert twice in one row, and so an all-zero row
wherever ``top_k >= 2``) cannot have come from the router: it is what a kernel path that
bypassed selection leaves in a capture buffer (the bug class reported across engines as silent
all-zero or duplicate-id routes). ``RowCheck`` finds such rows so the connector can keep them
from ever being stored or returned (``WorkerConnector(row_check=...)``: the request gets an
error and recomputes, and fails alone if it keeps producing them).

Cost (``benchmarks/dataplane.py`` prints it next to the connector's own, same run): the common
row shape, 8 one-byte ids (top-8 of up to 256 experts), is checked as one 64-bit word per
(token, layer): four byte rotations find any repeated byte and one add finds an id out of
range, compiled with numba (installed with vLLM) where it is importable, else in numpy. Other
shapes compare each pair of slots. An all-zero row of a ``top_k == 1`` model is possible
(expert 0) and is not flagged.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from auxout.profile import RouteProfile

try:  # (a dependency of vLLM: present wherever routes are captured; numpy otherwise)
    import numba
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None
else:
    # vLLM-CPU's kernel registration, at every engine start, calls vars() on every module-level
    # object (vllm.triton_utils.dispatcher._rebind_kernels); llvmlite's ``ffi.lib`` answers
    # ``__dict__`` with a wrapped function, so each in-process engine started after numba was
    # imported failed (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'). An empty
    # entry under that name (never an llvmlite function) gives vars() a dict.
    try:
        from llvmlite.binding import ffi as _llvm_ffi

        _llvm_ffi.lib._fntab["__dict__"] = {}
    except (ImportError, AttributeError):  # pragma: no cover - another llvmlite layout
        pass

_H = np.uint64(0x8080808080808080)  # the top bit of each byte lane
_LOW = np.uint64(0x0101010101010101)  # 1 in each byte lane


def _rows_of_words(words: np.ndarray, limit: np.uint64, in_range: np.uint64, out: np.ndarray) -> int:
    """``out[t]``: whether token row ``t`` of ``words`` (``uint64 [T, L]``, a (token, layer) row
    of 8 one-byte ids each) repeats an id within a word or holds an id out of range; returns how
    many rows are bad. ``limit`` (``0x80 - num_experts`` in every lane) added to a lane sets its
    top bit exactly when the id is ``>= num_experts`` (a carry out of a lane only comes from a
    lane already out of range); ``in_range``: the top bits when ``num_experts <= 128``, else 0
    (the caller checks the range apart)."""
    h, low, lim, rng = _H, _LOW, limit, in_range  # (all uint64: a Python int this large types as float)
    s8, s16, s24, s32 = np.uint64(8), np.uint64(16), np.uint64(24), np.uint64(32)
    s56, s48, s40 = np.uint64(56), np.uint64(48), np.uint64(40)
    n_bad = 0
    for t in range(words.shape[0]):
        acc = np.uint64(0)
        for layer in range(words.shape[1]):
            w = words[t, layer]
            # a byte equal to the byte 1, 2, 3 or 4 lanes away (cyclic: every pair) -> a zero byte
            v = w ^ ((w << s8) | (w >> s56))
            z = (v - low) & ~v
            v = w ^ ((w << s16) | (w >> s48))
            z |= (v - low) & ~v
            v = w ^ ((w << s24) | (w >> s40))
            z |= (v - low) & ~v
            v = w ^ ((w << s32) | (w >> s32))
            z |= (v - low) & ~v
            acc |= z | (((w + lim) | w) & rng)
        bad = (acc & h) != 0
        out[t] = bad
        n_bad += bad
    return n_bad


def _rows_of_slots(ids: np.ndarray, num_experts: int, top_k: int, out: np.ndarray) -> int:
    """``out[t]``: whether token row ``t`` of ``ids`` (``[T, L, top_k]``) has an id out of range or
    an expert twice in one (token, layer) row; returns how many rows are bad."""
    n_bad = 0
    for t in range(ids.shape[0]):
        bad = False
        for layer in range(ids.shape[1]):
            for a in range(top_k):
                x = ids[t, layer, a]
                bad |= x >= num_experts
                for b in range(a + 1, top_k):
                    bad |= ids[t, layer, b] == x
        out[t] = bad
        n_bad += bad
    return n_bad


_words_kernel: Callable[..., int] | None = None
_slots_kernel: Callable[..., int] | None = None
if numba is not None:
    _words_kernel = numba.njit(nogil=True, cache=True, boundscheck=False)(_rows_of_words)
    _slots_kernel = numba.njit(nogil=True, cache=True, boundscheck=False)(_rows_of_slots)


def _words_numpy(words: np.ndarray, limit: np.uint64, in_range: np.uint64, out: np.ndarray) -> int:
    """``_rows_of_words`` in whole-array numpy calls (no numba)."""
    h, low = _H, _LOW
    acc = (words | (words + limit)) & in_range
    for r in (8, 16, 24, 32):
        v = words ^ ((words << np.uint64(r)) | (words >> np.uint64(64 - r)))
        acc |= (v - low) & ~v
    np.not_equal(np.bitwise_or.reduce(acc & h, axis=1), 0, out=out)
    return int(np.count_nonzero(out))


def _slots_numpy(ids: np.ndarray, num_experts: int, top_k: int, out: np.ndarray) -> int:
    """``_rows_of_slots`` in whole-array numpy calls (no numba)."""
    bad = (ids >= num_experts).any(axis=(1, 2))
    for a in range(top_k):
        for b in range(a + 1, top_k):
            bad |= (ids[:, :, a] == ids[:, :, b]).any(axis=1)
    out[:] = bad
    return int(np.count_nonzero(out))


class RowCheck:
    """The impossible token rows of a step's snapshot (``[n, layers, top_k]`` of a profile's dtype)."""

    def __init__(self, profile: RouteProfile) -> None:
        self.profile = profile
        self.num_experts = profile.num_experts
        self.top_k = profile.top_k
        id_dtype = profile.id_dtype
        # ids as 64-bit words: top-8 one-byte ids, rows of ids only (no weights between them)
        self._words = id_dtype.itemsize == 1 and self.top_k == 8 and not profile.weights
        over = 1 << (8 * id_dtype.itemsize)
        small = self.num_experts <= 128  # (the range in the words' top bits; else by a max apart)
        self._limit = np.uint64((0x80 - self.num_experts) * 0x0101010101010101 if small else 0)
        self._in_range = _H if small else np.uint64(0)
        self._range_apart = self._words and 128 < self.num_experts < over
        self._needs_check = self.top_k >= 2 or self.num_experts < over
        self._out = np.zeros(0, dtype=bool)
        self.bad_rows = 0  # token rows found impossible, over the check's life (a counter for metrics)
        if numba is not None:  # compile now (or load the cached build), not in the first step
            sample = profile.empty(1)
            ids = np.broadcast_to(np.arange(self.top_k, dtype=id_dtype), (1, profile.num_layers, self.top_k))
            if profile.weights:
                sample["id"], sample["w"] = ids, 0.0
            else:
                sample[:] = ids
            self(sample)

    def __call__(self, rows: np.ndarray) -> np.ndarray | None:
        """None when every row is possible; else a bool mask over the rows (True: impossible)."""
        n = len(rows)
        if not n or not self._needs_check:
            return None
        out = self._out if len(self._out) >= n else np.zeros(max(n, 2 * len(self._out)), dtype=bool)
        self._out = out
        mask = out[:n]
        if self._words:
            words = rows.reshape(n, -1).view(np.uint64)
            count = (_words_numpy if _words_kernel is None else _words_kernel)(words, self._limit, self._in_range, mask)
            if self._range_apart and rows.max() >= self.num_experts:
                mask |= (rows >= self.num_experts).any(axis=(1, 2))
                count = int(np.count_nonzero(mask))
        else:
            ids = rows["id"] if self.profile.weights else rows
            count = (_slots_numpy if _slots_kernel is None else _slots_kernel)(ids, self.num_experts, self.top_k, mask)
        if not count:
            return None
        self.bad_rows += int(count)
        return mask.copy()

    def reason(self, rows: np.ndarray, i: int) -> str:
        """What is impossible about token row ``i`` (its first bad (layer, slots)), for an error."""
        ids = np.asarray(rows["id"] if self.profile.weights else rows)[i]
        for layer, row in enumerate(ids.tolist()):
            out = [x for x in row if x >= self.num_experts]
            if out:
                return f"MoE layer {layer} routes to expert {out[0]}, but the model has {self.num_experts} experts"
            if len(set(row)) < len(row):
                what = "all zeros" if not any(row) else "a repeated expert"
                return f"MoE layer {layer} has {what} among its top-{self.top_k} ids {row}"
        return "no impossible (layer, slots) row"  # (not reached for a row the check flagged)


__all__ = ["RowCheck"]
