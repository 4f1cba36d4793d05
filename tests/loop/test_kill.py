"""Fault injection: `zmrl train` killed with SIGKILL at seeded write events (inside the first
checkpoint, before it, after it, and again while resuming), then restarted (no checkpoint yet) or
resumed until complete: every run's metrics.jsonl and final checkpoint equal an uninterrupted
run's bit for bit. kill_driver.py says how the kills are placed."""
import json
import os
import subprocess
import sys

import torch

from zmrl.rl import checkpoint
from zmrl.rl.tracking import load_metrics

from tests.loop.conftest import RECIPE, ROOT, small_overrides  # noqa: E402
from tests.loop.test_loop import stable  # noqa: E402

SCENARIOS = {
    "in_first_checkpoint": ["first_checkpoint"],
    "before_first_checkpoint": ["before_first_checkpoint"],
    "after_first_checkpoint_then_while_resuming": ["after_first_checkpoint", "any"],
    "three_kills": ["any", "any", "any"],
}


def test_kill_9_anywhere_then_restart_or_resume_repeats_the_uninterrupted_run(tiny_model, dataset, tmp_path):
    steps = 4
    overrides = [o for o in small_overrides(tiny_model, dataset, tmp_path / "unused") if not o.startswith("run.dir")]
    # one prompt of two 2-token samples per step: the smallest batch whose adapter still moves
    overrides += [f"run.steps={steps}", "run.checkpoint_every=2", "run.prompts_per_step=1", "rollout.max_tokens=2"]
    plan = {"argv": ["train", str(RECIPE)] + [a for o in overrides for a in ("--set", o)], "steps": steps,
            "seed": 20261201, "count_dir": str(tmp_path / "uninterrupted"),
            "scenarios": {name: {"run_dir": str(tmp_path / name), "kills": kills} for name, kills in SCENARIOS.items()}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "loop" / "kill_driver.py"), str(tmp_path / "plan.json"),
                           str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    attempts = out["attempts"]
    print(json.dumps(attempts, indent=1))  # the kill points, for a failure report

    reference, skipped = load_metrics(tmp_path / "uninterrupted")
    assert [r["step"] for r in reference] == list(range(1, steps + 1)) and not skipped
    ref_state = checkpoint.load(checkpoint.latest(tmp_path / "uninterrupted"))
    assert any(v.abs().sum() > 0 for k, v in ref_state["trainer"]["adapter"].items() if k.endswith("__B")), \
        "the adapter moved, so equal checkpoints are not trivially equal"
    for name in SCENARIOS:
        log, run_dir = attempts[name], tmp_path / name
        assert log[0][2] == -9 and log[-1][2] == 0, f"{name}: {log}"
        assert all(status in (0, -9) for _, _, status in log), f"{name}: {log}"
        rows, skipped = load_metrics(run_dir)
        assert not skipped, f"{name}: {skipped}"
        assert [stable(r) for r in rows] == [stable(r) for r in reference], f"{name}: {log}"
        state = checkpoint.load(checkpoint.latest(run_dir))
        assert state["step"] == steps and state["cursor"] == ref_state["cursor"], name
        for part in ("adapter", "masters"):
            for key, value in ref_state["trainer"][part].items():
                assert torch.equal(value, state["trainer"][part][key]), f"{name}: {part} {key}"
        assert not (run_dir / "run.lock").exists(), f"{name}: the finished run released its lock"
        assert not list((run_dir / "checkpoints").glob(".tmp-*")), f"{name}: a killed save's temp dir is left"
    # the cases the plan is for really happened
    events = out["events"]
    first_ckpt_kill = attempts["in_first_checkpoint"][0][1]
    assert "/checkpoints" in events[first_ckpt_kill - 1], events[first_ckpt_kill - 1]
    assert attempts["in_first_checkpoint"][1][0] == "start", "no checkpoint was complete: a plain restart"
    assert any(mode == "resume" and status == -9 for log in attempts.values() for mode, _, status in log), \
        "some resumed attempt was killed too"
