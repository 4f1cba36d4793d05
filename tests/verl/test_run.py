"""The verl recipe end to end on this CPU: `zmrl train recipes/tiny_verl.toml` (verl's PPO trainer on
Ray with 2 CPUs, zmrl's vLLM rollout, zmrl's Megatron trainer, the strict trainer mode) runs a few
steps with every mismatch metric exactly 0 at every step; and the negative control, identical but
for zmrl's kernels off on the rollout side (rollout.extra.batch_invariant = false), is stopped by
the strict check at step 1, naming the first differing token.

Each run is one verl process (Ray start, the vLLM server, the trainer worker); the shortened recipe
uses the tiny model without its warm start (reward is not the point here) and 2 prompts x 4 samples.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _train(tmp_path: Path, model_dir: str, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / name
    sets = [f'run.dir="{run_dir}"', f'model.path="{model_dir}"', f'data.path="{tmp_path / "arith.jsonl"}"',
            "model.warm_start_steps=0", f"run.steps={STEPS}", "run.prompts_per_step=2", "rollout.n=4",
            "algorithm.num_minibatches=1", *extra]
    cmd = [sys.executable, "-m", "zmrl.cli", "train", str(ROOT / "recipes" / "tiny_verl.toml")]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VERL_PLATFORM": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1500)
    return proc, run_dir


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_verl_recipe_steps_have_zero_mismatch_at_every_step(tmp_path, model_dir):
    proc, run_dir = _train(tmp_path, model_dir, "strict")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), proc.stdout[-3000:]
    for s in steps:
        data = s["data"]
        assert data["mismatch/tokens_different"] == 0, data
        assert data["mismatch/logprob_abs_diff_max"] == 0.0 and data["mismatch/kl"] == 0.0, data
        assert data["mismatch/ratio_first_minibatch_max_abs_dev"] == 0.0, data
        assert data["response_length/mean"] > 0  # tokens were sampled, so the check saw some
    assert (run_dir / "verl" / "overrides.txt").read_text().count("trainer.v1.trainer_mode=zmrl_strict") == 1


def test_negative_control_rollout_without_zmrls_kernels_is_stopped_at_step_1(tmp_path, model_dir):
    proc, run_dir = _train(tmp_path, model_dir, "control", "rollout.extra={batch_invariant=false}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert "step 1: rollout and trainer log-probs differ" in out, out[-4000:]
    assert "first at sample" in out and "response position" in out and "vs trainer" in out
    assert _steps(run_dir) == []  # stopped before the step's update and its metrics
