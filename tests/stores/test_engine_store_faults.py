"""A shared store dies under a running engine: the requests that need it fail clearly, the rest go on.

Uses a real redis-server killed and restarted by the test. Inline requests whose rows come from
the step itself stay correct while the store is down; requests that need the store (prefix
routes, keys-only manifests) end with a clear error instead of hanging; after the restart new
requests of both kinds succeed.
"""

from __future__ import annotations

import time

import numpy as np

from auxout.manifest import fetch
from auxout.stores.redis import RedisStore
from auxout.testing import FakeMoE, SimEngine, oracle_routes
from auxout.testing.servers import redis_server

MODEL = FakeMoE(num_layers=2, top_k=2, num_experts=16, vocab_size=300, seed=11)
BS = 4


def test_redis_killed_and_restarted_under_the_engine() -> None:
    nbytes = MODEL.profile.block_nbytes(BS)
    rng = np.random.default_rng(0)
    with redis_server() as srv:
        store = RedisStore(srv.url, namespace="faults", object_nbytes=nbytes, timeout=0.5)
        eng = SimEngine(MODEL, block_size=BS, store=store)
        shared = rng.integers(0, 300, 16).tolist()
        eng.add_request("warm", shared, 2)
        eng.add_request("warm-keys", rng.integers(0, 300, 9).tolist(), 3, output="keys")
        warm = eng.run()
        assert warm["warm"].error is None and warm["warm-keys"].manifest is not None
        assert np.array_equal(fetch(warm["warm-keys"].manifest, store=store), oracle_routes(MODEL, warm["warm-keys"]))

        srv.kill()
        t0 = time.monotonic()
        eng.add_request("cold", rng.integers(0, 300, 10).tolist(), 4)  # rows come from its own steps
        eng.add_request("hit", shared + [1, 2], 2)  # needs the prefix routes from the dead store
        eng.add_request("keys", rng.integers(0, 300, 7).tolist(), 2, output="keys")  # needs to publish
        down = eng.run()
        assert time.monotonic() - t0 < 30, "a dead store must not hang the engine"
        assert down["cold"].error is None
        assert np.array_equal(down["cold"].routed_experts, oracle_routes(MODEL, down["cold"]))
        assert down["hit"].num_cached_tokens > 0 and down["hit"].routed_experts is None
        assert down["hit"].error is not None and "unavailable" in down["hit"].error
        assert down["keys"].manifest is None and down["keys"].error is not None

        srv.start()  # same port, empty: objects published before the crash are gone
        eng.add_request("after", rng.integers(0, 300, 11).tolist(), 3)
        eng.add_request("after-keys", rng.integers(0, 300, 13).tolist(), 3, output="keys")
        up = eng.run()
        assert up["after"].error is None
        assert np.array_equal(up["after"].routed_experts, oracle_routes(MODEL, up["after"]))
        manifest = up["after-keys"].manifest
        assert up["after-keys"].error is None and manifest is not None
        assert np.array_equal(fetch(manifest, store=store), oracle_routes(MODEL, up["after-keys"]))
        eng.close()
