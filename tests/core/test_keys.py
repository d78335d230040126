"""Store-key derivation: the bulk path (one split for many hashes) equals one key per hash."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from auxout.keys import _BULK_MIN, _REUSE_MIN, ChainKeys, KeySpace, PackedHashes

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


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.booleans(),  # remember the chain after deriving it
            st.integers(0, 3),  # which trunk the chain starts from
            st.integers(0, 40),  # hashes taken from the trunk
            st.lists(st.integers(0, 255), max_size=12),  # then hashes of its own
            st.integers(0, 1),  # generation
        ),
        min_size=1,
        max_size=12,
    ),
    capacity=st.integers(1, 4),
    max_keys=st.integers(_REUSE_MIN, 80),
)
def test_chain_keys_equal_derived_keys(ops: list, capacity: int, max_keys: int) -> None:
    """Whatever was remembered (shared prefixes, diverging chains, evicted entries, another
    generation), the keys handed out are exactly the derived ones, within both bounds."""
    ks = KeySpace("ns")
    chains = ChainKeys(ks, capacity, max_keys)
    trunks = [[bytes([t, i]) * 16 for i in range(40)] for t in range(4)]
    for remember, trunk, shared, own, generation in ops:
        hashes = trunks[trunk][:shared] + [bytes([200, b]) * 16 for b in own]
        if not hashes:
            continue
        pack = PackedHashes.pack(hashes)
        got = chains.keys_batch([pack, PackedHashes.pack(hashes[:1])], generation)
        assert got == ks.keys_batch([pack, PackedHashes.pack(hashes[:1])], generation)
        if remember:
            chains.remember(pack.data, 32, got[0], generation)
        held = list(chains._chains.values())
        assert len(held) <= capacity and chains._num_keys == sum(len(c[2]) for c in held) <= max_keys


def test_a_next_turn_reuses_the_key_objects_of_the_previous_one() -> None:
    ks = KeySpace("ns")
    chains = ChainKeys(ks, capacity=8)
    turn1 = [bytes([i]) * 32 for i in range(2 * _REUSE_MIN)]
    keys1 = chains.keys_batch([PackedHashes.pack(turn1)], 0)[0]
    chains.remember(b"".join(turn1), 32, keys1, 0)
    turn2 = turn1 + [b"\xff" * 32]
    keys2 = chains.keys_batch([PackedHashes.pack(turn2)], 0)[0]
    assert keys2 == ks.keys(turn2, 0)
    assert all(a is b for a, b in zip(keys1, keys2)), "the history's keys are the same string objects"
    diverged = turn1[:3] + [b"\xee" * 32] * _REUSE_MIN  # shares 3 hashes, then differs
    keys3 = chains.keys_batch([PackedHashes.pack(diverged)], 0)[0]
    assert keys3 == ks.keys(diverged, 0) and keys3[0] is keys1[0] and keys3[3] is not keys1[3]
    assert chains.keys_batch([PackedHashes.pack(turn2)], 1)[0] == ks.keys(turn2, 1), "a new generation derives anew"


def test_checkpoint_digest_follows_the_weights_not_the_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Same files anywhere: same digest; one changed byte in a tensor, a dtype or a new shard:
    another; not a local path (a hub id): empty, the caller keys by name and revision."""
    from auxout.keys import checkpoint_digest

    rng = np.random.default_rng(0)
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    weights = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    for d in (a, b):
        (d / "model.safetensors").write_bytes(weights.tobytes())
        (d / "config.json").write_text('{"num_experts": 8}')
        (d / "README.md").write_text(str(d))  # not weights: ignored
    assert checkpoint_digest(a) == checkpoint_digest(b) != ""
    weights[len(weights) // 2] ^= 1  # a training step changes every tensor; a middle sample sees this one
    (b / "model.safetensors").write_bytes(weights.tobytes())
    assert checkpoint_digest(b) != checkpoint_digest(a)
    (b / "model.safetensors").write_bytes((a / "model.safetensors").read_bytes())
    (b / "config.json").write_text('{"num_experts": 8, "torch_dtype": "bfloat16"}')
    assert checkpoint_digest(b) != checkpoint_digest(a)
    assert checkpoint_digest(a / "model.safetensors") not in ("", checkpoint_digest(a))  # one file (gguf)
    assert checkpoint_digest("Qwen/Qwen3-30B-A3B") == "" and checkpoint_digest(tmp_path / "missing") == ""


def test_generations_after_a_reset_belong_to_one_engine_lifetime() -> None:
    """Generation 0 (the loaded weights, named by the fingerprint) is shared by every lifetime;
    a later one (weights updated in place) is not: a restarted engine that counted its updates
    the same way may hold other weights."""
    h = [bytes(range(32))]
    a, b, plain = KeySpace("ns/mfp", "life1"), KeySpace("ns/mfp", "life2"), KeySpace("ns/mfp")
    assert a.keys(h, 0) == b.keys(h, 0) == plain.keys(h, 0)
    assert len({tuple(a.keys(h, 1)), tuple(b.keys(h, 1)), tuple(plain.keys(h, 1))}) == 3
    assert a.keys(h, 2)[0].startswith("auxout/r3/ns/mfp/g2-life1/")
    assert a.keys_batch([PackedHashes.pack(h * 70)], 1)[0][0] == a.keys(h, 1)[0]  # bulk path too
    with pytest.raises(ValueError, match="letters and digits"):
        KeySpace("ns", "a/b")
