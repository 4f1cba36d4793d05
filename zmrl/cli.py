"""The `zmrl` command. Usage: zmrl <command> --help

Each subcommand is a module in zmrl/commands/ with `add_parser(subparsers)` and `run(args)`;
it is listed in COMMANDS below and imported only when needed, so `zmrl --help` stays light.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ["init_model", "bench", "check", "make_data", "train", "report", "doctor"]  # module names under zmrl.commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zmrl", description="RL on LLMs with zero rollout/trainer mismatch")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"zmrl.commands.{name}")
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `zmrl ... | head -1`: the reader is gone; end quietly, as `yes | head` does
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush must not fail again
        return 141  # 128 + SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
