"""``auxout serve`` reaches every engine option, from flags, the user's config or the environment,
and rejects a missing, unknown or conflicting option at argument parsing, naming it."""

from __future__ import annotations

import json

import pytest

from auxout.vllm.options import CONFIG_KEY, VllmOptions
from auxout.vllm.server.serve import ServeArgumentError, main, vllm_argv

REDIS = {"url": "redis://127.0.0.1:1/0", "namespace": "r3"}


def options_of(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--additional-config") + 1])[CONFIG_KEY]


def test_every_option_has_a_flag():
    argv = vllm_argv([
        "/m", "--auxout-store", "redis", "--auxout-store-options", json.dumps(REDIS), "--auxout-max-bytes", "4096",
        "--auxout-namespace", "ns", "--auxout-default-return", "false", "--auxout-output", "keys",
        "--auxout-routing-weights", "true",
    ])  # fmt: skip
    got = VllmOptions.from_dict(options_of(argv))
    assert got == VllmOptions(store="redis", store_options=REDIS, max_bytes=4096, namespace="ns",
                              default_return=False, output="keys", routing_weights=True)  # fmt: skip
    assert not any(a.startswith("--auxout") for a in argv)


def test_user_additional_config_and_env_are_honoured():
    user = {"x": 1, CONFIG_KEY: {"store": "redis", "store_options": REDIS}}
    argv = vllm_argv(["/m", f"--additional-config={json.dumps(user)}", "--auxout-namespace", "a"],
                     env=json.dumps({"max_bytes": 1 << 20}))  # fmt: skip
    extra = json.loads(argv[argv.index("--additional-config") + 1])
    assert extra["x"] == 1
    assert extra[CONFIG_KEY] == {**VllmOptions().to_dict(), "store": "redis", "store_options": REDIS,
                                 "namespace": "a", "max_bytes": 1 << 20}  # fmt: skip
    # the same value from two sources is fine
    vllm_argv(["/m", "--auxout-store", "redis", "--additional-config", json.dumps(user)])
    vllm_argv(["/m", "--auxout-store", "redis", "--auxout-store=redis", "--additional-config", json.dumps(user)])


@pytest.mark.parametrize(
    "argv, env, needle",
    [
        (["/m", "--auxout-store", "redis"], None, "'url', 'namespace'"),  # was KeyError: 'url' in the worker
        (["/m", "--auxout-store", "redis", "--auxout-store-options", '{"url": "redis://h"}'], None, "'namespace'"),
        (["/m", "--auxout-store-options", '{"colour": 1}'], None, "colour"),
        (["/m", "--auxout-store", "nosuch"], None, "nosuch"),
        (["/m", "--auxout-output", "keys"], None, "keys"),
        (["/m", "--auxout-max-bytes", "0"], None, "positive"),
        (["/m", "--auxout-routing-weights", "maybe"], None, "--auxout-routing-weights"),
        (["/m"], '{"routing_weights": "yes"}', "routing_weights must be a bool"),
        (["/m", "--auxout-store-options", "[1]"], None, "JSON object"),
        (["/m", "--auxout-bogus", "1"], None, "--auxout-bogus"),
        (["/m", "--auxout-namespace", "a", "--additional-config", json.dumps({CONFIG_KEY: {"namespace": "b"}})],
         None, "'namespace' is 'b' in --additional-config auxout but 'a' in --auxout-* flags"),
        (["/m", "--auxout-namespace", "a"], '{"namespace": "c"}', "'namespace' is 'c' in AUXOUT_VLLM_OPTIONS"),
        (["/m"], '{"nonsense": 1}', "nonsense"),
        (["/m"], "{not json", "AUXOUT_VLLM_OPTIONS"),
        (["/m", "--additional-config", "{bad"], None, "--additional-config"),
        # the same flag twice (argparse kept the last, silently)
        (["/m", "--auxout-store", "shm", "--auxout-store", "arena"], None, "--auxout-store is given twice, 'shm' and 'arena'"),
        (["/m", "--auxout-namespace=a", "--auxout-namespace", "b"], None, "--auxout-namespace is given twice"),
        # store option values, before any engine starts (they failed in the worker, 30-70 s later)
        (["/m", "--auxout-store", "redis", "--auxout-store-options",
          '{"url": "redis://h", "namespace": "n", "timeout": -1}'], None, "'timeout' must be positive finite seconds, got -1"),
        (["/m", "--auxout-store", "redis", "--auxout-store-options",
          '{"url": "redis://h", "namespace": "n", "retry_after": "3"}'], None, "'retry_after' must be non-negative"),
        # the route session store
        (["/m", "--auxout-session-store", "redis"], None, "the route store is 'arena': use --auxout-store redis"),
        (["/m", "--auxout-session-store", "http://h"], None, "must be memory, redis or a redis://"),
        (["/m", "--auxout-session-ttl", "60"], None, "--auxout-session-ttl applies to a shared session store"),
        (["/m", "--auxout-session-store", "redis://h", "--auxout-session-lease", "0"], None, "positive number"),
    ],
)
def test_bad_options_fail_at_parse_time_naming_the_option(argv, env, needle):
    with pytest.raises(ServeArgumentError) as ei:
        vllm_argv(argv, env=env)
    assert needle in str(ei.value)


def test_session_store_flags_pick_the_store():
    from auxout.vllm.server.redis_sessions import RedisSessionStore
    from auxout.vllm.server.serve import _split, session_store
    from auxout.vllm.server.sessions import SessionStore

    _, ours = _split(["/m", "--auxout-max-sessions", "7"], None)
    memory = session_store(ours, "tiny")
    assert isinstance(memory, SessionStore) and memory.max_sessions == 7
    store = ["--auxout-store", "redis", "--auxout-store-options", json.dumps(REDIS), "--auxout-namespace", "fl"]
    _, ours = _split(["/m", *store, "--auxout-session-store", "redis", "--auxout-session-ttl", "60",
                      "--auxout-session-lease", "5"], None)  # fmt: skip
    shared = session_store(ours, "tiny")  # (no connection made yet)
    assert isinstance(shared, RedisSessionStore) and shared.ttl == 60 and shared.turn_lease == 5
    assert shared.url == REDIS["url"] and shared._prefix == "auxout:sessions:{fl}:tiny:"
    _, ours = _split(["/m", "--auxout-session-store", "redis://127.0.0.1:2/3"], None)
    assert session_store(ours, "m").url == "redis://127.0.0.1:2/3"


def test_main_reports_option_errors_without_starting(capsys, monkeypatch):
    monkeypatch.setenv("AUXOUT_VLLM_OPTIONS", '{"store": "redis"}')
    assert main(["/m"]) == 2
    assert "needs store option(s) ['url', 'namespace']" in capsys.readouterr().err


def test_engine_kwargs_reject_a_redis_store_without_namespace():
    from auxout.vllm import engine_kwargs

    with pytest.raises(ValueError, match="'namespace'"):
        engine_kwargs(store="redis", store_options={"url": "redis://127.0.0.1:6379"})
    with pytest.raises(ValueError, match="master_addr"):
        engine_kwargs(store="mooncake")
    engine_kwargs(store="redis", store_options=REDIS)


SECRET = "s3cret-Pw"


def test_store_credentials_never_reach_vllms_config_or_an_error(capsys, monkeypatch):
    """vLLM logs its whole config at startup (``additional_config`` included) and pickles it to its
    processes: a store URL's password goes to ``AUXOUT_STORE_URL``, which they inherit, instead."""
    from auxout.credentials import STORE_URL_ENV
    from auxout.vllm import engine_kwargs

    monkeypatch.setenv(STORE_URL_ENV, "")  # (restored after the test: engine_kwargs sets it)
    secret_url = f"redis://:{SECRET}@127.0.0.1:1/0"
    options = {"url": secret_url, "namespace": "r3"}
    argv = vllm_argv(["/m", "--auxout-store", "redis", "--auxout-store-options", json.dumps(options)])
    assert SECRET not in " ".join(argv)
    assert options_of(argv)["store_options"] == {"url": "redis://127.0.0.1:1/0", "namespace": "r3"}
    import os

    assert os.environ[STORE_URL_ENV] == secret_url
    kw = engine_kwargs(store="redis", store_options=options)  # (offline: the same)
    assert SECRET not in json.dumps(kw["additional_config"])
    # two sources that disagree, and a bad value: the messages quote neither password
    for bad in (
        ["/m", "--auxout-store-options", json.dumps(options), "--additional-config",
         json.dumps({CONFIG_KEY: {"store_options": {**options, "url": "redis://:other-Pw@h:1/0"}}})],
        ["/m", "--auxout-store", "redis", "--auxout-store-options", json.dumps({**options, "url": f"http://:{SECRET}@h"})],
        ["/m", "--auxout-store", "mooncake", "--auxout-store-options", json.dumps({"master_addr": f"a:{SECRET}@h:1"})],
        ["/m", "--auxout-store-options", f'{{"url": "redis://:{SECRET}@h:1/0", bad json']
    ):  # fmt: skip
        with pytest.raises(ServeArgumentError) as ei:
            vllm_argv(bad)
        assert SECRET not in str(ei.value) and "other-Pw" not in str(ei.value), ei.value
        assert main(bad) == 2
        assert SECRET not in capsys.readouterr().err
