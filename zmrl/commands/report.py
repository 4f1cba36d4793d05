"""zmrl report RUN_DIR [--out DIR]

Reads RUN_DIR/metrics.jsonl and writes PNG plots (reward, mismatch, KL to the reference policy,
throughput) and summary.txt into RUN_DIR/report/ (or --out), and prints the summary.
"""
from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="plots and a summary of a run's metrics",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--out", help="output dir (default RUN_DIR/report)")
    return p


def run(args) -> int:
    from zmrl.rl.report import write_report

    try:
        summary, files = write_report(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"zmrl report: {e}", file=sys.stderr)
        return 2
    print(summary)
    for f in files:
        print(f"wrote {f}")
    return 0
