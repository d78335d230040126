"""KV connector hits that end at every offset inside a block, front- and tail-aligned, sync and async.

A prefill engine computes each prompt and saves its KV to a ``SimKVConnector``; a decode engine
then admits the same prompt and takes the connector's hit. ``SimKVConnector.load`` is the
placement oracle: a hit taken in part would put blocks on the wrong positions (a tail-aligned
connector such as NIXL lines the remote blocks up from the end) and raises. Every decode result
must equal a full pass of ``FakeMoE`` over its tokens, with no error and no request restarted.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from auxout.stores import ArenaStore
from auxout.testing import FakeMoE, SimEngine, SimKVConnector, oracle_routes

MODEL = FakeMoE(num_layers=2, top_k=2, num_experts=8, vocab_size=50, seed=3)


def pd_pair(block_size: int, align: str, async_load: bool, shared: bool) -> tuple[SimEngine, SimEngine, SimKVConnector]:
    conn = SimKVConnector(align, async_load)
    obj = MODEL.profile.block_nbytes(block_size)
    store = ArenaStore(4096 * obj, obj) if shared else None
    kw = {"block_size": block_size, "num_kv_blocks": 512, "store": store, "kv_connector": conn, "shared_store": shared}
    return SimEngine(MODEL, **kw), SimEngine(MODEL, **kw), conn  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([2, 4, 8]),
    blocks=st.integers(0, 5),
    data=st.data(),
    align=st.sampled_from(["front", "tail"]),
    async_load=st.booleans(),
    shared=st.booleans(),
    local_blocks=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_hits_ending_at_every_offset_in_a_block(
    block_size: int, blocks: int, data: st.DataObject, align: str, async_load: bool, shared: bool,
    local_blocks: int, seed: int,
) -> None:  # fmt: skip
    offset = data.draw(st.integers(0 if blocks else 1, block_size - 1), label="offset")
    length = blocks * block_size + offset
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, MODEL.vocab_size, length).tolist()
    prefill, decode, conn = pd_pair(block_size, align, async_load, shared)
    # the decode engine already holds a prefix of it locally (an earlier turn)
    local = min(local_blocks * block_size, length - 1)
    if local:
        decode.add_request("warm", prompt[:local] + [1], 1)
        (warm,) = decode.run().values()
        assert warm.error is None
    prefill.add_request("p", prompt, 1)
    (p,) = prefill.run().values()
    assert p.error is None and np.array_equal(p.routed_experts, oracle_routes(MODEL, p))
    prefill.store.flush()  # (its background writer has put the prompt's route blocks)
    decode.add_request("d", prompt, 4)
    (d,) = decode.run().values()
    assert d.error is None, d.error
    assert np.array_equal(d.routed_experts, oracle_routes(MODEL, d))
    assert decode.scheduler.recomputed_requests == 0, "no request may be restarted for its routes"
    whole = (length - 1) // block_size * block_size  # vLLM resumes at the last token: its block recomputes
    own = min(local // block_size * block_size, whole)  # the decode engine's own prefix cache
    if shared and (async_load or align == "front"):
        assert d.num_cached_tokens == whole, "the peer's KV and routes must be used, from a block boundary"
    else:  # routes unreadable (private store), or a synchronous whole-prompt hit: refused
        assert d.num_cached_tokens == own
    if not shared:
        assert conn.loaded_tokens == 0, "a hit none of whose routes are readable must not be loaded"


@pytest.mark.parametrize("offset", [1, 3])
def test_the_placement_oracle_catches_a_hit_cut_to_whole_blocks(offset: int) -> None:
    """A tail-aligned hit cut to whole blocks (its partial block dropped) shifts every block."""
    bs = 4
    prefill, decode, conn = pd_pair(bs, "tail", True, True)
    prompt = list(range(1, 2 * bs + offset + 1))
    prefill.add_request("p", prompt, 1)
    prefill.run()
    prefill.store.flush()
    honest = decode.scheduler.external_hit

    def cut(request, num_local, num_external, load_async):  # type: ignore[no-untyped-def]
        n = honest(request, num_local, num_external, load_async)
        return n - (num_local + n) % bs

    decode.scheduler.external_hit = cut  # type: ignore[method-assign]
    decode.add_request("d", prompt, 2)
    with pytest.raises(AssertionError, match="tail-aligned.*wrong positions"):
        decode.run()
