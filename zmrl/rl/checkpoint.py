"""Checkpoints under RUN_DIR/checkpoints, written so that a crash never leaves a corrupt latest.

    checkpoints/step_000010/adapter/         PEFT adapter (adapter_config.json + adapter_model.safetensors)
                           trainer.pt        trainer.state_dict(): adapter, fp32 masters, AdamW state
                           rng.pt            torch / python / numpy RNG states
                           state.json        {"step", "cursor", "config", "base_model", "files"}: the
                                             data cursor, resolved config, the base model's fingerprint
                                             and the sha256 of every other file of the checkpoint
    checkpoints/latest                       the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, every file fsynced, then renamed into
place (rename is atomic within a file system), and only then does `latest` (replaced atomically
too) point at it. A crash at any moment leaves the previous checkpoint and `latest` intact; a
stray temporary directory is ignored and cleaned up by the next save; a failed save (disk full)
removes its own temporary directory.

Before a resume uses a checkpoint, `newest_intact` checks every file against the sha256 list in
state.json and loads it; a damaged one is skipped (and named) in favour of the next older one.
"""
from __future__ import annotations

import hashlib
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
         base_model: str | None = None, base_fingerprint: str | None = None) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stray in root.glob(".tmp-*"):  # left by a crash mid-write
        shutil.rmtree(stray, ignore_errors=True)
    name = f"step_{step:06d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    try:
        trainer.save_adapter(tmp / "adapter", base_model_name_or_path=base_model)
        _torch_save(trainer.state_dict(), tmp / "trainer.pt")
        _torch_save(rng_states(), tmp / "rng.pt")
        state = {"step": step, "cursor": cursor, "config": config, "base_model": base_fingerprint,
                 "files": {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}}
        (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
        raise
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


def _torch_save(obj, path: Path) -> None:
    # through a Python file object: a full disk then raises OSError(ENOSPC), where torch's own
    # writer reports it as an opaque RuntimeError
    with open(path, "wb") as f:
        torch.save(obj, f)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


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


class CheckpointError(ValueError):
    """A checkpoint that is damaged; the message names the file and what is wrong with it."""


def load(path: Path) -> dict:
    """-> {"step", "cursor", "config", "base_model", "trainer", "rng"}; CheckpointError naming the
    file if any part is missing, cut or altered."""
    path = Path(path)
    state = load_state_json(path)
    for key in ("step", "cursor", "config"):
        if key not in state:
            raise CheckpointError(f"{path / 'state.json'} has no {key!r}")
    for rel, digest in (state.get("files") or {}).items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"{f} is damaged (its sha256 differs from the one recorded when it was written)")
    for part in ("trainer", "rng"):
        f = path / f"{part}.pt"
        try:
            state[part] = torch.load(f, weights_only=False)
        except FileNotFoundError:
            raise CheckpointError(f"{f} is missing") from None
        except Exception as e:  # torch reports a cut file as one of several error types
            raise CheckpointError(f"{f} cannot be read ({type(e).__name__}: {str(e)[:120]})") from None
    return state


def load_state_json(path: Path) -> dict:
    """The small part of a checkpoint (step, cursor, config, base_model), without loading tensors."""
    f = Path(path) / "state.json"
    try:
        state = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f} does not hold a JSON object")
    return state


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Every step_* directory, complete or not, oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []


def newest_intact(run_dir: Path) -> tuple[dict | None, list[str]]:
    """-> (the newest checkpoint that loads and checks out, as load() returns it plus "path"; or
    None), and one line per newer checkpoint that was skipped, saying why."""
    skipped = []
    for path in reversed(checkpoint_dirs(run_dir)):
        try:
            state = load(path)
        except CheckpointError as e:
            skipped.append(f"{path.name}: {e}")
            continue
        state["path"] = path
        return state, skipped
    return None, skipped
