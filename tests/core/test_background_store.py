"""BackgroundStore: off-thread writes, read-your-writes, back-pressure, sticky failure, close."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import pytest

from auxout.errors import ObjectMissingError, PublicationError, StoreCapacityError, StoreClosedError
from auxout.stores import ArenaStore, BackgroundStore, make_store
from auxout.stores.background import INLINE_MAX_RELEASES

N = 8
WAIT = 5.0  # generous upper bound for thread hand-offs; tests finish far sooner


def payload(tag: int) -> bytes:
    return bytes([tag]) * N


class GatedStore:
    """Inner store whose ``put`` can block on a gate and can be made to fail; counts calls."""

    def __init__(self, capacity: int = 8, *, gate: bool = False, fail_on: int | None = None) -> None:
        self.inner = ArenaStore(capacity * N, N)
        self.object_nbytes = N
        self.gate = threading.Event()
        if not gate:
            self.gate.set()
        self.entered = threading.Event()
        self.fail_on = fail_on
        self.puts: list[list[str]] = []
        self.close_calls = 0
        self.writer_threads: set[str] = set()

    def put(self, objects: Sequence, *, retain: Iterable[str] = (), release: Iterable[str] = ()) -> None:
        self.writer_threads.add(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(WAIT)
        self.puts.append([k for k, _ in objects])
        if self.fail_on is not None and len(self.puts) == self.fail_on:
            raise RuntimeError("disk on fire")
        self.inner.put(objects, retain=retain, release=release)

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        return self.inner.get_concatenated(keys)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.contains(keys)

    def close(self) -> None:
        self.close_calls += 1
        self.inner.close()


def test_put_does_not_block_caller_while_inner_store_blocks() -> None:
    inner = GatedStore(gate=True)
    bg = BackgroundStore(inner, max_pending=4)
    t0 = time.monotonic()
    bg.put([("a", payload(1))])
    bg.put([("b", payload(2))])
    assert time.monotonic() - t0 < 1.0
    assert inner.entered.wait(WAIT), "the writer thread must pick up the batch"
    assert inner.puts == []  # still blocked inside the inner store
    assert threading.current_thread().name not in inner.writer_threads
    inner.gate.set()
    bg.close()
    assert inner.puts == [["a"], ["b"]]
    assert inner.close_calls == 1
    assert inner.writer_threads == {"auxout-store-writer"}
    bg.close()  # idempotent: the inner store is closed once
    assert inner.close_calls == 1


def test_read_your_writes() -> None:
    class SlowStore(GatedStore):
        def put(self, objects, *, retain=(), release=()):  # type: ignore[no-untyped-def]
            time.sleep(0.05)
            super().put(objects, retain=retain, release=release)

    inner = SlowStore()
    bg = BackgroundStore(inner, max_pending=8)
    bg.put([("a", payload(1))], retain=["a"])
    bg.put([("b", payload(2))])
    assert bg.get_concatenated(["a", "b"]) == payload(1) + payload(2)
    bg.put([("c", payload(3))])
    assert bg.contains(["a", "b", "c", "d"]) == [True, True, True, False]
    bg.put([], release=["a"])
    bg.flush()
    assert inner.inner.references("a") == 0
    bg.close()


def test_a_read_waits_only_for_pending_batches_that_write_its_keys() -> None:
    inner = GatedStore(gate=True)
    bg = BackgroundStore(inner, max_pending=8)
    bg.put([("old", payload(9))])
    assert inner.entered.wait(WAIT)
    inner.gate.set()
    bg.flush()  # "old" is applied
    inner.gate.clear()
    inner.entered.clear()
    bg.put([("a", payload(1))])  # the writer blocks inside this batch
    assert inner.entered.wait(WAIT)
    bg.put([("b", payload(2))], retain=["b"])  # queued behind it
    t0 = time.monotonic()
    assert bg.get_concatenated(["old"]) == payload(9)  # written by no pending batch: no wait
    assert bg.contains(["old", "zzz"]) == [True, False]
    assert time.monotonic() - t0 < WAIT / 2
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(bg.get_concatenated(["old", "b"])))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got, "a read of a key in a pending batch waits for it"
    inner.gate.set()
    reader.join(WAIT)
    assert got == [payload(9) + payload(2)]
    bg.close()


def test_back_pressure_blocks_producer_beyond_max_pending() -> None:
    inner = GatedStore(gate=True)
    bg = BackgroundStore(inner, max_pending=1)
    bg.put([("a", payload(1))])
    assert inner.entered.wait(WAIT)  # writer holds "a" (blocked), the queue is empty again
    bg.put([("b", payload(2))])  # fills the single pending slot
    done = threading.Event()

    def third() -> None:
        bg.put([("c", payload(3))])
        done.set()

    t = threading.Thread(target=third, daemon=True)
    t.start()
    assert not done.wait(0.3), "a producer beyond max_pending must block"
    inner.gate.set()
    assert done.wait(WAIT)
    t.join(WAIT)
    assert bg.get_concatenated(["a", "b", "c"]) == payload(1) + payload(2) + payload(3)
    assert inner.puts == [["a"], ["b"], ["c"]]
    bg.close()


def test_empty_put_is_a_noop() -> None:
    inner = GatedStore()
    bg = BackgroundStore(inner)
    bg.put([])
    bg.flush()
    assert inner.puts == []
    bg.close()


def test_writer_failure_is_sticky_and_chained() -> None:
    inner = GatedStore(gate=True, fail_on=1)
    bg = BackgroundStore(inner, max_pending=4)
    bg.put([("a", payload(1))])  # will fail on the writer
    assert inner.entered.wait(WAIT)
    bg.put([("b", payload(2))])  # queued behind the failing batch: must be skipped
    inner.gate.set()
    with pytest.raises(PublicationError, match="disk on fire") as ei:
        bg.flush()
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert inner.puts == [["a"]], "writes after a failure must be skipped"
    assert inner.inner.contains(["a", "b"]) == [False, False]
    with pytest.raises(PublicationError) as ei_put:
        bg.put([("c", payload(3))])
    assert isinstance(ei_put.value.__cause__, RuntimeError)
    with pytest.raises(PublicationError):
        bg.get_concatenated(["a"])
    with pytest.raises(PublicationError):
        bg.contains(["a"])
    assert inner.puts == [["a"]]
    with pytest.raises(PublicationError) as ei_close:
        bg.close()
    assert isinstance(ei_close.value.__cause__, RuntimeError)
    assert inner.close_calls == 1
    bg.close()  # already closed: no second close of the inner store
    assert inner.close_calls == 1


def test_capacity_rejection_drops_only_that_batch() -> None:
    """A batch the inner store rejects whole is counted and dropped; the store keeps working."""
    inner = ArenaStore(1 * N, N)
    bg = BackgroundStore(inner, max_pending=4)
    bg.put([("a", payload(1))], retain=["a"])
    bg.put([("b", payload(2))])  # cannot fit: "a" is referenced
    assert bg.contains(["a", "b"]) == [True, False]
    assert bg.dropped_batches == 1
    assert isinstance(bg.last_drop, StoreCapacityError)
    assert "cannot retain" in str(bg.last_drop)
    with pytest.raises(ObjectMissingError) as ei:
        bg.get_concatenated(["a", "b"])
    assert ei.value.keys == ["b"]
    assert bg.get_concatenated(["a"]) == payload(1)  # the old object is intact
    bg.put([], release=["a"])
    bg.put([("c", payload(3))])  # later writes are applied
    assert bg.get_concatenated(["c"]) == payload(3)
    assert bg.dropped_batches == 1
    bg.close()


def test_access_after_close_raises_store_closed() -> None:
    inner = GatedStore()
    bg = BackgroundStore(inner)
    bg.put([("a", payload(1))])
    bg.close()
    assert inner.puts == [["a"]]  # close drained the queue first
    with pytest.raises(StoreClosedError, match="BackgroundStore is closed"):
        bg.put([("b", payload(2))])
    with pytest.raises(StoreClosedError):
        bg.get_concatenated(["a"])
    with pytest.raises(StoreClosedError):
        bg.contains(["a"])
    with pytest.raises(StoreClosedError):
        bg.flush()
    assert inner.close_calls == 1


def test_constructor_validation_and_factory() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        BackgroundStore(ArenaStore(N, N), max_pending=0)
    bg = make_store("arena", max_bytes=2 * N, object_nbytes=N)
    assert isinstance(bg, BackgroundStore) and isinstance(bg.inner, ArenaStore)
    assert bg.object_nbytes == N
    bg.put([("k", payload(7))])
    assert bg.get_concatenated(["k"]) == payload(7)
    bg.close()


def test_small_batch_on_an_idle_writer_is_applied_in_place() -> None:
    inner = GatedStore()
    bg = BackgroundStore(inner, max_pending=4, inline_below=3 * N)
    bg.put([("a", payload(1)), ("b", payload(2))])  # 2 objects < 3 x N bytes, writer idle
    assert inner.puts == [["a", "b"]], "applied before put returned, without flush"
    assert inner.writer_threads == {threading.current_thread().name}
    bg.put([("c", payload(3)), ("d", payload(4)), ("e", payload(5))])  # not below the limit: queued
    bg.flush()
    assert "auxout-store-writer" in inner.writer_threads
    assert bg.get_concatenated(["a", "e"]) == payload(1) + payload(5)
    bg.close()


def test_a_batch_releasing_many_keys_goes_to_the_writer_even_without_objects() -> None:
    # (a finished prefill's teardown: index work of hundreds of keys, which nothing waits for)
    many = INLINE_MAX_RELEASES
    inner = GatedStore(capacity=2 * many)
    bg = BackgroundStore(inner, max_pending=4, inline_below=3 * N)
    keys = [f"k{i}" for i in range(many)]
    bg.put((), retain=keys)  # pins alone stay in place, however many
    bg.put((), release=keys[:-1])  # fewer than the limit: in place
    assert inner.writer_threads == {threading.current_thread().name}
    bg.put((), retain=keys[:-1])
    bg.put((), release=keys)  # the limit: queued
    bg.flush()
    assert "auxout-store-writer" in inner.writer_threads
    assert all(inner.inner.references(k) == 0 for k in keys), "every pin released, in order"
    bg.close()


def test_small_batch_never_overtakes_queued_work() -> None:
    inner = GatedStore(gate=True)
    bg = BackgroundStore(inner, max_pending=4, inline_below=2 * N)
    bg.put([("a", payload(1)), ("z", payload(0))], retain=["a"])  # too big to inline: the writer blocks on it
    assert inner.entered.wait(WAIT)
    bg.put([("b", payload(2))], release=["a"])  # small, but the writer is busy: queue behind, never run here
    assert inner.writer_threads == {"auxout-store-writer"}
    inner.gate.set()
    bg.flush()
    assert inner.puts == [["a", "z"], ["b"]]
    assert inner.inner.references("a") == 0, "the release was applied after the retain"
    bg.close()


def test_inline_batch_failures_behave_like_writer_failures() -> None:
    bg = BackgroundStore(ArenaStore(2 * N, N), max_pending=4, inline_below=100 * N)
    bg.put([("a", payload(1)), ("b", payload(2)), ("c", payload(3))], retain=["a", "b", "c"])  # cannot fit
    assert bg.dropped_batches == 1 and isinstance(bg.last_drop, StoreCapacityError)
    with pytest.raises(ObjectMissingError):
        bg.get_concatenated(["a"])
    bg.put([("d", payload(4))])  # the store keeps working
    assert bg.get_concatenated(["d"]) == payload(4)
    bg.close()
    broken = BackgroundStore(GatedStore(fail_on=1), max_pending=4, inline_below=100 * N)
    with pytest.raises(PublicationError, match="disk on fire"):
        broken.put([("x", payload(9))])
    with pytest.raises(PublicationError):  # sticky, as for a failure on the writer thread
        broken.put([("y", payload(9))])
    with pytest.raises(ValueError, match="inline_below"):
        BackgroundStore(ArenaStore(N, N), inline_below=-1)
    with pytest.raises(PublicationError):
        broken.close()
