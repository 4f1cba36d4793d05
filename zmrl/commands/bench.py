"""zmrl bench kernels|vllm: invariant vs default kernels, each measured in one run.

    zmrl bench kernels [--quick] [--out FILE.md]      the CPU kernels vs torch's default ops
                       [--only OP] [--threads N] [--cpu-time]
    zmrl bench vllm [--presets tiny,small] [...]     vLLM generation tokens/s, invariance on vs off
                                                     (alias: zmrl bench throughput)
    zmrl bench train [--preset small] [...]          trainer tokens/s, invariance on vs off vs
                                                     transformers + PEFT, and fraction of bf16 peak

(The H200 Triton benchmark is benchmarks/triton_bench.py.)
Bad arguments (an --out that cannot be written, a model whose weights cannot fit, ...) are
refused in one line with exit status 2 before anything is built or timed.
"""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="benchmarks (kernels, vllm throughput)")
    which = parser.add_subparsers(dest="bench", required=True)
    kernels = which.add_parser("kernels", help="invariant CPU kernels vs torch defaults, ratios measured in one run")
    kernels.add_argument("--quick", action="store_true", help="a few shapes only (about a minute)")
    kernels.add_argument("--out", help="also write the table (markdown) to this file")
    kernels.add_argument("--only", help="only the ops whose name starts with this (e.g. linear)")
    kernels.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    kernels.add_argument("--cpu-time", action="store_true",
                         help="time by this process's CPU time, not wall time (for a shared machine; use --threads 1)")
    vllm = which.add_parser("vllm", aliases=["throughput"],
                            help="generation tokens/s of the zmrl model in vLLM, invariance on vs off, one run")
    vllm.add_argument("--presets", default="tiny,small", help="comma-separated `zmrl init-model` presets")
    vllm.add_argument("--num-requests", type=int, default=8)
    vllm.add_argument("--prompt-len", type=int, default=64)
    vllm.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request")
    vllm.add_argument("--repeats", type=int, default=2, help="timed runs per mode (alternating on/off)")
    vllm.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    vllm.add_argument("--out", help="also write the table (markdown) to this file")
    from zmrl.bench.train_throughput import add_arguments

    train = which.add_parser("train", help="trainer tokens/s: zmrl invariance on/off vs transformers + PEFT, one run")
    add_arguments(train)
    return parser


def run(args: argparse.Namespace) -> int:
    import sys

    from zmrl.bench import BenchInputError

    if args.bench == "train":
        from zmrl.bench.train_throughput import run as run_bench
    elif args.bench == "kernels":
        from zmrl.bench.cpu_kernels import run as run_bench
    else:
        from zmrl.bench.vllm_throughput import run as run_bench
    try:
        run_bench(args)
    except BenchInputError as e:  # raised before anything is built or timed
        print(f"zmrl bench {args.bench}: {e}", file=sys.stderr)
        return 2
    return 0
