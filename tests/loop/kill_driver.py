"""Fault injection for `zmrl train`: runs it in forked children that kill -9 themselves at a chosen
write event, then restarts them until the run is complete.

    python tests/loop/kill_driver.py PLAN.json OUT.json

PLAN: {"argv": [...train args, no run.dir...], "steps": N, "seed": S, "count_dir": ...,
       "scenarios": {"name": {"run_dir": ..., "kills": [where, ...]}}}
where: "first_checkpoint" (an event of the first checkpoint's writes), "before_first_checkpoint",
"after_first_checkpoint" or "any", drawn with random.Random(S) from the events of an uninterrupted
run made first (in count_dir: the reference the test compares against).
A write event is a call of os.fsync, os.replace, os.rename or torch.save (every durable step of
metrics.jsonl, config.toml and a checkpoint goes through one); attempt i of a scenario is killed
with SIGKILL just before its kills[i]-th event (counted from the attempt's start), so no cleanup
code runs, exactly as with `kill -9`. Later attempts run to the end. Each attempt after the first
uses --resume when the run dir holds a checkpoint and a plain start otherwise.

This process imports torch once and forks an attempt per child (no re-import per attempt); torch
is held at one thread before anything runs, so no OpenMP pool exists at fork time.
OUT: {"events": [labels of the uninterrupted run's events], "attempts": {name: [[mode, kill, status], ...]}}
"""
import json
import os
import random
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import datasets  # noqa: E402,F401  (imported once here, not in every child)
import zmrl.rl.loop  # noqa: E402,F401
import zmrl.rollout.reference  # noqa: E402,F401
import zmrl.trainer.reference  # noqa: E402,F401
from zmrl.cli import main  # noqa: E402
from zmrl.rl import checkpoint  # noqa: E402

EVENTS = []


def _label(fn, args) -> str:
    if fn == "fsync":
        try:
            return f"fsync {os.readlink(f'/proc/self/fd/{args[0]}')}"
        except OSError:
            return "fsync ?"
    if fn == "torch.save":
        return f"torch.save {getattr(args[1], 'name', args[1])}"
    return f"{fn} {args[1]}"


def _hook(kill_at: int | None) -> None:
    """Wraps the write functions: count (and label) each call; SIGKILL before call kill_at."""
    def wrap(name, fn):
        def wrapped(*args, **kwargs):
            EVENTS.append(_label(name, args))
            if kill_at is not None and len(EVENTS) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return wrapped

    os.fsync = wrap("fsync", os.fsync)
    os.replace = wrap("replace", os.replace)
    os.rename = wrap("rename", os.rename)
    torch.save = wrap("torch.save", torch.save)


def attempt(argv: list[str], kill_at: int | None, events_file: str | None = None) -> int:
    """One `zmrl train` in a forked child -> its exit status (-9 when it was killed)."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            _hook(kill_at)
            sys.stdout = open(os.devnull, "w")
            code = main(argv)
            if events_file:
                Path(events_file).write_text(json.dumps(EVENTS))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def complete(run_dir: Path, steps: int) -> bool:
    state, _ = checkpoint.newest_intact(run_dir)
    return state is not None and state["step"] >= steps


def kill_points(events: list[str], kinds: list[str], rng: random.Random) -> list[int]:
    """Event numbers (1-based) for each kind, from the labels of an uninterrupted run."""
    ckpt = [i for i, e in enumerate(events, 1) if "/checkpoints" in e]
    first, last = ckpt[0], next(i for i, e in enumerate(events, 1) if e.endswith("checkpoints/latest"))
    ranges = {"before_first_checkpoint": (1, first - 1), "first_checkpoint": (first, last),
              "after_first_checkpoint": (last + 1, len(events)), "any": (1, len(events))}
    return [rng.randint(*ranges[k]) for k in kinds]


def main_driver(plan_file: str, out_file: str) -> None:
    plan = json.loads(Path(plan_file).read_text())
    base, steps = plan["argv"], plan["steps"]
    out = {"attempts": {}}
    events_file = str(Path(out_file).with_suffix(".events.json"))
    status = attempt(base + ["--set", f'run.dir="{plan["count_dir"]}"'], None, events_file)
    assert status == 0, f"the uninterrupted run exited {status}"
    out["events"] = json.loads(Path(events_file).read_text())
    rng = random.Random(plan["seed"])
    for name, scenario in plan["scenarios"].items():
        run_dir, log = Path(scenario["run_dir"]), []
        kills = kill_points(out["events"], scenario["kills"], rng) + [None]
        for kill_at in kills:
            if complete(run_dir, steps):
                break
            resume = bool(checkpoint.checkpoint_dirs(run_dir))
            argv = base + (["--resume", str(run_dir)] if resume else ["--set", f'run.dir="{run_dir}"'])
            log.append(["resume" if resume else "start", kill_at, attempt(argv, kill_at)])
        out["attempts"][name] = log
    Path(out_file).write_text(json.dumps(out))


if __name__ == "__main__":
    main_driver(sys.argv[1], sys.argv[2])
