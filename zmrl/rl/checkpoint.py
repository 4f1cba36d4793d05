"""Checkpoints under RUN_DIR/checkpoints, written so that a crash never leaves a corrupt latest.

    checkpoints/step_000010/adapter/         PEFT adapter (adapter_config.json + adapter_model.safetensors)
                           trainer.pt        trainer.state_dict(): adapter, fp32 masters, AdamW state
                           rng.pt            torch / python / numpy RNG states
                           state.json        {"step", "cursor", "config"}: the data cursor and resolved config
    checkpoints/latest                       the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, every file fsynced, then renamed into
place (rename is atomic within a file system), and only then does `latest` (replaced atomically
too) point at it. A crash at any moment leaves the previous checkpoint and `latest` intact; a
stray temporary directory is ignored and cleaned up by the next save.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

LATEST = "latest"


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rng_states() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])


def save(run_dir: Path, step: int, trainer, cursor: dict, config: dict, keep: int,
         base_model: str | None = None) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stray in root.glob(".tmp-*"):  # left by a crash mid-write
        shutil.rmtree(stray, ignore_errors=True)
    name = f"step_{step:06d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    trainer.save_adapter(tmp / "adapter", base_model_name_or_path=base_model)
    torch.save(trainer.state_dict(), tmp / "trainer.pt")
    torch.save(rng_states(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "cursor": cursor, "config": config}, indent=1) + "\n")
    _fsync_tree(tmp)
    final = root / name
    if final.exists():  # the same step written again after a resume: swap, never delete first
        old = root / f".tmp-old-{name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    write_atomic(root / LATEST, name + "\n")
    for stale in complete_checkpoints(run_dir)[:-keep]:
        if stale.name != name:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every complete checkpoint, oldest first (incomplete ones never get a step_* name)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / "state.json").is_file())


def latest(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "state.json").is_file():
            return candidate
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def load(path: Path) -> dict:
    """-> {"step", "cursor", "config", "trainer", "rng"}."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    state["trainer"] = torch.load(path / "trainer.pt", weights_only=False)
    state["rng"] = torch.load(path / "rng.pt", weights_only=False)
    return state


def load_state_json(path: Path) -> dict:
    """The small part of a checkpoint (step, cursor, config), without loading tensors."""
    return json.loads((Path(path) / "state.json").read_text())
