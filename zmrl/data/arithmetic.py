"""A verifiable arithmetic task generated locally: prompts "a+b=" with an exact-match reward.

    zmrl make-data arithmetic --out data/arith.jsonl --size 2000      # or data.generate in a recipe

Rows are {"prompt": "3+4=", "answer": "7"}. The tiny preset's tokenizer was trained on
arithmetic text, so every digit and most small numbers are single tokens, and prompts tokenize to
[a, "+", b, "="]. The default answer vocabulary is small (sums 0..max_answer): a freshly initialized
model hits a listed number often enough for group baselines to see a signal within a few steps.

Reward: 1.0 when the number the completion starts with equals the answer exactly (what follows the
number is ignored, as answer extraction does for GSM8K); `format_reward` when it starts with some
other number; 0.0 otherwise.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")


def make_rows(size: int, seed: int = 0, max_operand: int = 9, max_answer: int = 9, ops: str = "+") -> list[dict]:
    """`size` rows drawn uniformly (with replacement) from every a <op> b with operands in
    [0, max_operand] and an answer in [0, max_answer]."""
    pool = []
    for op in ops:
        if op not in "+-*":
            raise ValueError(f"unknown operator {op!r}; use + - *")
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                value = a + b if op == "+" else a - b if op == "-" else a * b
                if 0 <= value <= max_answer:
                    pool.append({"prompt": f"{a}{op}{b}=", "answer": str(value)})
    if not pool:
        raise ValueError("no problem fits max_operand / max_answer")
    rng = random.Random(seed)
    return [dict(rng.choice(pool)) for _ in range(size)]


def write_dataset(out: str | Path, size: int = 2000, seed: int = 0, **options) -> Path:
    """Write make_rows(...) as JSONL (atomically: a partial file never appears under `out`)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in make_rows(size, seed, **options)))
    tmp.replace(out)
    return out


def format_examples(num_rows: int, seed: int = 0) -> list[str]:
    """One uniformly random digit per row: the answers of the format-only warm start (the format is
    "a number, then EOS"; which number is right is left for RL to find)."""
    rng = random.Random(seed + 7919)
    return [str(rng.randint(0, 9)) for _ in range(num_rows)]


def leading_number(completion: str) -> str | None:
    m = _LEADING_NUMBER.match(completion)
    return m.group(1) if m else None


def reward(completion: str, example: dict, format_reward: float = 0.1) -> float:
    """1.0 exact answer, format_reward for another leading number, else 0.0."""
    got = leading_number(completion)
    if got is None:
        return 0.0
    return 1.0 if got == str(example["answer"]).strip() else float(format_reward)


def exact(completion: str, example: dict) -> float:
    """Exact match only (no format credit): the accuracy metric."""
    return 1.0 if leading_number(completion) == str(example["answer"]).strip() else 0.0
