"""One conformance suite for every ``BlockStore`` backend, including third-party ones.

A backend passes when it keeps the contract ``auxout.fetch`` relies on: objects round-trip
byte-exact, the first write of a key wins, reads return payloads in key order, any missing key
raises ``ObjectMissingError`` (a ``BlockStoreError``) naming it and never partial or zero-filled
data, oversized or empty payloads are rejected, a closed store raises ``StoreClosedError``,
readers running during writes only ever see exact payloads, and 10,000-object batches work.

Decided edge case: ``get_concatenated([])`` returns ``b""`` and ``contains([])`` returns ``[]``.
``put`` with an oversized payload raises ``ValueError`` at once; an asynchronous store may instead
raise a ``BlockStoreError`` from the next call. Either way the object is never readable.

``make_store(object_nbytes, capacity)`` must return a fresh, empty-enough store whose objects
are at most ``object_nbytes`` bytes and which holds at least ``capacity`` objects without
evicting. Keys are random per test, so one external server can serve every test.

With pytest (the class name does not start with ``Test``, so it is only collected through a
subclass)::

    import pytest
    from auxout.testing.store_conformance import StoreConformance

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def make_store(self):
            made = []
            def make(object_nbytes, capacity):
                made.append(MyStore(object_nbytes=object_nbytes))
                return made[-1]
            yield make
            for s in made:
                s.close()

Without pytest: ``run_conformance(make)`` runs every check and raises ``AssertionError``
listing the failures (returns the names of the passed checks).
"""

from __future__ import annotations

import hashlib
import threading
import time
import traceback
import uuid
from collections.abc import Callable

import numpy as np

from auxout.errors import BlockStoreError, ObjectMissingError, StoreClosedError
from auxout.stores.base import BlockStore

MakeStore = Callable[[int, int], BlockStore]
ROUTE_OBJECT_NBYTES = 16 * 48 * 8  # one hash block of routes: block 16 x 48 layers x top-8 uint8


def _keys(n: int, tag: str = "") -> list[str]:
    base = f"conformance/{uuid.uuid4().hex}{tag}/"
    return [f"{base}{i:06d}" for i in range(n)]


def _payload(key: str, nbytes: int) -> bytes:
    """Deterministic bytes derived from the key, so a reader can verify any object alone."""
    seed = hashlib.blake2b(key.encode(), digest_size=8).digest()
    reps = -(-nbytes // 8)
    return (seed * reps)[:nbytes]


def _payloads(n: int, nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, nbytes), dtype=np.uint8)


def _flush(store: BlockStore) -> None:
    flush = getattr(store, "flush", None)
    if callable(flush):
        flush()


