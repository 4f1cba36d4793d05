"""zmrl bench kernels: the batch-invariant CPU kernels vs torch's default ops, in one run.

    zmrl bench kernels [--quick] [--out FILE.md]

(The H200 Triton benchmark is benchmarks/triton_bench.py.)
"""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="benchmarks (kernels)")
    which = parser.add_subparsers(dest="bench", required=True)
    kernels = which.add_parser("kernels", help="invariant CPU kernels vs torch defaults, ratios measured in one run")
    kernels.add_argument("--quick", action="store_true", help="a few shapes only (about a minute)")
    kernels.add_argument("--out", help="also write the table (markdown) to this file")
    return parser


def run(args: argparse.Namespace) -> int:
    from zmrl.bench.cpu_kernels import run as run_kernels

    run_kernels(args)
    return 0
