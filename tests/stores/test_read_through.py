"""ReadThroughStore: an engine's own shared-memory segment plus another engine's, on one host (P/D)."""

from __future__ import annotations

import numpy as np
import pytest

from auxout.errors import ObjectMissingError
from auxout.stores import make_store
from auxout.stores.read_through import ReadThroughStore, peers_contains
from auxout.stores.shm import SharedMemoryStore

OBJ = 64


def payload(i: int) -> bytes:
    return np.full(OBJ, i, dtype=np.uint8).tobytes()


def test_reads_own_and_peer_objects_in_order() -> None:
    prefill = SharedMemoryStore(16 * OBJ, OBJ)
    decode = make_store(
        "shm", max_bytes=16 * OBJ, object_nbytes=OBJ, background=False, read_from=[prefill.address]
    )
    try:
        assert isinstance(decode, ReadThroughStore)
        prefill.put([("a", payload(1)), ("b", payload(2))])
        decode.put([("c", payload(3))])
        assert decode.contains(["a", "c", "x"]) == [True, True, False]
        assert decode.get_concatenated(["c", "a", "b"]) == payload(3) + payload(1) + payload(2)
        with pytest.raises(ObjectMissingError, match="x"):
            decode.get_concatenated(["a", "x"])
        assert peers_contains([prefill.address])(["a", "c"]) == [True, False]  # the scheduler's view
    finally:
        decode.close()
        prefill.close()


def test_peer_that_is_not_there_yet_reads_as_missing() -> None:
    decode = make_store(
        "shm", max_bytes=4 * OBJ, object_nbytes=OBJ, background=False, read_from=["shm://auxout-r3-nobody"]
    )
    try:
        decode.put([("c", payload(3))])
        assert decode.contains(["c", "a"]) == [True, False]
        assert peers_contains(["shm://auxout-r3-nobody"])(["a"]) == [False]
    finally:
        decode.close()
