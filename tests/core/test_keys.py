"""Store-key derivation: the bulk path (one split for many hashes) equals one key per hash."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from auxout.keys import _BULK_MIN, KeySpace, PackedHashes

namespaces = st.text(min_size=1, max_size=24).filter(lambda s: not any(c.isspace() for c in s) and ".." not in s)


@settings(max_examples=60, deadline=None)
@given(
    namespace=namespaces,
    generation=st.integers(0, 10**6),
    item_size=st.sampled_from([8, 16, 32]),
    counts=st.lists(st.integers(1, 2 * _BULK_MIN), min_size=1, max_size=5),
    data=st.data(),
)
def test_keys_and_keys_batch_equal_one_key_per_hash(
    namespace: str, generation: int, item_size: int, counts: list[int], data: st.DataObject
) -> None:
    ks = KeySpace(namespace)
    hashes = [[data.draw(st.binary(min_size=item_size, max_size=item_size)) for _ in range(n)] for n in counts]
    want = [[ks.prefix(generation) + h.hex() for h in hs] for hs in hashes]
    packs = [PackedHashes.pack(hs) for hs in hashes]
    assert [ks.keys(p, generation) for p in packs] == want
    assert [ks.keys(hs, generation) for hs in hashes] == want
    assert ks.keys_batch(packs, generation) == want


def test_keys_batch_with_mixed_hash_sizes_falls_back_per_request() -> None:
    ks = KeySpace("ns")
    packs = [PackedHashes.pack([bytes([i]) * 32 for i in range(_BULK_MIN)]), PackedHashes.pack([b"\x01" * 8])]
    assert ks.keys_batch(packs, 3) == [ks.keys(p, 3) for p in packs]
    assert ks.keys_batch(packs, 3)[1] == ["auxout/r3/ns/g3/" + "01" * 8]
    assert ks.keys_batch([], 3) == []


@pytest.mark.parametrize("namespace", ["a b", "", "x/../y"])
def test_invalid_namespaces_are_rejected(namespace: str) -> None:
    with pytest.raises(ValueError, match="invalid key namespace"):
        KeySpace(namespace)
