"""Where a step's metrics go: RUN_DIR/metrics.jsonl (always), W&B (offline by default), and a
live progress bar.

metrics.jsonl holds one JSON object per step: {"step": k, "<namespace>/<name>": value, ...};
non-finite floats are written as null. On resume the file is cut back (atomically) to the steps
up to the checkpoint, so it always describes one consistent run. A damaged line (cut by a crash,
edited by hand) is skipped with a note naming it; every valid row around it is kept, and before a
resume rewrites such a file the original is kept as metrics.jsonl.damaged.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

from zmrl.rl.checkpoint import write_atomic
from zmrl.rl.inputs import RunError

METRICS = "metrics.jsonl"


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def load_metrics(run_dir: str | Path) -> tuple[list[dict], list[str]]:
    """-> (every valid row in file order, one line per skipped line naming it and why)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return [], []
    rows, skipped = [], []
    for number, line in enumerate(path.read_bytes().decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            skipped.append(f"{path}: line {number} skipped (not JSON: {e.msg})")
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
            skipped.append(f"{path}: line {number} skipped (not an object with an integer \"step\")")
            continue
        rows.append(row)
    return rows, skipped


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every valid row; each skipped line is named on stderr."""
    rows, skipped = load_metrics(run_dir)
    for line in skipped:
        print(f"zmrl: {line}", file=sys.stderr)
    return rows


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    path = Path(run_dir) / METRICS
    rows, skipped = load_metrics(run_dir)
    if skipped:
        shutil.copyfile(path, path.with_name(METRICS + ".damaged"))
        for line in skipped:
            print(f"zmrl: {line}; the original is kept as {METRICS}.damaged", file=sys.stderr)
    if not path.exists() and not last_step:
        return
    kept = [r for r in rows if r["step"] <= last_step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


class Tracker:
    def __init__(self, run_dir: Path, config: dict, *, wandb_mode: str, project: str, name: str | None,
                 total_steps: int, first_step: int, progress: bool):
        self.run_dir = Path(run_dir)
        self.file = open(self.run_dir / METRICS, "a")
        self.wandb_run = None
        if wandb_mode != "disabled":
            try:
                import wandb
            except ImportError:
                raise RuntimeError("tracking.wandb needs wandb: pip install 'zmrl[track]' "
                                   "(or set tracking.wandb = \"disabled\")") from None
            os.environ.setdefault("WANDB_SILENT", "true")
            name = name or self.run_dir.name
            if first_step:
                name = f"{name}-resume-{first_step}"
            try:
                self.wandb_run = wandb.init(mode=wandb_mode, dir=str(self.run_dir), project=project, name=name,
                                            config=config, settings=wandb.Settings(console="off"))
            except Exception as e:  # wandb raises its own error types for network, auth and disk problems
                self.file.close()
                first = (str(e).strip().splitlines() or [""])[0]
                raise RunError(f"W&B ({wandb_mode}) could not start in {self.run_dir / 'wandb'}: "
                               f"{type(e).__name__}: {first}") from None
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=first_step, desc="zmrl train", unit="step",
                            file=sys.stderr, dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if v is not None}, step=step)
        if self.bar is not None:
            self.bar.set_postfix({"reward": f"{metrics.get('reward/mean', float('nan')):.3f}",
                                  "mismatch": metrics.get("mismatch/tokens_different"),
                                  "kl_ref": f"{metrics.get('policy/kl_ref', float('nan')):.2e}"}, refresh=False)
            self.bar.update(1)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        self.file.close()
