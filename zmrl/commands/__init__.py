"""Subcommands of the `zmrl` CLI: one module each, with add_parser(subparsers) and run(args).
Modules import heavy libraries inside run(), never at import time."""
