"""ArenaStore: LRU among unreferenced objects, immutable puts, tail-first terminal release, fail-closed."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from auxout.errors import InvariantError, ObjectMissingError, StoreCapacityError, StoreClosedError
from auxout.stores import ArenaStore, BlockStore, LRUPolicy, make_store
from auxout.stores.base import BlockObjects, object_keys
from auxout.stores.policy import RemoveReason
from auxout.stores.rows import join_rows
from auxout.stores.shm import SharedMemoryStore
from auxout.stores.slots import SlotIndex

N = 8  # object_nbytes


def payload(tag: int, n: int = N) -> bytes:
    return bytes([tag]) * n


def store_of(capacity: int, **kw) -> ArenaStore:
    return ArenaStore(capacity * N, N, **kw)


def present(store: ArenaStore, keys: Sequence[str]) -> dict[str, bool]:
    return dict(zip(keys, store.contains(list(keys))))


# -- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_bytes", "object_nbytes", "fragment"),
    [
        (64, 0, "object_nbytes"),
        (64, -1, "object_nbytes"),
        (7, 8, "at least one object"),
        (64, 8.0, "object_nbytes"),
    ],
)
def test_constructor_rejects_bad_sizes(max_bytes, object_nbytes, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        ArenaStore(max_bytes, object_nbytes)


def test_capacity_is_whole_objects_and_protocol() -> None:
    s = ArenaStore(3 * N + N - 1, N)
    assert s.num_slots == 3
    assert isinstance(s, BlockStore)
    for i, k in enumerate("abcd"):
        s.put([(k, payload(i))])
    assert len(s) == 3
    assert s.contains(["a", "b", "c", "d"]) == [False, True, True, True]


# -- LRU + immutable ---------------------------------------------------------------------------


def test_lru_and_immutable_put() -> None:
    s = store_of(2)
    s.put([("first", payload(1))])
    s.put([("second", payload(2))])
    assert s.get_concatenated(["first"]) == payload(1)  # touch: "second" is now the oldest
    s.put([("first", payload(9)), ("third", payload(3))])  # re-put does not overwrite
    assert s.get_concatenated(["first", "third"]) == payload(1) + payload(3)
    with pytest.raises(ObjectMissingError) as ei:
        s.get_concatenated(["first", "second"])
    assert ei.value.keys == ["second"]
    msg = str(ei.value)
    assert "second" in msg and "first" not in msg
    assert "max_bytes" in msg and "recompute" in msg  # advice true for the case: hits recompute


def test_put_refreshes_recency_of_existing_key() -> None:
    s = store_of(2)
    s.put([("a", payload(1)), ("b", payload(2))])
    s.put([("a", payload(7))])  # refresh only: "b" becomes the oldest
    s.put([("c", payload(3))])
    assert present(s, ["a", "b", "c"]) == {"a": True, "b": False, "c": True}
    assert s.get_concatenated(["a"]) == payload(1)


def test_duplicate_key_in_one_batch_first_payload_wins() -> None:
    s = store_of(2)
    s.put([("k", payload(1)), ("k", payload(2))])
    assert len(s) == 1
    assert s.get_concatenated(["k"]) == payload(1)


def test_get_concatenates_in_key_order_and_repeats() -> None:
    s = store_of(3)
    s.put([("a", payload(1)), ("b", payload(2))])
    assert s.get_concatenated(["b", "a", "b"]) == payload(2) + payload(1) + payload(2)
    assert s.get_concatenated([]) == b""


def test_missing_error_names_every_missing_key() -> None:
    s = store_of(2)
    s.put([("here", payload(1))])
    keys = ["m0", "here", "m1", "m2", "m3", "m4", "m5"]
    with pytest.raises(ObjectMissingError) as ei:
        s.get_concatenated(keys)
    assert ei.value.keys == ["m0", "m1", "m2", "m3", "m4", "m5"]
    assert "m0" in str(ei.value) and "+2 more" in str(ei.value)
    assert "max_bytes" in str(ei.value)


# -- references ---------------------------------------------------------------------------------


def test_referenced_objects_are_never_evicted() -> None:
    s = store_of(2)
    s.put([("first", payload(1))], retain=["first"])
    s.put([("second", payload(2))])
    s.get_concatenated(["second"])  # "first" is the oldest but referenced
    s.put([("third", payload(3))])
    assert present(s, ["first", "second", "third"]) == {"first": True, "second": False, "third": True}
    assert s.references("first") == 1


def test_keys_can_be_referenced_before_data_exists() -> None:
    s = store_of(2)
    s.put([], retain=["future"])
    assert s.references("future") == 1 and s.contains(["future"]) == [False]
    s.put([("future", payload(5))])
    s.put([("x", payload(1))])
    s.put([("y", payload(2))])  # evicts "x", never the referenced "future"
    assert present(s, ["future", "x", "y"]) == {"future": True, "x": False, "y": True}


def test_retain_counts_accumulate_and_release_unpins() -> None:
    s = store_of(1)
    s.put([("a", payload(1))], retain=["a", "a"])
    s.put([], release=["a"])
    assert s.references("a") == 1
    with pytest.raises(StoreCapacityError):
        s.put([("b", payload(2))])
    s.put([], release=["a"])
    assert s.references("a") == 0 and s.referenced_keys == {}
    s.put([("b", payload(2))])
    assert present(s, ["a", "b"]) == {"a": False, "b": True}


def test_unmatched_release_is_an_invariant_error() -> None:
    s = store_of(2)
    with pytest.raises(InvariantError, match="'ghost'"):
        s.put([], release=["ghost"])
    s.put([("a", payload(1))], retain=["a"])
    s.put([], release=["a"])
    with pytest.raises(InvariantError, match="no live request references"):
        s.put([], release=["a"])
    assert s.references("a") == 0
    assert s.get_concatenated(["a"]) == payload(1)


# -- tail-first terminal release ---------------------------------------------------------------


def test_terminal_put_preserves_tail_first_eviction_order() -> None:
    s = store_of(2)
    s.put([("first", payload(1)), ("second", payload(2))], retain=["first", "second", "third"])
    # the tail "third" arrives with the terminal release (tail first): it is the oldest terminal key
    s.put([("third", payload(3))], release=["third", "second", "first"])
    assert present(s, ["first", "second", "third"]) == {"first": True, "second": True, "third": False}
    assert s.referenced_keys == {}


def test_terminal_put_orders_survivors_for_later_eviction() -> None:
    s = store_of(3)
    s.put([("first", payload(1)), ("second", payload(2))], retain=["first", "second", "third"])
    s.put([("third", payload(3))], release=["third", "second", "first"])
    assert present(s, ["first", "second", "third"]) == {"first": True, "second": True, "third": True}
    s.put([("fourth", payload(4))])
    assert present(s, ["first", "second", "third"]) == {"first": True, "second": True, "third": False}
    s.put([("fifth", payload(5))])
    assert present(s, ["first", "second", "fourth", "fifth"]) == {
        "first": True,
        "second": False,
        "fourth": True,
        "fifth": True,
    }


def test_terminal_put_keeps_a_shared_incoming_key() -> None:
    s = store_of(2)
    s.put([("first", payload(1)), ("second", payload(2))], retain=["first", "second", "third", "third"])
    s.put([("third", payload(3))], release=["third", "second", "first"])  # another holder keeps "third"
    assert s.references("third") == 1
    assert present(s, ["first", "second", "third"]) == {"first": True, "second": False, "third": True}
    assert s.get_concatenated(["third"]) == payload(3)


# -- capacity / rollback ------------------------------------------------------------------------


def test_oversized_batch_fails_without_partial_write() -> None:
    s = store_of(2)
    s.put([("old", payload(1))])
    with pytest.raises(StoreCapacityError, match="cannot retain the requested batch") as ei:
        s.put([("n1", payload(2)), ("n2", payload(3)), ("n3", payload(4))])
    assert "nothing from this batch was written" in str(ei.value) and "limit=2" in str(ei.value)
    assert present(s, ["old", "n1", "n2", "n3"]) == {"old": True, "n1": False, "n2": False, "n3": False}
    assert s.get_concatenated(["old"]) == payload(1)
    assert len(s) == 1
    # no slot was leaked: two fresh objects still fit
    s.put([("n1", payload(2)), ("n2", payload(3))])
    assert s.get_concatenated(["n1", "n2"]) == payload(2) + payload(3)


def test_all_referenced_store_rejects_batch_and_keeps_old_objects() -> None:
    s = store_of(2)
    s.put([("a", payload(1)), ("b", payload(2))], retain=["a", "b"])
    with pytest.raises(StoreCapacityError, match="2 referenced"):
        s.put([("c", payload(3))])
    assert s.get_concatenated(["a", "b"]) == payload(1) + payload(2)
    assert s.contains(["c"]) == [False]
    s.put([], release=["b", "a"])
    s.put([("c", payload(3))])  # now "b" (released first, so older) is the victim
    assert present(s, ["a", "b", "c"]) == {"a": True, "b": False, "c": True}


def test_payload_validation_precedes_any_mutation() -> None:
    s = store_of(2)
    s.put([("a", payload(1))])
    with pytest.raises(ValueError, match="'big' has 9 bytes; expected 1..8"):
        s.put([("ok", payload(2)), ("big", payload(3, N + 1))], retain=["ok"])
    with pytest.raises(ValueError, match="'empty' has 0 bytes"):
        s.put([("empty", b"")])
    assert s.references("ok") == 0
    assert present(s, ["a", "ok", "big", "empty"]) == {"a": True, "ok": False, "big": False, "empty": False}


def test_shorter_payloads_round_trip() -> None:
    s = store_of(3)
    s.put([("full", payload(1)), ("short", b"abc"), ("view", memoryview(bytearray(b"xyzw")))])
    assert s.get_concatenated(["short"]) == b"abc"
    assert s.get_concatenated(["full", "short", "view"]) == payload(1) + b"abc" + b"xyzw"
    assert s.get_concatenated(["view", "full"]) == b"xyzw" + payload(1)


def test_shorter_payload_does_not_leak_stale_bytes_of_a_reused_slot() -> None:
    s = store_of(1)
    s.put([("long", payload(0xAA))])
    s.put([("short", b"\x01\x02")])  # reuses the slot of "long"
    assert s.get_concatenated(["short"]) == b"\x01\x02"


def test_evicted_slot_is_reused_without_moving_live_objects() -> None:
    s = store_of(3)
    s.put([("a", payload(1)), ("b", payload(2)), ("c", payload(3))])
    slots = dict(s._lru)
    s.get_concatenated(["a", "c"])  # "b" is the oldest now
    s.put([("d", payload(4))])
    assert s._lru["d"] == slots["b"]
    assert s._lru["a"] == slots["a"] and s._lru["c"] == slots["c"]
    assert s.get_concatenated(["a", "c", "d"]) == payload(1) + payload(3) + payload(4)
    assert s.contains(["b"]) == [False]


def test_read_touch_changes_victim() -> None:
    s = store_of(2)
    s.put([("a", payload(1)), ("b", payload(2))])
    s.get_concatenated(["a"])
    s.put([("c", payload(3))])
    assert present(s, ["a", "b", "c"]) == {"a": True, "b": False, "c": True}


# -- close ------------------------------------------------------------------------------------


def test_access_after_close_raises_store_closed() -> None:
    s = store_of(2)
    s.put([("a", payload(1))])
    s.close()
    with pytest.raises(StoreClosedError, match="ArenaStore is closed"):
        s.put([("b", payload(2))])
    with pytest.raises(StoreClosedError, match="closed"):
        s.get_concatenated(["a"])
    with pytest.raises(StoreClosedError):
        s.contains(["a"])
    s.close()  # idempotent


# -- eviction policy -------------------------------------------------------------------------------


class RecordingPolicy:
    """Evicts the newest candidates (opposite of LRU) and records every callback."""

    def __init__(self, select=None) -> None:
        self.refs: list[tuple[str, int, int]] = []
        self.removed: list[tuple[list[str], RemoveReason]] = []
        self.calls: list[tuple[list[str], int]] = []
        self._select = select

    def on_reference_change(self, key: str, old: int, new: int) -> None:
        self.refs.append((key, old, new))

    def select_victims(self, candidates: Sequence[str], count: int) -> Sequence[str] | None:
        self.calls.append((list(candidates), count))
        if self._select is not None:
            return self._select(candidates, count)
        return list(candidates[::-1][:count])

    def on_remove(self, keys: Sequence[str], reason: RemoveReason) -> None:
        self.removed.append((list(keys), reason))


def test_policy_victim_selection_is_honoured() -> None:
    pol = RecordingPolicy()
    s = store_of(3, policy=pol)
    s.put([("a", payload(1)), ("b", payload(2)), ("c", payload(3))], retain=["a"])
    s.put([("d", payload(4))])
    # candidates exclude the referenced "a" and the incoming "d"; oldest first
    assert pol.calls == [(["b", "c"], 1)]
    assert pol.removed == [(["c"], "eviction")]
    assert present(s, ["a", "b", "c", "d"]) == {"a": True, "b": True, "c": False, "d": True}
    assert s.get_concatenated(["b", "d"]) == payload(2) + payload(4)
    s.put([], release=["a"])
    assert pol.refs == [("a", 0, 1), ("a", 1, 0)]


@pytest.mark.parametrize(
    "select",
    [
        pytest.param(lambda c, n: None, id="refuse"),
        pytest.param(lambda c, n: list(c[: n - 1]), id="too-few"),
        pytest.param(lambda c, n: list(c[:n]) + ["a"], id="too-many"),
        pytest.param(lambda c, n: [c[0]] * n, id="duplicates"),
        pytest.param(lambda c, n: ["a"] * n, id="referenced-key"),
        pytest.param(lambda c, n: ["new1"] * n, id="protected-incoming"),
        pytest.param(lambda c, n: ["nope"] * n, id="unknown-key"),
    ],
)
def test_policy_invalid_selection_fails_closed(select) -> None:
    pol = RecordingPolicy(select)
    s = store_of(3, policy=pol)
    s.put([("a", payload(1)), ("b", payload(2)), ("c", payload(3))], retain=["a"])
    with pytest.raises(StoreCapacityError, match="cannot retain"):
        s.put([("new1", payload(4)), ("new2", payload(5))])
    assert pol.calls == [(["b", "c"], 2)]
    assert pol.removed == [(["new1", "new2"], "rollback")]
    assert present(s, ["a", "b", "c", "new1", "new2"]) == {
        "a": True,
        "b": True,
        "c": True,
        "new1": False,
        "new2": False,
    }
    assert s.get_concatenated(["a", "b", "c"]) == payload(1) + payload(2) + payload(3)


def test_lru_policy_matches_default_behaviour() -> None:
    plain, withpol = store_of(3), store_of(3, policy=LRUPolicy())
    keys = [f"k{i}" for i in range(8)]
    for st in (plain, withpol):
        for i, k in enumerate(keys):
            st.put([(k, payload(i))], retain=[k] if i == 2 else ())
            if i % 3 == 0 and st.contains([keys[0]])[0]:
                st.get_concatenated([keys[0]])
    assert plain.contains(keys) == withpol.contains(keys)
    assert withpol.contains(["k2"]) == [True]


def test_make_store_builds_arena() -> None:
    s = make_store("arena", max_bytes=2 * N, object_nbytes=N, background=False)
    assert isinstance(s, ArenaStore) and s.num_slots == 2
    with pytest.raises(ValueError, match="unknown route store backend"):
        make_store("nope", max_bytes=2 * N, object_nbytes=N)
    with pytest.raises(TypeError, match="unexpected options"):
        make_store("arena", max_bytes=2 * N, object_nbytes=N, background=False, bogus=1)


# -- BlockObjects: the worker's batches (array chunks copied into slots whole) -------------------


def block_objects(tags: Sequence[tuple[str, int]], chunk: int = 3, nbytes: int = N) -> BlockObjects:
    """``(key, tag)`` pairs as a BlockObjects batch of ``chunk``-row arrays."""
    objs = BlockObjects(nbytes=nbytes)
    for i in range(0, len(tags), chunk):
        part = tags[i : i + chunk]
        objs.add([k for k, _ in part], np.array([[t] * nbytes for _, t in part], dtype=np.uint8))
    return objs


@pytest.mark.parametrize("make", [lambda: store_of(16), lambda: SharedMemoryStore(16 * N, N)], ids=["arena", "shm"])
def test_block_objects_batches_equal_per_object_puts(make) -> None:
    store = make()
    try:
        store.put([("old", payload(9))])
        # all new: each chunk is copied straight into its slots
        store.put(block_objects([(f"k{i}", i) for i in range(7)]))
        assert store.get_concatenated([f"k{i}" for i in range(7)]) == b"".join(payload(i) for i in range(7))
        # an existing key and a duplicate in the batch: first write wins, the others land
        store.put(block_objects([("old", 1), ("n1", 2), ("n1", 3), ("n2", 4)]))
        assert store.get_concatenated(["old", "n1", "n2"]) == payload(9) + payload(2) + payload(4)
    finally:
        store.close()


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.lists(hs.integers(1, 40), min_size=1, max_size=3), min_size=1, max_size=8))
def test_block_object_chunks_land_in_their_slots_consecutive_or_not(batches: list[list[int]]) -> None:
    # fresh slots come consecutive, evictions hand freed ones back in reverse: every chunk lands
    # in its own slots either way
    stores = [store_of(64), SharedMemoryStore(64 * N, N)]
    try:
        tag = 0
        written: dict[str, int] = {}
        for sizes in batches:
            objs = BlockObjects(nbytes=N)
            for n in sizes:
                keys = [f"k{tag + i}" for i in range(n)]
                objs.add(keys, np.array([[(tag + i) % 251] * N for i in range(n)], dtype=np.uint8))
                written.update((k, (tag + i) % 251) for i, k in enumerate(keys))
                tag += n
            if len(objs) > 64:
                continue
            for store in stores:
                store.put(objs)
                stored = [k for k, ok in zip(written, store.contains(list(written))) if ok]
                assert stored, "the last batch is stored"
                assert store.get_concatenated(stored) == b"".join(payload(written[k]) for k in stored)
    finally:
        for store in stores:
            store.close()


def test_block_objects_read_as_key_payload_pairs_and_check_their_arrays() -> None:
    objs = block_objects([("a", 1), ("b", 2), ("c", 3), ("d", 4)], chunk=3)
    assert [(k, bytes(v)) for k, v in objs] == [(k, payload(t)) for k, t in [("a", 1), ("b", 2), ("c", 3), ("d", 4)]]
    assert len(objs) == 4 and objs[3][0] == "d" and object_keys(objs) == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match=r"uint8 \[2, 8\] blocks, got uint8\[2, 4\]"):
        objs.add(["x", "y"], np.zeros((2, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="4 and 8 bytes"):
        objs.extend(BlockObjects(nbytes=4))


# -- reference counts: the batched fast path equals one change per key -----------------------------


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.tuples(hs.lists(hs.sampled_from("abcdef")), hs.lists(hs.sampled_from("abcdef"))), max_size=8))
def test_reference_counts_match_one_change_per_key(batches: list[tuple[list[str], list[str]]]) -> None:
    index = SlotIndex(8, "test store")
    model: dict[str, int] = {}
    for retain, release in batches:
        want_terminal: list[str] = []
        want_error = False
        after = dict(model)
        for k in retain:
            after[k] = after.get(k, 0) + 1
        for k in release:
            n = after.get(k, 0) - 1
            if n < 0:
                want_error = True
                break
            if n:
                after[k] = n
            else:
                del after[k]
                want_terminal.append(k)
        if want_error:
            with pytest.raises(InvariantError, match="no live request references"):
                index._apply_refs(retain, release)
            return  # the index is not defined after a broken release (the caller fails closed)
        assert index._apply_refs(retain, release) == want_terminal
        model = after
        assert index.refs == model


def test_released_keys_never_stored_do_not_stop_the_others_moving_to_the_recent_end() -> None:
    # a request pins its prefix before the objects exist (a block it then computes is stored by
    # another request or never): at release, the stored keys after such a key still move
    index = SlotIndex(4, "test store")
    index.plan_put([(k, payload(i)) for i, k in enumerate("abc")], (), (), N)
    index.plan_put([], ["a", "z", "b"], (), N)
    index.plan_put([], (), ["b", "z", "a"], N)  # terminal in release order: b, (z: not stored), a
    assert list(index.lru) == ["c", "b", "a"]
    index.plan_put([(k, payload(i)) for i, k in enumerate("de")], (), (), N)
    assert index.drain_lost() == ["c"], "the oldest after the releases is evicted"


# -- eviction order: the batched index equals one change per key and a touch per read -----------


class _PerKeyIndex(SlotIndex):
    """The documented semantics spelled out: every reference change one at a time (the policy
    path, through ``LRUPolicy``) and every read touching every key it reads."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, "reference index", LRUPolicy())

    def lookup(self, keys: Sequence[str]) -> list[int]:
        slots = super().lookup(keys)
        for k in keys:
            self.lru.move_to_end(k)
        return slots


