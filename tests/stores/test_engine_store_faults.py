"""A shared store dies under a running engine: every request still gets exact routes.

Runs against a real redis-server and a real mooncake_master, each killed and restarted by the
test. Inline requests whose rows come from the step itself stay correct while the store is
down; a prefix hit whose routes are in the dead store is recomputed; a keys-only request whose
manifest cannot be published gets its exact rows inline (none hangs, none fails); after the
restart keys-only requests get manifests again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from auxout.manifest import fetch
from auxout.stores.base import BlockStore
from auxout.testing import FakeMoE, SimEngine, oracle_routes
from auxout.testing.servers import mooncake_master, redis_server

MODEL = FakeMoE(num_layers=2, top_k=2, num_experts=16, vocab_size=300, seed=11)
BS = 4
NBYTES = MODEL.profile.block_nbytes(BS)


@contextmanager
def _redis() -> Iterator[tuple[object, Callable[[], BlockStore]]]:
    from auxout.stores.redis import RedisStore

    with redis_server() as srv:
        yield srv, lambda: RedisStore(srv.url, namespace="faults", object_nbytes=NBYTES, timeout=0.5)


@contextmanager
def _mooncake() -> Iterator[tuple[object, Callable[[], BlockStore]]]:
    from auxout.stores.mooncake import MooncakeStore

    with mooncake_master() as srv:
        yield srv, lambda: MooncakeStore(
            srv.master_addr, object_nbytes=NBYTES, global_segment_size=32 * 2**20,
            local_buffer_size=32 * 2**20, op_timeout=2.0,
        )


BACKENDS = {"redis": _redis, "mooncake": _mooncake}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_store_killed_and_restarted_under_the_engine(backend: str) -> None:
    rng = np.random.default_rng(0)
    with BACKENDS[backend]() as (srv, open_store):
        store = open_store()
        eng = SimEngine(MODEL, block_size=BS, store=store)
        shared = rng.integers(0, 300, 16).tolist()
        eng.add_request("warm", shared, 2)
        eng.add_request("warm-keys", rng.integers(0, 300, 9).tolist(), 3, output="keys")
        warm = eng.run()
        assert warm["warm"].error is None and warm["warm-keys"].manifest is not None
        assert np.array_equal(fetch(warm["warm-keys"].manifest, store=store), oracle_routes(MODEL, warm["warm-keys"]))

        srv.kill()  # type: ignore[attr-defined]
        t0 = time.monotonic()
        eng.add_request("cold", rng.integers(0, 300, 10).tolist(), 4)  # rows come from its own steps
        eng.add_request("hit", shared + [1, 2], 2)  # needs the prefix routes from the dead store
        eng.add_request("keys", rng.integers(0, 300, 7).tolist(), 2, output="keys")  # needs to publish
        down = eng.run()
        assert time.monotonic() - t0 < 60, "a dead store must not hang the engine"
        assert down["cold"].error is None
        assert np.array_equal(down["cold"].routed_experts, oracle_routes(MODEL, down["cold"]))
        for name in ("hit", "keys"):  # recomputed / answered inline: exact, no error
            res = down[name]
            assert res.error is None, res.error
            assert res.manifest is None and np.array_equal(res.routed_experts, oracle_routes(MODEL, res))
        assert eng.scheduler.recomputed_tokens > 0, "the hit's prefix routes were unreachable: recomputed"

        srv.start()  # type: ignore[attr-defined]  # same port, empty: earlier objects are gone
        # A Redis client reconnects on its next call; a Mooncake client re-registers its segment
        # after a few heartbeats (until then the new master refuses puts for lack of space).
        # Keys-only requests are answered inline in that window; none may hang or fail.
        deadline = time.monotonic() + 60
        for attempt in range(1000):
            eng.add_request(f"after{attempt}", rng.integers(0, 300, 11).tolist(), 3)
            eng.add_request(f"after-keys{attempt}", rng.integers(0, 300, 13).tolist(), 3, output="keys")
            up = eng.run()
            inline, keys = up[f"after{attempt}"], up[f"after-keys{attempt}"]
            assert inline.error is None  # inline rows never depend on the store
            assert np.array_equal(inline.routed_experts, oracle_routes(MODEL, inline))
            assert keys.error is None, keys.error
            if keys.manifest is not None:
                break
            assert np.array_equal(keys.routed_experts, oracle_routes(MODEL, keys))
            assert time.monotonic() < deadline, f"{backend}: keys-only requests still inline after the restart"
            time.sleep(0.5)
        assert keys.manifest is not None
        print(f"{backend}: keys-only requests succeed again {time.monotonic() - deadline + 60:.1f}s after the restart")
        assert np.array_equal(fetch(keys.manifest, store=store), oracle_routes(MODEL, keys))
        eng.close()
