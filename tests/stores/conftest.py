"""Real servers for the store tests: one redis-server and one mooncake_master per session.

They run on free 127.0.0.1 ports and are killed at session end (also when tests fail). If a
server cannot start the fixture raises: the store tests fail loudly instead of skipping.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from auxout.testing.servers import MooncakeMaster, RedisServer, mooncake_master, redis_server


@pytest.fixture(scope="session")
def redis_srv() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


@pytest.fixture(scope="session")
def mooncake_srv() -> Iterator[MooncakeMaster]:
    with mooncake_master() as srv:
        yield srv