_op = hs.one_of(
    hs.tuples(
        hs.just("put"), hs.lists(hs.sampled_from("abcdefgh"), max_size=4),
        hs.lists(hs.sampled_from("abcdefgh"), max_size=4), hs.lists(hs.sampled_from("abcdefgh"), max_size=4),
    ),
    hs.tuples(hs.just("read"), hs.lists(hs.sampled_from("abcdefgh"), min_size=1, max_size=4)),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(hs.lists(_op, max_size=24))
def test_eviction_order_matches_per_key_semantics(ops: list[tuple]) -> None:
    """The batched index (reference changes through ``map``/``update``, C-filtered eviction)
    evicts exactly what one reference change per key and a touch per read would evict."""
    fast, slow = SlotIndex(4, "test store"), _PerKeyIndex(4)
    for op in ops:
        if op[0] == "read":
            outcomes = []
            for index in (fast, slow):
                try:
                    outcomes.append(index.lookup(op[1]))
                except ObjectMissingError as exc:
                    outcomes.append(sorted(exc.keys))
            assert outcomes[0] == outcomes[1]
        else:
            _, objects, retain, release = op
            held = dict(slow.refs)
            for k in retain:
                held[k] = held.get(k, 0) + 1
            valid = []  # only releases of held references (anything else is an invariant error)
            for k in release:
                if held.get(k, 0) > 0:
                    held[k] -= 1
                    valid.append(k)
            release = valid
            batch = [(k, payload(i)) for i, k in enumerate(objects)]
            outcomes = []
            for index in (fast, slow):
                try:
                    outcomes.append(index.plan_put(batch, retain, release, N)[0])
                except StoreCapacityError:
                    outcomes.append(None)
            assert outcomes[0] == outcomes[1]
        assert fast.refs == slow.refs
        assert fast.drain_lost() == slow.drain_lost()
        unreferenced = [[k for k in index.lru if k not in index.refs] for index in (fast, slow)]
        assert unreferenced[0] == unreferenced[1]


class _CountingRefs(dict):
    """A reference table that counts membership tests (how many keys an eviction examines)."""

    checks = 0

    def __contains__(self, key: object) -> bool:
        _CountingRefs.checks += 1
        return super().__contains__(key)


def test_pins_at_the_old_end_are_scanned_once_not_by_every_eviction() -> None:
    """Long-running requests pin the oldest keys; evictions must not re-examine them every put."""
    index = SlotIndex(2_000, "test store")
    keys = [f"k{i:05d}" for i in range(2_000)]
    index.plan_put([(k, payload(0)) for k in keys], keys[:1_500], [], N)  # the oldest 1,500 pinned
    index.refs = _CountingRefs(index.refs)
    examined = []
    for r in range(3):
        new = [f"n{r}-{i:02d}" for i in range(16)]
        _CountingRefs.checks = 0
        index.plan_put([(k, payload(1)) for k in new], new, [], N)
        examined.append(_CountingRefs.checks)
        assert index.drain_lost() == keys[1_500 + 16 * r : 1_500 + 16 * (r + 1)], "LRU victims, in order"
    assert examined[0] >= 1_500, "the first eviction scans past the pins once"
    assert max(examined[1:]) < 300, f"later evictions examine about the keys they evict, not the pins: {examined}"
    assert all(k in index.refs for k in keys[:1_500]) and len(index.lru) == 2_000


# -- rows handed out uncopied (read_rows): their slots are never reused while read ---------------

_rows_op = hs.one_of(
    hs.tuples(
        hs.just("put"), hs.lists(hs.sampled_from("abcdefgh"), max_size=4),
        hs.lists(hs.sampled_from("abcdefgh"), max_size=3), hs.lists(hs.sampled_from("abcdefgh"), max_size=3),
    ),
    hs.tuples(hs.just("read"), hs.lists(hs.sampled_from("abcdefgh"), min_size=1, max_size=3)),
    hs.tuples(hs.just("drop"), hs.integers(0, 7)),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(hs.lists(_rows_op, max_size=30))
def test_rows_read_uncopied_stay_exact_whatever_the_store_evicts(ops: list[tuple]) -> None:
    """Held ``read_rows`` results always hold the bytes written for their keys, however much is
    evicted and rewritten meanwhile; quarantined slots come back once nothing reads them."""


    store = store_of(4)
    held: list[tuple[list[str], object]] = []
    for op in ops:
        if op[0] == "put":
            _, objects, retain, release = op
            left = dict(store._index.refs)  # release only references someone holds
            release = [k for k in release if left.get(k, 0) > 0 and not left.__setitem__(k, left[k] - 1)]
            with contextlib.suppress(StoreCapacityError):  # (rejected whole: nothing written)
                store.put([(k, payload(ord(k))) for k in objects], retain=retain, release=release)
                # a put reclaims first: only slots that held rows still read stay quarantined
                assert set(store._index.quarantine) <= {s for _, r in held for s in r.slots.tolist()}  # type: ignore[attr-defined]
        elif op[0] == "read":
            try:
                got = store.read_rows(op[1], np.dtype(np.uint8), (N,))
            except ObjectMissingError:
                continue
            assert got is not None
            held.append((op[1], got))
            del got
        elif held:
            held.pop(op[1] % len(held))
        for keys, rows in held:
            assert join_rows([rows]).tobytes() == b"".join(payload(ord(k)) for k in keys)  # type: ignore[list-item]
        rows = None  # (the loop variable would keep the last one alive)
        index = store._index
        assert len(index.lru) + len(index.quarantine) <= index.num_slots
    held.clear()
    store.put([], release=[k for k, n in store._index.refs.items() for _ in range(n)])
    store.put([("z", payload(1))])
    assert store._index.quarantine == []


def test_a_quarantined_slot_returns_when_its_reader_goes_while_others_still_read() -> None:
    store = store_of(4)
    store.put([(k, payload(ord(k))) for k in "abcd"])
    u8 = np.dtype(np.uint8)
    first, second = store.read_rows(["a", "b"], u8, (N,)), store.read_rows(["c", "d"], u8, (N,))
    assert first is not None and second is not None
    with pytest.raises(StoreCapacityError):  # every slot is read: nothing can be overwritten
        store.put([(k, payload(ord(k))) for k in "efgh"])
    assert sorted(store._index.quarantine) == sorted(first.slots.tolist() + second.slots.tolist())
    gone = set(first.slots.tolist())
    del first
    store.put([("e", payload(ord("e"))), ("f", payload(ord("f")))])  # take the slots a and b had
    assert sorted(store._index.quarantine) == sorted(second.slots.tolist())
    assert {store._lru["e"], store._lru["f"]} == gone
    assert join_rows([second]).tobytes() == payload(ord("c")) + payload(ord("d"))
