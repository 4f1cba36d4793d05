"""GSM8K format for users who have the data (no download here): rows {"question": ..., "answer":
"...reasoning...\\n#### 42"}.

    [data]
    path = "data/gsm8k/train.jsonl"     # or the parquet files of openai/gsm8k
    format = "gsm8k"                    # prompts from "question" through PROMPT_TEMPLATE
    [reward]
    function = "zmrl.data.gsm8k:reward"

The reward extracts the final number of the completion ("#### N" if present, else the last
number) and compares it exactly with the reference's "#### N".
"""
from __future__ import annotations

import re

PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def prompt_of(row: dict, template: str = PROMPT_TEMPLATE) -> str:
    return template.format(question=row["question"].strip())


def _normalize(number: str) -> str:
    number = number.replace(",", "").strip()
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number


def reference_answer(answer: str) -> str:
    """The "#### N" of a GSM8K reference answer, normalized (no commas, no trailing .0)."""
    m = _FINAL.search(answer)
    if not m:
        raise ValueError(f"GSM8K answer has no '#### N' line: {answer[-80:]!r}")
    return _normalize(m.group(1))


def extract_answer(completion: str) -> str | None:
    m = _FINAL.search(completion)
    if m:
        return _normalize(m.group(1))
    numbers = _NUMBER.findall(completion)
    return _normalize(numbers[-1]) if numbers else None


def reward(completion: str, example: dict) -> float:
    """1.0 when the completion's final number equals the reference's "#### N", else 0.0."""
    return 1.0 if extract_answer(completion) == reference_answer(example["answer"]) else 0.0
