"""``auxout`` command line: subcommands live in their own modules and load lazily."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("auxout.vllm.server.serve", "OpenAI-compatible vLLM server with routed experts"),
    "verify": ("auxout.trainer.verify", "rollout vs training routing agreement with and without replay"),
    "demo": ("auxout.demo", "multi-turn rollout with routes verified against an oracle"),
    "rl": ("auxout.trainer.rl_demo", "GRPO with routing replay (TRL + vLLM) on a toy task, KL with and without replay"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: auxout {" + ",".join(COMMANDS) + "} [args...]")
        for name, (_, doc) in COMMANDS.items():
            print(f"  {name:8s} {doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
