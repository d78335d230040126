"""Worker side (data plane): turns each step's captured rows into per-request route chunks.

Per step the engine calls ``begin_step(metadata)``, runs the forward (capture fills one rows
array for the whole batch), calls ``prepare_output(...)`` and, once the step's sampled and
rejected counts are known, ``process_output(...)``; a steady decode step may instead go through
``commit_lane_step`` (the three calls in one), and its output may be predicted before any of
them (``peek_lane_step``). The connector

- drops rows of rejected speculative tokens and re-attaches rows of a step that was scheduled
  optimistically on top of rejected drafts,
- stages incomplete tail blocks and complete-but-unkeyed blocks in a bounded pool, and
  publishes complete keyed blocks to the store (the whole batch before any read),
- emits every request's not-yet-emitted rows from its own emit cursor, reading cached prefix
  blocks back from the store,
- defers the teardown of finished requests while step outputs covering them are in flight.

A step is committed by one of three paths in ``_commit``: the decode lane (``DecodeLane``, the
same batch decoding step after step), the one-row decode step (``_commit_decode``), or the
general commit below them; requests that cannot continue are cut out first
(``_commit_apart``). Around this module:

- ``slot_table``: per-request state (cursors, tails, keys, pins) by *request slot*,
- ``decode_lane``: the decode lane, whose held-back writes the table runs before any access,
- ``store_io``: publishing to the store and reading rows back (``StoreWriter``, ``StoreReader``),
- ``pending_step``: a registered step and the cuts made on it,
- ``staging``: the pool of *pool blocks* holding rows that cannot go to the store yet.

What stays here (about 800 lines) is the step API and the three commit paths: they read and
advance the same step and slot state (tests/core/test_sim_properties.py checks each against
the full-forward oracle).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from auxout.connector.decode_lane import DecodeLane, LaneStats
from auxout.connector.messages import NO_EMIT, StepMetadata, StepOutput
from auxout.connector.pending_step import (
    PendingStep,
    broken_capture_reasons,
    check_counts,
    impossible_reasons,
    rejoin,
    row_ranges,
    without,
)
from auxout.connector.slot_table import SlotTable
from auxout.connector.staging import StagingPool, staging_pool_blocks
from auxout.connector.store_io import StoreReader, StoreWriter
from auxout.errors import (
    InvariantError,
)
from auxout.keys import ChainKeys, KeySpace, PackedHashes
from auxout.metrics import COUNTS
from auxout.profile import RouteProfile
from auxout.stores.base import BlockObjects, BlockStore, StoreObject
from auxout.stores.rows import StoreRows

if TYPE_CHECKING:  # (auxout.connector.row_check loads numba: only the engines that check rows import it)
    from auxout.connector.row_check import RowCheck

_I64 = np.int64


# A lane step drains the store's lost keys only every this many steps, or when it publishes
# (an in-process store evicts only then; a background writer's drops are reported this late)
_LANE_DRAIN_EVERY = 16


class WorkerConnector:
    """Data plane of one engine (on the output rank only)."""

    def __init__(
        self,
        profile: RouteProfile,
        *,
        block_size: int,
        store: BlockStore,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_concurrent_batches: int = 1,
        keyspace: KeySpace | None = None,
        weights_digest: Callable[[], str] | None = None,
        row_check: RowCheck | None = None,
    ) -> None:
        """``weights_digest``: where routes are shared with other engines, names each generation
        after a prefix-cache reset by the weights the engine then runs (``KeySpace.weights``;
        called once per generation, reported to the scheduler with the next output).
        ``row_check``: checks every step's rows (``auxout.connector.row_check``); a request with a row no
        router can produce is committed apart: nothing of it is stored or emitted, and it gets
        an error (the engine recomputes it, and fails it alone if that keeps happening)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size!r}")
        if max_concurrent_batches <= 0:
            raise ValueError(f"max_concurrent_batches must be positive, got {max_concurrent_batches!r}")
        expected = profile.block_nbytes(block_size)
        if store.object_nbytes < expected:
            raise ValueError(
                f"store object_nbytes={store.object_nbytes} is smaller than one hash block of routes "
                f"({block_size} tokens × {profile.token_nbytes} B = {expected} B)"
            )
        self.profile = profile
        self._row_dtype, self._row_shape = profile.dtype, profile.shape_per_token  # (checked every step)
        self.block_size = block_size
        self.store = store
        self.keyspace = keyspace or KeySpace()
        self._chains = ChainKeys(self.keyspace, capacity=2 * max_num_seqs)  # keys of finished requests
        self.max_concurrent_batches = max_concurrent_batches
        self._block_nbytes = expected
        self._token_nbytes = profile.token_nbytes
        self.generation = 0
        self._weights_digest = weights_digest
        self._weights_report: tuple[int, str] | None = None  # for the next StepOutput
        self.pool = StagingPool(
            profile,
            block_size,
            staging_pool_blocks(
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_concurrent_batches=max_concurrent_batches,
            ),
        )
        self._table = SlotTable(max(8, 2 * max_num_seqs), block_size)  # per-request state, by request slot
        self._pending_steps: list[PendingStep] = []
        self._void_seqs: set[int] = set()  # in-flight steps voided by a generation change
        self._awaiting: set[int] = set()  # finished request slots whose teardown waits for in-flight outputs
        self._step_ready = False
        self._seq = 0
        self._closed = False
        self._writer = StoreWriter(profile, block_size, store, self.pool)
        self._reader = StoreReader(profile, block_size, store, self._table, self.pool)
        # (table epoch, request ids, request slots) of the last batch seen by begin_step /
        # prepare_output, valid while the epoch stands (a decode step repeats its batch: no
        # per-request lookups then)
        self._begin_cache: tuple[int, list[str], np.ndarray] | None = None
        self._prepare_cache: tuple[int, list[str], np.ndarray] | None = None
        self._lane: DecodeLane | None = None
        self._lane_candidate: np.ndarray | None = None  # request slots of the last decode step
        self.lane_stats = LaneStats()
        self._row_check = row_check
        self._checked: tuple[np.ndarray | None, int, np.ndarray | None] = (None, 0, None)  # (rows, n, result)
        self.impossible_requests = 0  # request steps refused for impossible rows (a counter for metrics)

    # -- request slots -------------------------------------------------------------------------
    def _teardown(self, slots: Sequence[int]) -> list[str]:
        """Free request slots; returns their keys in release order (each chain tail-first)."""
        self._leave_lane()
        release, pool_blocks = self._table.free(slots)
        self._awaiting.difference_update(slots)
        if pool_blocks:
            self.pool.free(pool_blocks)
        return release

    def _name_generation(self, digest: Callable[[], str]) -> None:
        """Key the new generation by the weights it runs (an empty digest: by this engine's life
        token, which nobody else shares: correct, not shared)."""
        self.keyspace = replace(self.keyspace, weights=digest())  # (validates the digest)
        self._chains.keyspace = self.keyspace
        self._weights_report = (self.generation, self.keyspace.weights)

    # -- step API ---------------------------------------------------------------------------
    def begin_step(self, meta: StepMetadata | None) -> None:
        """Apply one step's metadata; ``None`` marks an internal (warm-up/dummy) step."""
        table = self._table
        if self._closed:  # (checked inline: a call per hook runs cold)
            self._check_open()
        self._step_ready = meta is not None
        if meta is None:
            return
        if meta.generation < self.generation:
            raise InvariantError(
                f"metadata generation moved backwards: {meta.generation} < {self.generation}"
            )
        release: list[str] = []
        if meta.generation > self.generation:
            # A reset with steps in flight (async scheduling): the engine drops their outputs
            # (the requests were preempted), so they are voided here: nothing of theirs is
            # published or emitted, and they no longer hold the slots being torn down.
            self._void_seqs.update(p.seq for p in self._pending_steps)
            # (requests that finished with an output in flight too: their teardown waited for it)
            release = self._teardown(list(table.slot_of.values()) + sorted(self._awaiting))
            table.slot_of.clear()
            self.pool.reset()
            table.tail[:] = -1
            self.generation = meta.generation
            if self._weights_digest is not None:
                self._name_generation(self._weights_digest)
        slot_of = table.slot_of
        retain: list[str] = []
        keyed: list[int] = []
        done: list[int] = []
        # terminal events first: a request may end one incarnation and start the next this step
        if meta.finished:
            table.epoch += 1  # (an id may come back with a new request slot while the old one awaits teardown)
        for rid in meta.finished:
            s = slot_of.pop(rid, None)
            if s is None:
                raise InvariantError(f"terminal event for request {rid!r} which the worker does not track")
            packed = meta.final_hashes.get(rid)
            if packed is None and rid not in meta.requests:  # older engines: trailing hashes ride along
                packed = meta.block_hashes.get(rid)
            if packed is not None:
                table.hashes[s].append(packed)
                table.sync_pins(table.add_keys([s], [self.keyspace.keys(packed, self.generation)]), retain, release)
            self._remember_chain(s)
            if table.staged[s]:
                keyed.append(s)
            if not self._busy(s):
                done.append(s)
            else:
                self._awaiting.add(s)
        reqs = meta.requests
        names = list(reqs)
        cache = self._begin_cache
        steady = False
        if cache is not None and cache[0] == table.epoch and cache[1] == names:
            known = cache[2]  # (the same batch as the last step: every request slot known)
            old = None
            lane = self._lane
            if lane is not None and not self._pending_steps:  # the lane's next step: starts as it expects
                expect = lane.emit_starts(known)  # (plain lists: no numpy call, cold here)
                steady = expect is not None and expect == list(reqs.values())
                self.lane_stats.begins += steady
        else:
            known = np.fromiter(map(slot_of.get, names, repeat(-1, len(names))), dtype=_I64, count=len(names))
            old = known >= 0
        if len(known) and not steady:
            starts = np.fromiter(reqs.values(), dtype=_I64, count=len(reqs))
            all_old = old is None or np.count_nonzero(old) == len(old)
            ks, ss = (known, starts) if all_old else (known[old], starts[old])
            emit = table.emit[ks]
            # (equal bytes: the steady state, checked without a ufunc, which costs ~20 us cold after a forward)
            if ss.tobytes() != emit.tobytes() and np.count_nonzero(ss > emit):  # ahead, unless output is in flight
                idle = np.array([not self._busy(s) for s in ks.tolist()], dtype=bool)
                ahead = idle & (ss > emit)
                if np.count_nonzero(ahead):
                    i = int(np.flatnonzero(known >= 0)[np.argmax(ahead)])
                    rid = list(reqs)[i]
                    raise InvariantError(
                        f"scheduler emit cursor moved ahead of the worker for request {rid!r}: "
                        f"emit_start={int(starts[i])}, worker emitted up to {int(table.emit[known[i]])}"
                    )
            if not all_old:
                assert old is not None
                for i in np.flatnonzero(~old).tolist():
                    table.new(names[i], int(starts[i]))
            elif cache is None or known is not cache[2]:
                self._begin_cache = (table.epoch, names, known)
        self._apply_hashes(meta, retain, release, keyed, done)

    def _apply_hashes(
        self, meta: StepMetadata, retain: list[str], release: list[str], keyed: list[int], done: list[int]
    ) -> None:
        """The rest of ``begin_step``: new block hashes become keys (a block staged for its key is
        published), pins follow, finished requests in ``done`` are torn down; one store call."""
        table = self._table
        reqs = meta.requests
        slot_of = table.slot_of
        hashed: list[int] = []
        packs: list[PackedHashes] = []
        for rid, packed in meta.block_hashes.items():
            if rid not in reqs and rid in meta.finished:
                continue  # applied with its terminal event above
            s = slot_of.get(rid)
            if s is None:
                raise InvariantError(f"block hashes for request {rid!r} which the worker does not track")
            hashed.append(s)
            packs.append(packed)
        for s, pack in zip(hashed, packs):
            table.hashes[s].append(pack)
        if hashed:
            sources: list[tuple[list[str], int] | None] | None = [] if done else None
            idx = table.add_keys(hashed, self._chains.keys_batch(packs, self.generation, sources))
            keyed.extend(s for s in hashed if table.staged[s])
            if sources and sources.count(None) != len(sources):
                table.inherit_pins(hashed, sources, done)
            table.sync_pins(idx, retain, release)
        objects: Sequence[StoreObject] = ()
        keys, pool_blocks = table.take_keyed_staged(keyed) if keyed else ([], [])
        if keys:  # (copied out now: the teardown may free their pool blocks)
            objects = self._writer.objects_from_pool(keys, pool_blocks)
        if done:
            release.extend(self._teardown(done))
        if objects or retain or release:
            self._writer.put(objects, retain, release)
        if pool_blocks:
            self.pool.free(pool_blocks)

    def _busy(self, s: int) -> bool:
        """Whether a prepared step whose output is not processed yet (and not voided) covers request slot ``s``.

        Asked only at terminal events and the rare checks around them: counting per step would
        cost a gather, an add and a scatter on every prepare and every process.
        """
        void = self._void_seqs
        return any(p.seq not in void and s in p.slots.tolist() for p in self._pending_steps)

    def _remember_chain(self, s: int) -> None:
        """Offer a finished request's keys for reuse: a next turn re-sends this history."""
        table = self._table
        chain = table.hashes[s]
        if len(chain) == 1:
            self._chains.remember(chain[0].data, chain[0].item_size, table.keys[s], self.generation)
        elif chain and all(p.item_size == chain[0].item_size for p in chain):
            self._chains.remember(b"".join([p.data for p in chain]), chain[0].item_size, table.keys[s], self.generation)

    def prepare_output(
        self,
        req_ids: Sequence[str],
        token_starts: Sequence[int] | np.ndarray,
        query_start_loc: Sequence[int] | np.ndarray,
        rows: np.ndarray,
    ) -> PendingStep | None:
        """Register one executed step. ``rows`` must be a snapshot the engine never mutates again.

        ``token_starts[i]`` is request i's computed-token count before the step (as scheduled);
        its rows are ``rows[query_start_loc[i]:query_start_loc[i+1]]``. Trailing padding entries
        of ``query_start_loc`` (CUDA-graph padding) are ignored.
        """
        table = self._table
        if self._closed:  # (checked inline: a call per hook runs cold)
            self._check_open()
        if not self._step_ready:
            return None
        if len(self._pending_steps) >= self.max_concurrent_batches:
            raise InvariantError(
                f"step outputs are not consumed in order: {len(self._pending_steps)} unprocessed, "
                f"limit max_concurrent_batches={self.max_concurrent_batches}"
            )
        n = len(req_ids)
        qsl = np.array(query_start_loc[: n + 1], dtype=_I64)
        ts = np.array(token_starts[:n], dtype=_I64)
        if len(qsl) != n + 1 or len(ts) != n:
            raise InvariantError(f"step of {n} requests needs {n + 1} query_start_loc and {n} token_starts")
        prof = self.profile
        if not self._fits_profile(rows):
            raise InvariantError(
                f"captured rows profile changed: got {rows.dtype}{list(rows.shape[1:])}, "
                f"expected {prof.dtype}{list(prof.shape_per_token)}"
            )
        if n and int(qsl[-1]) > len(rows):
            raise InvariantError(f"step claims {int(qsl[-1])} rows but the snapshot has {len(rows)}")
        ids = list(req_ids)
        cache = self._prepare_cache
        if cache is not None and cache[0] == table.epoch and cache[1] == ids:
            slots = cache[2]  # (the same batch as the last step)
        else:
            try:
                slots = np.fromiter(map(table.slot_of.__getitem__, ids), dtype=_I64, count=n)
            except KeyError as exc:
                raise InvariantError(f"request {exc.args[0]!r} executed but was never announced in metadata") from None
            self._prepare_cache = (table.epoch, ids, slots)
        if not rows.flags.c_contiguous:
            rows = np.ascontiguousarray(rows)
        step = PendingStep(self._seq, ids, slots, ts, qsl, rows)
        if self._row_check is not None and n:
            step.impossible = self._impossible(rows, int(qsl[-1]))
        self._seq += 1
        self._pending_steps.append(step)
        return step

    def process_output(
        self,
        pending: PendingStep,
        num_sampled: Sequence[int] | np.ndarray | None = None,
        num_rejected: Sequence[int] | np.ndarray | None = None,
    ) -> StepOutput:
        """Commit one step (strictly in step order) and return what each request emits.

        Rows are kept as captured, sampled or not: only ``num_rejected`` (draft tokens rejected
        per request; None: none) changes what is kept. ``num_sampled`` is checked for length
        when given.
        """
        if self._closed:  # (checked inline: a call per hook runs cold)
            self._check_open()
        if not self._pending_steps or self._pending_steps[0] is not pending:
            raise InvariantError("step outputs must be processed in the order they were prepared")
        if self._weights_report is not None:  # (once per generation: the scheduler learns its keys)
            report, self._weights_report = self._weights_report, None
            out = self.process_output(pending, num_sampled, num_rejected)
            out.weights = report
            return out
        n = len(pending.req_ids)
        if pending.seq in self._void_seqs:
            self._void_seqs.discard(pending.seq)
            self._pending_steps.pop(0)
            none = np.full(n, -1, dtype=_I64)
            published, lost = self._writer.events()
            return StepOutput(
                list(pending.req_ids), pending.token_starts.copy(), none, none.copy(), pending.rows[:0],
                published=published, lost=lost,
            )  # fmt: skip
        try:
            if (num_sampled is not None and len(num_sampled) < n) or (num_rejected is not None and len(num_rejected) < n):
                raise InvariantError(f"step of {n} requests needs {n} sampled and rejected counts")
            rejected = None if num_rejected is None else np.asarray(num_rejected, dtype=_I64)[:n]
            return self._commit(pending, rejected)
        finally:
            self._pending_steps.pop(0)
            awaiting = self._awaiting
            if awaiting:  # finished requests this was the last output of
                done = [s for s in pending.slots.tolist() if s in awaiting and not self._busy(s)]
                if done:
                    self._writer.put([], (), self._teardown(done))

    # -- the heart of the data plane ----------------------------------------------------------
    def _commit(self, p: PendingStep, rejected: np.ndarray | None) -> StepOutput:
        table = self._table
        if p.impossible is not None:
            return self._commit_impossible(p, rejected)
        none_rejected = rejected is None or not np.count_nonzero(rejected)
        lane = self._lane
        if lane is not None:
            out = self._lane_step(p, lane) if none_rejected and p.slots is lane.slots else None
            if out is not None:
                return out
            self._leave_lane()
        bs = self.block_size
        slots, rows, ts = p.slots, p.rows, p.token_starts
        if none_rejected:
            q = p.query_start_loc.tolist()
            if q == list(range(q[0], q[0] + len(q))):  # one row each, none rejected: nothing for check_counts
                out = self._commit_decode(p)
                if out is not None:
                    return out
        if rejected is None:
            rejected = np.zeros(len(slots), dtype=_I64)
        qs, qe = p.query_start_loc[:-1], p.query_start_loc[1:]
        n_exec = qe - qs
        check_counts(p, n_exec, rejected)
        kept = n_exec - rejected

        cur = table.capture[slots]
        fresh = cur < 0
        cur = np.where(fresh, ts, cur)
        gap = ts > cur
        cap = np.where(gap, cur, ts)  # re-attach rows of an optimistic schedule at the real cursor
        cap_off = cap % bs
        has_head = cap_off != 0
        broken = (ts < cur) | (fresh & has_head)
        if np.count_nonzero(gap):
            broken |= gap & (cur >= table.sched[slots])
        if np.count_nonzero(broken):
            return self._commit_apart(p, rejected, broken, broken_capture_reasons(p, broken, fresh, cur, bs))
        end = cap + kept
        table.capture[slots] = end
        table.sched[slots] = ts + n_exec

        # -- staging: continue open tails, pass full blocks through, open new tails ------------
        head_blk = cap // bs
        first_full = head_blk + has_head
        stop_full = end // bs
        end_off = end % bs
        hidx = np.flatnonzero(has_head)
        trail_idx = np.flatnonzero((end_off != 0) & (stop_full >= first_full))
        old_tail = table.tail[slots]
        head_done = hidx  # indices of the open tails this step fills (none without a head)
        if len(hidx) or len(trail_idx):  # (requests starting and ending on block boundaries stage nothing)
            head_end = first_full[hidx] * bs
            if np.count_nonzero(old_tail[hidx] < 0):
                raise InvariantError("open tail block lost its staging pool block")
            new_tail = self.pool.alloc(len(trail_idx))
            hcount = np.minimum(end[hidx], head_end) - cap[hidx]
            tcount = end_off[trail_idx]
            seg_src = np.concatenate([qs[hidx], qs[trail_idx] + (end[trail_idx] - tcount - cap[trail_idx])])
            seg_block = np.concatenate([old_tail[hidx], new_tail])  # (pool blocks)
            seg_local = np.concatenate([cap_off[hidx], np.zeros(len(trail_idx), dtype=_I64)])
            seg, off = row_ranges(seg_src, np.concatenate([hcount, tcount]))
            # row-wise copy through 2-D byte views: one gather + one scatter of whole token rows
            self.pool.token_rows[seg_block[seg] * bs + seg_local[seg] + off] = rows.reshape(len(rows), -1)[
                seg_src[seg] + off
            ]
            head_done = hidx[end[hidx] >= head_end]
            tail = old_tail.copy()
            tail[head_done] = -1
            tail[trail_idx] = new_tail
            table.tail[slots] = tail

        # -- publish complete keyed blocks (whole batch, before any read) ----------------------
        retain: list[str] = []
        release: list[str] = []
        table.sync_pins(slots, retain, release)  # (pins follow the capture cursors just moved)
        nbytes = self._block_nbytes
        objects = BlockObjects(nbytes=nbytes)
        pub_keys: list[str] = []  # filled pool blocks to publish, and their keys
        pub_blocks: list[int] = []
        if len(head_done):
            self._key_or_stage(
                slots[head_done].tolist(), head_blk[head_done].tolist(), old_tail[head_done].tolist(),
                pub_keys, pub_blocks,
            )  # fmt: skip
        stage_views: list[tuple[int, int, int]] = []  # (request slot, block index, row start in `rows`)
        flat = rows.reshape(-1).view(np.uint8)
        todo = np.flatnonzero(stop_full > first_full)  # full blocks in this step's rows
        keys_of = table.keys
        token_nbytes = self._token_nbytes
        run_keys: list[str] = []  # keyed full blocks adjacent in `rows`: one zero-copy view of bytes [run0, run1)
        run0 = run1 = 0
        for s, b0, b1, base in zip(
            slots[todo].tolist(), first_full[todo].tolist(), stop_full[todo].tolist(), (qs[todo] - cap[todo]).tolist()
        ):
            keys = keys_of[s]
            kb = min(b1, len(keys))
            if kb > b0:
                byte0 = (base + b0 * bs) * token_nbytes
                if byte0 != run1 and run_keys:
                    objects.add(run_keys, flat[run0:run1].reshape(-1, nbytes))
                    run_keys = []
                if not run_keys:
                    run0 = byte0
                run_keys += keys[b0:kb]
                run1 = byte0 + (kb - b0) * nbytes
            for b in range(max(b0, kb), b1):
                stage_views.append((s, b, base + b * bs))
        if run_keys:
            objects.add(run_keys, flat[run0:run1].reshape(-1, nbytes))
        if stage_views:
            dst = self.pool.alloc(len(stage_views))
            src = np.array([v[2] for v in stage_views], dtype=_I64)
            self.pool.blocks[dst] = rows[src[:, None] + np.arange(bs, dtype=_I64)]
            for (s, b, _), d in zip(stage_views, dst.tolist()):
                table.staged[s][b] = d
        self._writer.publish(objects, pub_keys, pub_blocks, retain, release)

        # -- emit from each request's own cursor -------------------------------------------------
        emit = table.emit[slots]
        do_emit = emit <= end  # rows are emitted as soon as they are captured (not only when sampling)
        fast = do_emit & (emit >= cap)
        lo = np.where(fast, qs + (emit - cap), -1)
        hi = np.where(fast, qs + kept, -1)
        table.emit[slots[do_emit]] = end[do_emit]
        errors: dict[str, str] = {}
        heads: dict[str, tuple[np.ndarray | StoreRows, int]] = {}
        slow = np.flatnonzero(do_emit & (emit < cap))
        if len(slow):
            # rows emitted from before this step (cached prefix, earlier chunks) come from the
            # store (left in an in-process arena where it can: StoreRows), their own rows stay
            # in the snapshot: a two-part span, joined only by whoever needs one array
            n = len(rows)
            read, failed = self._reader.read_heads(slots, emit, cap, slow)
            for i, s, why, lost_keys in failed:
                errors[p.req_ids[i]] = why
                self._writer.lost.extend(lost_keys)
                # nothing delivered; the engine restarts this incarnation, whose steps still in
                # flight must neither emit nor report the failure again
                table.emit[s] = NO_EMIT
            for i, head in read:
                heads[p.req_ids[i]] = (head, int(qs[i]))
                lo[i] = n  # (the span counts as if the own rows followed the head: StepOutput.span_rows)
                hi[i] = n + len(head) + kept[i]
        published, lost = self._writer.events()
        return StepOutput(list(p.req_ids), emit, lo, hi, rows, errors, published, lost, heads)  # emit: a gathered copy

    def _impossible(self, rows: np.ndarray, n: int) -> np.ndarray | None:
        """``row_check`` of a step's first ``n`` rows, once per snapshot (a step sent ahead is
        checked when predicted, and committed with the same array)."""
        last, last_n, result = self._checked
        if rows is last and n == last_n:
            return result
        assert self._row_check is not None
        result = self._row_check(rows[:n])
        self._checked = (rows, n, result)
        return result

    def _commit_impossible(self, p: PendingStep, rejected: np.ndarray | None) -> StepOutput:
        """A step whose snapshot holds rows no router can produce: the requests they belong to are
        committed apart (nothing of theirs stored or emitted, an error each), the rest as usual."""
        assert self._row_check is not None
        self._leave_lane()
        reasons = impossible_reasons(p, self._row_check.reason)
        self.impossible_requests += len(reasons)
        COUNTS.add("invalid_rows_refused", len(reasons))
        p.impossible = None
        n = len(p.req_ids)
        broken = np.zeros(n, dtype=bool)
        broken[list(reasons)] = True
        return self._commit_apart(p, np.zeros(n, dtype=_I64) if rejected is None else rejected, broken, reasons)

    def _commit_apart(
        self, p: PendingStep, rejected: np.ndarray, broken: np.ndarray, reasons: dict[int, str]
    ) -> StepOutput:
        """Commit a step without the requests ``broken`` (``reasons``: why, by batch index).

        Each breaks an invariant that guards which rows belong to which tokens: it emits nothing
        and gets its reason in ``errors``, once per incarnation, so the engine recomputes it from
        a fresh incarnation (or fails it alone after repeated tries); the rest of the batch
        commits as usual.
        """
        emit = self._table.emit
        errors: dict[str, str] = {}
        for i in np.flatnonzero(broken).tolist():
            s = int(p.slots[i])
            if emit[s] != NO_EMIT:  # reported once per incarnation (later steps in flight stay silent)
                emit[s] = NO_EMIT
                errors[p.req_ids[i]] = reasons[i]
        keep = np.flatnonzero(~broken)
        if not len(keep):
            out = rejoin(p, keep, None, errors)
            out.published, out.lost = self._writer.events()
            return out
        return rejoin(p, keep, self._commit(without(p, keep), rejected[keep]), errors)

    def _commit_decode(self, p: PendingStep) -> StepOutput | None:
        """``_commit`` for the common decode step, in a third of the numpy calls; None if not one.

        Applies when every request executed exactly one token (checked by the caller) at its
        capture cursor with no draft rejected and nothing to read back from the store: each row
        extends (or opens) its request's staged tail block, and a tail that fills up is
        published or staged.
        """
        table = self._table
        bs = self.block_size
        slots, rows, ts = p.slots, p.rows, p.token_starts
        n = len(slots)
        if bs == 1 or n == 0:
            return None
        ts_bytes = ts.tobytes()  # (int64 both sides: equal bytes are equal cursors; cheaper than a compare)
        if table.capture[slots].tobytes() != ts_bytes:  # first capture, or re-attaching a draft gap
            return None
        emit = table.emit[slots]
        all_emit = emit.tobytes() == ts_bytes  # (the usual step: then none is behind)
        if not all_emit and np.count_nonzero(emit < ts):  # rows before this step must come from the store
            return None
        q0 = int(p.query_start_loc[0])
        end = ts + 1
        pos = ts % bs
        tail = table.tail[slots]  # (a gathered copy)
        opening = pos == 0
        n_open = int(np.count_nonzero(opening))
        if n_open:
            tail[opening] = self.pool.alloc(n_open)
        if tail.min() < 0:  # every row extends a staged tail, or the one just opened for it
            raise InvariantError("open tail block lost its staging pool block")
        self.pool.blocks[tail, pos] = rows[q0 : q0 + n]  # (two index arrays: no flat index to compute)
        fills = pos == bs - 1
        table.capture[slots] = end
        table.sched[slots] = end
        if np.count_nonzero(fills):
            done = np.flatnonzero(fills)
            self._publish_filled(slots[done], tail[done].tolist(), (ts[done] // bs).tolist())
            tail[done] = -1
        table.tail[slots] = tail

        qs = p.query_start_loc[:n]
        if all_emit:  # every request emits its one row (emit <= end)
            lo = qs
            hi = p.query_start_loc[1 : n + 1]  # (one row each: qs + 1; the pending step is dropped after)
            table.emit[slots] = end
            if slots is self._lane_candidate:  # the second such step of this batch: enter the lane
                self._lane = DecodeLane(self._table, self.pool, bs, slots, end, p.query_start_loc)
            self._lane_candidate = slots
        else:
            do_emit = emit <= end
            lo = np.where(do_emit, qs + (emit - ts), -1)
            hi = np.where(do_emit, qs + 1, -1)
            table.emit[slots[do_emit]] = end[do_emit]
        published, lost = self._writer.events()
        return StepOutput(p.req_ids, emit, lo, hi, rows, {}, published, lost)  # (req_ids: our copy)

    # -- the decode lane: a repeated decode batch ------------------------------------------------
    def _lane_step(self, p: PendingStep, lane: DecodeLane) -> StepOutput | None:
        """One decode step of the lane's batch (None: not one; the caller leaves the lane)."""
        ts = p.token_starts
        if not lane.expects(ts, p.query_start_loc):
            return None
        return self._lane_advance(lane, p.req_ids, ts, p.rows, ts.tolist() if lane.first_row == 0 else None)

    def _lane_advance(
        self, lane: DecodeLane, req_ids: list[str], ts: np.ndarray, rows: np.ndarray, one_row: list[int] | None
    ) -> StepOutput:
        """Commit the lane's next step (checked by the caller); publish the tails it filled."""
        due = lane.advance(rows)
        self.lane_stats.steps += 1
        if due is not None:
            filled = lane.take_filled(due)
            self._publish_filled(filled.slots, filled.pool_blocks, filled.block_index)
            lane.reopen(filled)
            published, lost = self._writer.events()  # (drained after the publication: its evictions included)
        elif not lane.steps % _LANE_DRAIN_EVERY:
            published, lost = self._writer.events()
        else:  # (the store's report of lost keys, a chain of calls that run cold, waits a few steps)
            published, lost = self._writer.events_undrained()
        # (one_row: the starts as a list when lo == arange(n), see StepOutput)
        return StepOutput(req_ids, ts, lane.lo, lane.hi, rows, {}, published, lost, one_row_starts=one_row)

    def peek_lane_step(
        self, meta: StepMetadata, req_ids: list[str], token_starts: list[int], query_start_loc: list[int],
        rows: np.ndarray,
    ) -> StepOutput | None:  # fmt: skip
        """What ``begin_step(meta)``, ``prepare_output(...)`` and ``process_output`` (no rejections)
        would return for the decode lane's next step, without doing any of it; None if the step
        is not that one (or could end otherwise: a terminal event, a new generation, a report due).

        Lets an engine send a steady decode step's output first and make the three calls after
        it (the connector's state moves only then; the caller checks they agree). The output's
        ``published``/``lost`` are empty: those calls report them, for a later output. The
        cursors come as plain lists (``query_start_loc`` with the ``n + 1`` entries of the batch):
        the check runs no numpy, whose first calls after a forward cost microseconds each.
        ``rows`` must have the profile's dtype and row shape (``prepare_output`` checks it, after);
        the output keeps ``req_ids`` (a list the caller no longer changes).
        """
        lane = self._lane_next(meta, req_ids, token_starts, query_start_loc, rows)
        if lane is None or (self._row_check is not None and self._impossible(rows, query_start_loc[-1]) is not None):
            return None
        return StepOutput(
            req_ids, lane.next_positions, lane.lo, lane.hi, rows, {}, [], [],
            one_row_starts=token_starts if lane.first_row == 0 else None,
        )  # fmt: skip

    def commit_lane_step(
        self, meta: StepMetadata, req_ids: list[str], token_starts: list[int], query_start_loc: list[int],
        rows: np.ndarray,
    ) -> StepOutput | None:  # fmt: skip
        """``begin_step(meta)``, ``prepare_output(...)`` and ``process_output`` (no rejections) in one
        call, for the decode lane's next step (the one ``peek_lane_step`` predicts), new block
        hashes included: the same output and the same state after. None, with nothing done,
        when the step is not that one (a terminal event, another batch, a new generation); the
        caller then makes the three calls. Those re-check with numpy what the lane already knows; this
        checks it once, with the plain lists the engine has. Arguments as
        for ``peek_lane_step``; ``rows`` must be C-contiguous (a snapshot is).
        """
        lane = self._lane_next(meta, req_ids, token_starts, query_start_loc, rows)
        if (
            lane is None or self._awaiting or not rows.flags.c_contiguous or not self._fits_profile(rows)
            or (self._row_check is not None and self._impossible(rows, query_start_loc[-1]) is not None)
        ):  # fmt: skip
            return None
        self._step_ready = True  # (begin_step: a steady step of the lane; new hashes are all it may bring)
        stats = self.lane_stats
        stats.begins += 1
        if meta.block_hashes:
            self._apply_hashes(meta, [], [], [], [])
        self._seq += 1  # (prepare_output: the step's sequence number, committed at once)
        stats.fused += 1
        return self._lane_advance(
            lane, req_ids, lane.next_positions, rows, token_starts if lane.first_row == 0 else None
        )

    def _fits_profile(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` are ``[n, *shape_per_token]`` of the profile's dtype (checked every step)."""
        dtype = rows.dtype
        return rows.ndim == 3 and (dtype is self._row_dtype or dtype == self._row_dtype) and rows.shape[1:] == self._row_shape

    def _lane_next(
        self, meta: StepMetadata, req_ids: list[str], token_starts: list[int], query_start_loc: list[int],
        rows: np.ndarray,
    ) -> DecodeLane | None:  # fmt: skip
        """The lane, if this is its next step as the three calls would find it (else None)."""
        lane = self._lane
        if (
            lane is None or self._closed or self._pending_steps or self.max_concurrent_batches != 1
            or meta.finished or meta.generation != self.generation or self._weights_report is not None
        ):  # fmt: skip
            return None
        begin, prep = self._begin_cache, self._prepare_cache
        epoch = self._table.epoch
        if begin is None or prep is None or begin[0] != epoch or prep[0] != epoch or prep[2] is not lane.slots:
            return None
        reqs = meta.requests
        if prep[1] != req_ids or begin[1] != list(reqs):
            return None
        if lane.emit_starts(begin[2]) != list(reqs.values()):  # (begin_step's steady check)
            return None
        if not lane.expects_lists(token_starts, query_start_loc, len(rows)):
            return None
        return lane

    def _leave_lane(self) -> None:
        """Leave the lane (if in it): its held-back rows into the pool, its tails opened ahead freed."""
        lane = self._lane
        if lane is None:
            return
        self._lane = None
        self._lane_candidate = None
        lane.leave()

    def _publish_filled(self, slots: np.ndarray, pool_blocks: list[int], block_index: list[int]) -> None:
        """Request slots ``slots`` each just filled block ``block_index[i]``, staged in pool block
        ``pool_blocks[i]``: pins follow their capture cursors (only a completed block moves them),
        and the block is published if its key is known, else stays staged until its hash arrives."""
        retain: list[str] = []
        release: list[str] = []
        self._table.sync_pins(slots, retain, release)
        pub_keys: list[str] = []
        pub_blocks: list[int] = []
        self._key_or_stage(slots.tolist(), block_index, pool_blocks, pub_keys, pub_blocks)
        self._writer.publish(None, pub_keys, pub_blocks, retain, release)

    def _key_or_stage(
        self, slots: list[int], block_index: list[int], pool_blocks: list[int], pub_keys: list[str],
        pub_blocks: list[int],
    ) -> None:  # fmt: skip
        """Filled pool blocks: one whose key is known goes to ``pub_keys``/``pub_blocks`` (for
        ``StoreWriter.publish``), the rest stay staged until their hashes arrive with a later step."""
        keys, staged = self._table.keys, self._table.staged
        for s, b, block in zip(slots, block_index, pool_blocks):
            if b < len(keys[s]):
                pub_keys.append(keys[s][b])
                pub_blocks.append(block)
            else:
                staged[s][b] = block

    # -- lifecycle ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvariantError("worker connector is closed")

    @property
    def dropped_batches(self) -> int:
        """Publications the store rejected for capacity (their keys then read as missing)."""
        return self._writer.dropped_batches

    @property
    def num_inflight(self) -> int:
        return len(self._pending_steps)

    def tracked_requests(self) -> list[str]:
        return list(self._table.slot_of)

    def close(self) -> None:
        """Drop in-flight outputs and close the store (re-raises a recorded writer failure)."""
        if self._closed:
            return
        self._closed = True
        self._pending_steps.clear()
        self.store.close()
