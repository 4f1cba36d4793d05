"""zmrl make-data arithmetic --out FILE.jsonl [--size N] [--seed S] [--max-operand K] [--max-answer A]
                          [--ops +-*] [--first-operands 1,2] [--no-equals] [--shots K]

    zmrl make-data arithmetic --out runs/data/a_plus_b.jsonl                        # "3+4=" -> "7"
    zmrl make-data arithmetic --out runs/data/one_plus.jsonl --first-operands 1 --max-operand 8 --no-equals

Writes the locally generated arithmetic task (rows {"prompt": "3+4=", "answer": "7"}) that
recipes/tiny_cpu.toml trains on; see zmrl/data/arithmetic.py for the reward.
"""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("make-data", help="write a locally generated task dataset (JSONL)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=["arithmetic"])
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--max-answer", type=int, default=None)
    p.add_argument("--ops", default="+")
    p.add_argument("--first-operands", help="comma-separated fixed first operands (default 0..max-operand)")
    p.add_argument("--no-equals", action="store_true", help='prompts "a+b" instead of "a+b="')
    p.add_argument("--shots", type=int, default=0, help="solved examples before every question (one shared context)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    return p


def run(args) -> int:
    """Exit 0 written, 2 bad arguments or an existing --out without --force (nothing written)."""
    import sys
    from pathlib import Path

    from zmrl.data.arithmetic import make_rows, write_dataset

    def fail(message: str) -> int:
        print(f"zmrl make-data: {message}", file=sys.stderr)
        return 2

    out = Path(args.out)
    if args.size < 1:
        return fail(f"--size must be >= 1, got {args.size}")
    if out.is_dir():
        return fail(f"--out {out} is a directory")
    if out.exists() and not args.force:
        return fail(f"--out {out} exists; pass --force to replace it")
    try:
        firsts = [int(x) for x in args.first_operands.split(",")] if args.first_operands else None
    except ValueError:
        return fail(f"--first-operands must be comma-separated integers, got {args.first_operands!r}")
    options = dict(max_operand=args.max_operand, max_answer=args.max_answer, ops=args.ops,
                   equals=not args.no_equals, first_operands=firsts, shots=args.shots)
    try:
        make_rows(1, seed=args.seed, **options)  # every argument checked before anything is written
        path = write_dataset(out, size=args.size, seed=args.seed, **options)
    except ValueError as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"cannot write {out}: {e.strerror}")
    print(f"wrote {args.size} {args.task} rows to {path}")
    return 0
