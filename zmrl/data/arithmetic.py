"""A verifiable arithmetic task generated locally, with an exact-match reward.

    zmrl make-data arithmetic --out data/arith.jsonl --size 2000        # or data.generate in a recipe

Rows are {"prompt": "3+4=", "answer": "7"}. The tiny preset's tokenizer was trained on arithmetic
text, so every digit and the operators are single tokens ("3", "+", "4", "=").

`shots=k` puts k solved examples before every question, one per line, each written exactly as the
model should answer it: question, answer, newline ("1+34\n1+56\n1+7" -> "8"). The k examples are
drawn once per dataset, so every row starts with the same context: its prompt is longer than the
tiny preset's index_topk (sparse attention selects a real subset of it), a rollout engine's prefix
cache serves the shared part, and a small prefill budget splits it into chunks.

The tiny recipe uses the form "1+a" (first_operands=[1], equals=False; answers 1..9): there the
answer is a function of the *last* prompt token, which a 4-layer, randomly initialized model picks up
within a few dozen steps on 2 CPU cores. With two free operands ("a+b=") the answer depends on a token
the last position has to attend to, and such a model needs far longer (measured here: 80 supervised
full-weight steps still left it at the answers' marginal distribution).

Reward: 1.0 when the number the completion starts with equals the answer exactly (what follows the
number is ignored, as answer extraction does for GSM8K), else `format_reward` if it starts with some
other number (default 0.0: exact match only), else 0.0.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def make_rows(size: int, seed: int = 0, max_operand: int = 9, max_answer: int | None = None, ops: str = "+",
              first_operands: list[int] | None = None, equals: bool = True, shots: int = 0) -> list[dict]:
    """`size` rows drawn uniformly (with replacement) from every "a<op>b" (+ "=" when `equals`) with
    a in first_operands (default 0..max_operand), b in 0..max_operand, and an answer in
    [0, max_answer] (default: no upper bound); each prompt preceded by the same `shots` solved
    examples (see the module doc)."""
    _check_count("shots", shots)
    _check_count("max_operand", max_operand)
    if max_answer is not None:
        _check_count("max_answer", max_answer)
    pool = []
    firsts = range(max_operand + 1) if first_operands is None else first_operands
    for op in ops:
        if op not in "+-*":
            raise ValueError(f"unknown operator {op!r}; use + - *")
        for a in firsts:
            for b in range(max_operand + 1):
                value = a + b if op == "+" else a - b if op == "-" else a * b
                if value >= 0 and (max_answer is None or value <= max_answer):
                    pool.append({"prompt": f"{a}{op}{b}" + ("=" if equals else ""), "answer": str(value)})
    if not pool:
        raise ValueError("no problem fits these operands and max_answer")
    rng = random.Random(seed)
    rows = [dict(rng.choice(pool)) for _ in range(size)]
    if shots:
        examples = random.Random(f"shots-{seed}").choices(pool, k=shots)
        context = "".join(f"{e['prompt']}{e['answer']}\n" for e in examples)
        for row in rows:
            row["prompt"] = context + row["prompt"]
    return rows


def write_dataset(out: str | Path, size: int = 2000, seed: int = 0, **options) -> Path:
    """Write make_rows(...) as JSONL (atomically: a partial file never appears under `out`)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in make_rows(size, seed, **options)))
    tmp.replace(out)
    return out


def leading_number(completion: str) -> str | None:
    m = _LEADING_NUMBER.match(completion)
    return m.group(1) if m else None


def reward(completion: str, example: dict, format_reward: float = 0.0) -> float:
    """1.0 exact answer, format_reward for another leading number, else 0.0."""
    got = leading_number(completion)
    if got is None:
        return 0.0
    return 1.0 if got == str(example["answer"]).strip() else float(format_reward)


def exact(completion: str, example: dict) -> float:
    """Exact match only (no format credit): the accuracy metric."""
    return 1.0 if leading_number(completion) == str(example["answer"]).strip() else 0.0