class StoreConformance:
    """Contract checks; a subclass provides the ``make_store`` pytest fixture."""

    object_nbytes: int = ROUTE_OBJECT_NBYTES

    def test_round_trip(self, make_store: MakeStore) -> None:
        onb = self.object_nbytes
        s = make_store(onb, 64)
        keys = _keys(3)
        data = _payloads(3, onb, seed=1)
        s.put([(k, data[i].tobytes()) for i, k in enumerate(keys)])
        assert s.get_concatenated(keys) == data.tobytes()
        assert s.get_concatenated([keys[1]]) == data[1].tobytes()
        assert s.contains(keys) == [True, True, True]
        s.close()

    def test_buffer_types_and_short_objects(self, make_store: MakeStore) -> None:
        onb = self.object_nbytes
        s = make_store(onb, 64)
        k = _keys(4)
        full = _payloads(1, onb, seed=2)[0]
        s.put([(k[0], full), (k[1], bytearray(b"\x07" * (onb // 3))), (k[2], memoryview(b"\x01")), (k[3], full[:onb])])
        got = s.get_concatenated([k[1], k[0], k[2]])
        assert got == b"\x07" * (onb // 3) + full.tobytes() + b"\x01"
        assert s.get_concatenated([k[3]]) == full.tobytes()
        s.close()

    def test_first_write_wins(self, make_store: MakeStore) -> None:
        onb = self.object_nbytes
        s = make_store(onb, 64)
        a, b = _keys(2)
        first, second = b"\x01" * onb, b"\x02" * onb
        s.put([(a, first)])
        s.put([(a, second), (b, second)])
        s.put([(b, first)])
        assert s.get_concatenated([a, b]) == first + second
        c = _keys(1)[0]
        s.put([(c, first), (c, second)])  # duplicate within one batch: the first occurrence wins
        assert s.get_concatenated([c]) == first
        s.close()

    def test_batch_get_in_key_order(self, make_store: MakeStore) -> None:
        onb = self.object_nbytes
        s = make_store(onb, 256)
        keys = _keys(200)
        data = _payloads(200, onb, seed=3)
        s.put(list(zip(keys, data)))
        order = np.random.default_rng(4).permutation(200)
        order = np.concatenate([order, order[:17]])  # repeated keys are returned again
        got = s.get_concatenated([keys[i] for i in order])
        assert got == data[order].tobytes()
        s.close()

    def test_missing_keys_fail_closed(self, make_store: MakeStore) -> None:
        onb = self.object_nbytes
        s = make_store(onb, 64)
        present = _keys(2, "p")
        missing = _keys(2, "m")
        s.put([(k, _payload(k, onb)) for k in present])
        probe = [present[0], missing[0], present[1], missing[1]]
        try:
            out = s.get_concatenated(probe)
        except ObjectMissingError as exc:
            assert isinstance(exc, BlockStoreError)
            assert sorted(exc.keys) == sorted(missing), exc.keys
            assert missing[0] in str(exc)
        else:
            raise AssertionError(f"read with missing keys returned {len(out)} bytes instead of raising")
        assert s.contains(probe) == [True, False, True, False]
        assert s.get_concatenated(present) == b"".join(_payload(k, onb) for k in present)
        s.close()

    def test_empty_key_list(self, make_store: MakeStore) -> None:
        s = make_store(self.object_nbytes, 8)
        assert s.get_concatenated([]) == b""
        assert s.contains([]) == []
        s.close()

    def test_closed_store_raises(self, make_store: MakeStore) -> None:
        onb = self.object_nbytes
        s = make_store(onb, 8)
        (k,) = _keys(1)
        s.put([(k, b"\x05" * onb)])
        s.close()
        s.close()  # idempotent
        for call in (
            lambda: s.put([(k, b"\x05")]),
            lambda: s.get_concatenated([k]),
            lambda: s.contains([k]),
        ):
            try:
                call()
            except StoreClosedError:
                pass
            else:
                raise AssertionError("operation on a closed store did not raise StoreClosedError")

    def test_oversized_and_empty_objects_rejected(self, make_store: MakeStore) -> None:
        onb = self.object_nbytes
        for bad in (b"\x09" * (onb + 1), b""):
            s = make_store(onb, 8)
            (k,) = _keys(1)
            failed_async = False
            try:
                s.put([(k, bad)])
                _flush(s)
                accepted = s.contains([k])[0]
                assert not accepted, f"a {len(bad)}-byte object was accepted by a store of {onb}-byte objects"
            except ValueError:
                pass
            except BlockStoreError:
                failed_async = True  # asynchronous store: its writer failed closed
            try:
                out = s.get_concatenated([k])
            except BlockStoreError:
                pass
            else:
                raise AssertionError(f"rejected object is readable ({len(out)} bytes)")
            try:
                s.close()
            except BlockStoreError:
                if not failed_async:
                    raise

    def test_retain_release_keep_data(self, make_store: MakeStore) -> None:
        onb = self.object_nbytes
        s = make_store(onb, 64)
        keys = _keys(4)
        s.put([(k, _payload(k, onb)) for k in keys], retain=keys)
        s.put([], release=keys[::-1])  # releasing never deletes while there is room
        assert s.get_concatenated(keys) == b"".join(_payload(k, onb) for k in keys)
        s.close()

    def test_concurrent_readers_during_writes(self, make_store: MakeStore) -> None:
        onb = self.object_nbytes
        s = make_store(onb, 2048)
        stable = _keys(32, "s")
        s.put([(k, _payload(k, onb)) for k in stable])
        fresh = _keys(1600, "f")
        expected_stable = b"".join(_payload(k, onb) for k in stable)
        errors: list[str] = []
        done = threading.Event()
        reads = [0]

        def reader(seed: int) -> None:
            rng = np.random.default_rng(seed)
            while not done.is_set() and not errors:
                try:
                    if s.get_concatenated(stable) != expected_stable:
                        errors.append("stable keys returned different bytes during writes")
                    pick = [fresh[i] for i in rng.integers(0, len(fresh), 8)]
                    try:
                        got = s.get_concatenated(pick)
                    except ObjectMissingError:
                        got = None
                    if got is not None and got != b"".join(_payload(k, onb) for k in pick):
                        errors.append("a fresh key returned bytes that are not its payload")
                    reads[0] += 1
                except Exception:  # noqa: BLE001 - reported below with the traceback
                    errors.append(traceback.format_exc())

        threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(0, len(fresh), 16):
                s.put([(k, _payload(k, onb)) for k in fresh[i : i + 16]])
                time.sleep(0)
        finally:
            done.set()
            for t in threads:
                t.join(timeout=60)
        assert not errors, errors[0]
        assert reads[0] > 0
        assert s.get_concatenated(fresh) == b"".join(_payload(k, onb) for k in fresh)
        s.close()

    def test_ten_thousand_object_batches(self, make_store: MakeStore) -> None:
        onb = self.object_nbytes
        n = 10_000
        s = make_store(onb, n)
        keys = _keys(n)
        data = _payloads(n, onb, seed=5)
        s.put(list(zip(keys, data)))
        assert s.get_concatenated(keys) == data.tobytes()
        assert all(s.contains(keys))
        s.close()


def conformance_checks() -> list[str]:
    """Names of every check in the suite."""
    return sorted(n for n in dir(StoreConformance) if n.startswith("test_"))


def run_conformance(make_store: MakeStore) -> list[str]:
    """Run every check without pytest; raises ``AssertionError`` naming each failed check."""
    suite = StoreConformance()
    passed: list[str] = []
    failed: list[str] = []
    for name in conformance_checks():
        try:
            getattr(suite, name)(make_store)
        except Exception:  # noqa: BLE001 - collected and reported together
            failed.append(f"{name}:\n{traceback.format_exc()}")
        else:
            passed.append(name)
    if failed:
        raise AssertionError(f"{len(failed)} store conformance check(s) failed:\n" + "\n".join(failed))
    return passed
