"""Store credentials stay with the client: manifests, addresses and messages never show them, and
``auxout.fetch`` takes them from its caller (a parameter or the environment), against a real
password-protected redis-server and a real Mooncake master."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from auxout.connector.keys_output import KeysPublisher
from auxout.credentials import (
    PASSWORD_ENV,
    REDIS_URL_ENV,
    STORE_URL_ENV,
    USERNAME_ENV,
    export_store_url,
    redact,
    resolve_credentials,
    same_server,
    split_credentials,
)
from auxout.errors import StoreAuthError
from auxout.keys import KeySpace
from auxout.manifest import RouteManifest, fetch
from auxout.profile import RouteProfile
from auxout.stores import check_store_options, make_store
from auxout.stores.mooncake import MooncakeStore
from auxout.stores.redis import RedisStore
from auxout.testing.servers import MooncakeMaster, RedisServer, redis_server

SECRET = "s3cret-Pw"  # what must never show up
PROFILE = RouteProfile(num_layers=3, top_k=4, num_experts=32)
BS = 16
ENV = (PASSWORD_ENV, USERNAME_ENV, STORE_URL_ENV, REDIS_URL_ENV)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def locked() -> Iterator[RedisServer]:
    with redis_server(password=SECRET) as srv:
        yield srv


def _manifest(store: RedisStore | MooncakeStore, n: int = 45, seed: int = 0) -> tuple[RouteManifest, np.ndarray]:
    """A keys-only manifest of ``n`` random rows, as an engine's scheduler publishes it."""
    rows = np.random.default_rng(seed).integers(0, 32, size=(n, 3, 4), dtype=np.uint8)
    pub = KeysPublisher(store, keyspace=KeySpace(f"cred-{uuid.uuid4().hex[:6]}"), block_size=BS, profile=PROFILE)
    pub.expect("r", 0)
    pub.add("r", 0, rows)
    hashes = [uuid.uuid4().bytes for _ in range(n // BS)]  # (the engine's block hashes: any bytes)
    return pub.finish("r", block_hashes=hashes, generation=0, token_end=n), rows


@pytest.mark.parametrize(
    "url, clean, user, password",
    [
        ("redis://:s3cret@h:1/0", "redis://h:1/0", None, "s3cret"),
        ("redis://user1:p%40ss@h/1?namespace=n", "redis://h/1?namespace=n", "user1", "p@ss"),
        ("redis://:p@ss@h:2", "redis://h:2", None, "p@ss"),
        ("rediss://h:1/0?password=pw2&username=user2&x=1", "rediss://h:1/0?x=1", "user2", "pw2"),
        ("unix://:pw@/tmp/r.sock?db=0", "unix:///tmp/r.sock?db=0", None, "pw"),
        ("unix:///tmp/r.sock?db=0&password=pw", "unix:///tmp/r.sock?db=0", None, "pw"),
        ("redis://h:1/0", "redis://h:1/0", None, None),
    ],
)
def test_split_and_redact(url: str, clean: str, user: str | None, password: str | None) -> None:
    assert split_credentials(url) == (clean, user, password)
    shown = redact({"url": url, "master_addr": f"u:{password}@h:1"})
    if password:
        assert password not in shown and (user is None or user not in shown), shown


def test_resolution_order(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "redis://127.0.0.1:7000/0"
    assert resolve_credentials(url) == (url, None, None)
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    assert resolve_credentials(url)[2] == "from-env"
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:from-redis-url@127.0.0.1:7000/3")  # same server, other db
    assert resolve_credentials(url)[2] == "from-redis-url"
    monkeypatch.setenv(STORE_URL_ENV, "redis://:other@10.0.0.1:7000 redis://me:from-store-url@127.0.0.1:7000")
    assert resolve_credentials(url)[1:] == ("me", "from-store-url")
    assert resolve_credentials("redis://:in-url@127.0.0.1:7000/0")[2] == "in-url"
    assert resolve_credentials(url, password="param")[1:] == (None, "param")
    # a URL of another server lends nothing
    monkeypatch.delenv(PASSWORD_ENV)
    assert resolve_credentials("redis://127.0.0.1:7001/0")[1:] == (None, None)
    assert same_server("redis://h/0", "redis://:x@H:6379/5") and not same_server("redis://h:1", "unix:///h:1")


def test_export_store_url_refuses_other_credentials_for_the_same_server(monkeypatch: pytest.MonkeyPatch) -> None:
    export_store_url(f"redis://:{SECRET}@127.0.0.1:7000/0")
    export_store_url(f"redis://:{SECRET}@127.0.0.1:7000/1")  # the same credentials: nothing to do
    import os

    assert os.environ[STORE_URL_ENV] == f"redis://:{SECRET}@127.0.0.1:7000/0"
    with pytest.raises(ValueError) as ei:
        export_store_url("redis://:another-one@127.0.0.1:7000/0")
    assert "another-one" not in str(ei.value) and SECRET not in str(ei.value)


def test_store_options_errors_never_show_credentials() -> None:
    with pytest.raises(ValueError) as ei:
        check_store_options("redis", {"url": f"http://:{SECRET}@h:1", "namespace": "n"})
    assert "url" in str(ei.value) and SECRET not in str(ei.value)
    with pytest.raises(ValueError) as ei:
        check_store_options("mooncake", {"master_addr": f"admin:{SECRET}@127.0.0.1:5000"})
    assert "master_addr" in str(ei.value) and "no credentials" in str(ei.value) and SECRET not in str(ei.value)
    with pytest.raises(ValueError) as ei:
        MooncakeStore(f"admin:{SECRET}@127.0.0.1:5000", object_nbytes=64)
    assert SECRET not in str(ei.value)
    with pytest.raises(ValueError) as ei:
        RouteManifest(("k",), 0, 1, 0, 1, BS, (3, 4), "|u1", f"redis://:{SECRET}@h:1/0?namespace=n")
    assert "carries credentials" in str(ei.value) and SECRET not in str(ei.value)


def test_manifests_of_a_password_protected_redis_name_no_credentials(
    locked: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    onb = PROFILE.block_nbytes(BS)
    store = make_store("redis", max_bytes=1 << 20, object_nbytes=onb, url=locked.auth_url + "/0", namespace="c1")
    try:
        m, rows = _manifest(store)  # (written and read back through the store: the password works)
    finally:
        store.close()
    text = m.to_json()
    assert SECRET not in text and "@" not in m.store, m.store
    assert m.store == f"{locked.url}/0?namespace=c1"

    # the reader brings the credentials: without them, a clear error that names where they go
    with pytest.raises(StoreAuthError) as ei:
        fetch(RouteManifest.from_json(text))
    msg = str(ei.value)
    assert "no password was given" in msg and "fetch(manifest, password=" in msg and PASSWORD_ENV in msg
    with pytest.raises(StoreAuthError) as ei:
        fetch(m, password="not-it")
    assert "not accepted" in str(ei.value) and "not-it" not in str(ei.value)
    np.testing.assert_array_equal(fetch(m, password=SECRET), rows)
    monkeypatch.setenv(REDIS_URL_ENV, locked.auth_url)  # as redis-py applications configure it
    np.testing.assert_array_equal(fetch(m), rows)
    monkeypatch.delenv(REDIS_URL_ENV)
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    np.testing.assert_array_equal(fetch(m), rows)
    for record in caplog.records:
        assert SECRET not in record.getMessage()


def test_redis_store_messages_and_address_never_show_the_password(locked: RedisServer) -> None:
    with RedisStore(f"redis://:{SECRET}@127.0.0.1:1/0", namespace="n", object_nbytes=64, timeout=0.5) as dead:
        assert SECRET not in dead.url and SECRET not in dead.address
        with pytest.raises(Exception) as ei:  # nothing listens there: unavailable, URL shown without it
            dead.contains(["k"])
        assert "127.0.0.1:1" in str(ei.value) and SECRET not in str(ei.value)
    with RedisStore(locked.url, namespace="n", object_nbytes=64) as store, pytest.raises(StoreAuthError):
        store.put([("k", b"x" * 64)])


def test_mooncake_manifest_names_the_master_alone(mooncake_srv: MooncakeMaster) -> None:
    onb = PROFILE.block_nbytes(BS)
    with MooncakeStore(mooncake_srv.master_addr, object_nbytes=onb, global_segment_size=16 * 2**20,
                       local_buffer_size=16 * 2**20) as store:  # fmt: skip
        m, rows = _manifest(store, seed=1)
        assert m.store == f"mooncake://{mooncake_srv.master_addr}" and "@" not in m.to_json()
        np.testing.assert_array_equal(fetch(m), rows)
        with pytest.raises(ValueError, match="takes no credentials"):
            fetch(m, password=SECRET)
