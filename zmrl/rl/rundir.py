"""What a run directory may be used for (check_run_dir), decided under a lock held for the run's
whole life.

    lock = RunDirLock.acquire(run_dir)      # RunError if another live process holds it
    ...                                     # build engines, run steps, write checkpoints
    lock.release()

The lock is `RUN_DIR/run.lock`, held with flock(2): the kernel drops it when its process dies, so a
lock file left by a killed run (a dead pid) is recognized as stale simply by being lockable again.
The file records the holder's pid, host and start time for the message a second run prints.

`fingerprint(model_dir)` is a sha256 over the base model's config.json, tokenizer files and every
*.safetensors file: a run records it in each checkpoint and refuses to resume against other weights.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from zmrl.rl import checkpoint
from zmrl.rl.inputs import RunError, config_differences

LOCK = "run.lock"
FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


class RunDirLock:
    def __init__(self, run_dir: Path, fd: int, created: Path | None, stale: dict | None):
        self.run_dir, self.fd, self.created, self.stale = run_dir, fd, created, stale

    @classmethod
    def acquire(cls, run_dir: str | Path) -> "RunDirLock":
        """Creates RUN_DIR if needed (release() removes it again if the run leaves nothing in it)."""
        run_dir = Path(run_dir)
        created = _first_missing(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunError(f"run dir {run_dir} cannot be created: {e.strerror}") from None
        path = run_dir / LOCK
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                _remove_empty(created, run_dir)
                raise RunError(f"run dir {run_dir} is not writable ({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    who = (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('started')}"
                           if holder else "another process")
                    raise RunError(f"run dir {run_dir} is in use by a running zmrl train ({who}); wait for it "
                                   f"to finish or choose another run.dir") from None
                raise RunError(f"run dir {run_dir}: cannot lock {path} ({e.strerror})") from None
            # a releasing holder unlinks the file after we opened it: then we locked an orphan inode
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read_holder(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        except OSError as e:
            lock = cls(run_dir, fd, created, None)
            lock.release()
            raise RunError(f"run dir {run_dir} is not writable ({e.strerror})") from None
        return cls(run_dir, fd, created, stale or None)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.run_dir / LOCK)  # unlink first, while still holding it (see acquire)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None
        _remove_empty(self.created, self.run_dir)


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of `path` that does not exist yet (None if path exists)."""
    missing = None
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing = p
    return missing


def _remove_empty(top: Path | None, leaf: Path) -> None:
    """Removes leaf and its parents up to top, as long as they are empty (what acquire created)."""
    if top is None:
        return
    for p in [leaf, *leaf.parents]:
        try:
            p.rmdir()
        except OSError:
            return
        if p == top:
            return


def check_writable(path: Path, what: str) -> None:
    """RunError unless a file can be created in directory `path` (or, if absent, in its parent)."""
    if path.exists() and not path.is_dir():
        raise RunError(f"{what} {path} is not a directory")
    if not path.exists():
        path = path.parent
    try:
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunError(f"{what} {path} is not writable ({e.strerror})") from None


def fingerprint(model_dir: str | Path) -> str:
    """sha256 over the model's config, tokenizer and weight files (name, size and bytes of each)."""
    model_dir = Path(model_dir)
    names = sorted({n for n in FINGERPRINT_FILES if (model_dir / n).is_file()}
                   | {p.name for p in model_dir.glob("*.safetensors")})
    h = hashlib.sha256()
    for name in names:
        path = model_dir / name
        h.update(f"{name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def say(text: str) -> None:
    print(f"zmrl: {text}", file=sys.stderr, flush=True)


def check_run_dir(run_dir: Path, resume: bool, config: dict, steps: int) -> tuple[dict | None, list[str]]:
    """What a run may do with `run_dir` -> (the checkpoint to resume from, or None to start at step
    1; the damaged checkpoints newer than it, one line each). RunError if the run must not start.
    A run dir with no checkpoint is started over (its metrics rows are of steps that are redone)."""
    d = run_dir
    if not resume:
        found = checkpoint.checkpoint_dirs(d)
        if found:
            raise RunError(f"run dir {d} already holds a run (checkpoints up to {found[-1].name}); continue it "
                           f"with --resume {d}, or choose another run.dir")
        if (d / "metrics.jsonl").exists():
            say(f"run dir {d} holds a run that stopped before its first checkpoint: starting it over")
        return None, []
    if not d.is_dir():
        raise RunError(f"--resume {d}: no such run dir")
    if not any((d / n).exists() for n in ("config.toml", "metrics.jsonl", "checkpoints")):
        raise RunError(f"--resume {d}: holds no zmrl run (no config.toml, metrics.jsonl or checkpoints)")
    state, damaged = checkpoint.newest_intact(d)
    if state is None:
        if damaged:
            raise RunError(f"--resume {d}: no intact checkpoint ({'; '.join(damaged)}); move the checkpoints "
                           f"dir away to start the run over")
        say(f"--resume {d}: no checkpoint yet: starting at step 1")
        return None, []
    diffs = config_differences(state["config"], config)
    if diffs:
        raise RunError(f"--resume {d}: the run dir was made by a different recipe; it differs in "
                       + "; ".join(diffs[:6]))
    if state["step"] >= steps:
        raise RunError(f"--resume {d}: the checkpoint is at step {state['step']} and run.steps is "
                       f"{steps}; raise it with --set run.steps=N")
    return state, damaged
