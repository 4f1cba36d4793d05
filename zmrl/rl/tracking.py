"""Where a step's metrics go: RUN_DIR/metrics.jsonl (always), W&B (offline by default), and a
live progress bar.

metrics.jsonl holds one JSON object per step: {"step": k, "<namespace>/<name>": value, ...};
non-finite floats are written as null. On resume the file is cut back (atomically) to the steps
up to the checkpoint, so it always describes one consistent run.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from zmrl.rl.checkpoint import write_atomic

METRICS = "metrics.jsonl"


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a crash: the steps before it are what happened
    return rows


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) <= last_step]
    write_atomic(Path(run_dir) / METRICS, "".join(json.dumps(r) + "\n" for r in rows))


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
            self.wandb_run = wandb.init(mode=wandb_mode, dir=str(self.run_dir), project=project, name=name,
                                        config=config, settings=wandb.Settings(console="off"))
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
