"""Prompt datasets (local JSON lines, JSON, parquet, or the HF hub), and a seeded, resumable walk over them.

    rows = load_rows("data/arith.jsonl")                       # list of dicts
    stream = PromptStream(rows, seed=0, shuffle=True)
    batch = stream.take(8)                                      # 8 rows; stream.cursor advances
    stream = PromptStream(rows, seed=0, shuffle=True, cursor=saved_cursor)   # resume

The order of epoch e is a permutation drawn from random.Random(f(seed, e)), so a cursor
(epoch, index) fully determines what comes next: checkpoints store it, and a resumed run reads
the same prompts as an uninterrupted one.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_rows(path: str, split: str = "train") -> list[dict]:
    """A local .jsonl/.json/.parquet file, or a hub dataset name (needs network and `datasets`).

    JSON and JSON lines are read with the standard library (a GPU machine without `datasets` still
    runs a recipe on a local file); parquet and hub datasets go through HF `datasets`."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in FILE_FORMATS or p.exists():
        if not p.is_file():
            raise FileNotFoundError(f"dataset file {path} does not exist (for the arithmetic task, set "
                                    f"data.generate = \"arithmetic\" or run `zmrl make-data arithmetic --out {path}`)")
        if suffix not in FILE_FORMATS:
            raise ValueError(f"dataset file {path}: unknown format {suffix!r}; use {sorted(FILE_FORMATS)}")
        if FILE_FORMATS[suffix] == "json":
            rows = _json_rows(p)
        else:
            import datasets

            datasets.disable_progress_bars()
            try:
                rows = datasets.load_dataset("parquet", data_files=str(p), split="train").to_list()
            except Exception as e:  # datasets wraps parse errors in several types
                raise ValueError(f"dataset file {path} could not be read: {type(e).__name__}: {e}") from None
    else:
        import datasets

        rows = datasets.load_dataset(path, split=split).to_list()
    if not rows:
        raise ValueError(f"dataset {path} has no rows")
    return rows


def _json_rows(path: Path) -> list[dict]:
    """A JSON array of objects or JSON lines (one object per non-blank line). Rows missing a
    column get None there, as a table would hold them."""
    text = _check_text(path)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, list):
        rows, where = whole, lambda i: f"item {i}"
    else:
        rows, where = [], lambda i: f"line {i + 1}"
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                rows.append(None)  # keeps line numbers; dropped below
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset file {path} could not be read: line {i + 1}: {e.msg}") from None
    keys: dict[str, None] = {}
    for i, row in enumerate(rows):
        if row is not None and not isinstance(row, dict):
            raise ValueError(f"dataset file {path} could not be read: {where(i)} is a {type(row).__name__}, "
                             f"not a JSON object")
        keys.update(dict.fromkeys(row or ()))
    return [{k: row.get(k) for k in keys} for row in rows if row is not None]


def _check_text(path: Path) -> str:
    """A JSON/JSONL file must be UTF-8 and hold something; returns its text."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"dataset file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip():
        raise ValueError(f"dataset file {path} has no rows (it is empty)")
    return text


def prompts_of(rows: list[dict], prompt_key: str, fmt: str = "prompt", where: str = "dataset") -> list[str]:
    """The prompt text of every row (fmt "gsm8k" builds it from "question")."""
    if fmt == "gsm8k":
        from zmrl.data.gsm8k import prompt_of

        if "question" not in rows[0] or "answer" not in rows[0]:
            raise ValueError(f"{where}: GSM8K rows need 'question' and 'answer' columns, got {sorted(rows[0])}")
        return [prompt_of(r) for r in rows]
    if prompt_key not in rows[0]:
        raise ValueError(f"{where}: no column {prompt_key!r} (data.prompt_key); columns: {sorted(rows[0])}")
    out = []
    for i, r in enumerate(rows):
        if not isinstance(r.get(prompt_key), str) or not r[prompt_key]:
            raise ValueError(f"{where}: row {i} has no non-empty string {prompt_key!r}")
        out.append(r[prompt_key])
    return out


class PromptStream:
    def __init__(self, num_rows: int, seed: int = 0, shuffle: bool = True, cursor: dict | None = None):
        if num_rows < 1:
            raise ValueError("no rows to stream")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.epoch, self.index = 0, 0
        if cursor is not None:
            self.epoch, self.index = int(cursor["epoch"]), int(cursor["index"])
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    @property
    def cursor(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def take(self, k: int) -> list[int]:
        """The next k row indices (crossing into the next epoch's order when one runs out)."""
        out = []
        while len(out) < k:
            if self.index == self.num_rows:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            out.append(self._order[self.index])
            self.index += 1
        return out
