"""The verl recipe end to end on this CPU: `zmrl train recipes/tiny_verl.toml` (verl's PPO trainer on
Ray with 2 CPUs, zmrl's vLLM rollout, zmrl's Megatron trainer, the strict trainer mode) runs a few
steps with every mismatch metric exactly 0 at every step; and the negative control, identical but
for zmrl's kernels off on the rollout side (rollout.extra.batch_invariant = false), is stopped by
the strict check at step 1, naming the first differing token. A third run has zmrl's trainer at
tensor parallel 2 (trainer.options.tensor_parallel = 2: two verl workers, each a Megatron rank): every
mismatch metric 0 as well.

Each run is one verl process (Ray start, the vLLM server, the trainer worker); the shortened recipe
uses the tiny model without its warm start (reward is not the point here) and 2 prompts x 4 samples.
Two runs go at a time, each with its own local Ray cluster (so each its own weight-sync socket:
zmrl.verl.rollout.cluster_socket): a run's start-up is a chain of mostly one-threaded processes
(Ray, the trainer worker, the vLLM server and its engine processes, the agent-loop worker), so one
run alone leaves a core of a 2-core machine idle most of the time. Not three: a run's processes
hold ~7 GiB, and three at once fill a 24 GiB machine until the libraries' page cache is evicted
and re-read (slower than one run after another). The runs share nothing but the model directory,
which none writes.
"""
import functools
import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.background import Queue, Started, start

pytestmark = [pytest.mark.verl, pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
AT_ONCE = 2
TIMEOUT_S = 1500
# each run's settings past the shortened recipe, in the order the runs start: the strict run, the
# negative control (zmrl's kernels off on the rollout side), the trainer at tensor parallel 2
EXTRAS = {"strict": (), "control": ("rollout.extra={batch_invariant=false}",),
          "tp2": ("trainer.options={tensor_parallel=2}",)}


def _start(run_dir: Path, model_dir: str, *extra: str) -> Started:
    """The shortened recipe with this run.dir, started; its data and output go to the folder above."""
    tmp_path = run_dir.parent
    sets = [f'run.dir="{run_dir}"', f'model.path="{model_dir}"', f'data.path="{tmp_path / "arith.jsonl"}"',
            "model.warm_start_steps=0", f"run.steps={STEPS}", "run.prompts_per_step=2", "rollout.n=4",
            "algorithm.num_minibatches=1", *extra]
    cmd = [sys.executable, "-m", "zmrl.cli", "train", str(ROOT / "recipes" / "tiny_verl.toml")]
    for s in sets:
        cmd += ["--set", s]
    # RAY_ADDRESS=local: each run starts its own cluster rather than finding the other's on this machine
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VERL_PLATFORM": "cpu", "RAY_ADDRESS": "local"}
    return start(cmd, tmp_path, env=env, cwd=tmp_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir):
    """The runs of EXTRAS, AT_ONCE at a time; each test waits for its own -> (its process, its run dir)."""
    run_dirs = {name: tmp_path_factory.mktemp(f"verl_{name}") / name for name in EXTRAS}
    queue = Queue({name: functools.partial(_start, run_dirs[name], model_dir, *extra) for name, extra in EXTRAS.items()},
                  at_once=AT_ONCE, timeout=TIMEOUT_S)
    try:
        yield lambda name: (queue.result(name), run_dirs[name])
    finally:
        queue.finish_all()  # never leave a run (and its Ray cluster) behind


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _assert_zero_mismatch_at_every_step(proc, run_dir: Path) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), proc.stdout[-3000:]
    for s in steps:
        data = s["data"]
        assert data["mismatch/tokens_different"] == 0, data
        assert data["mismatch/logprob_abs_diff_max"] == 0.0 and data["mismatch/kl"] == 0.0, data
        assert data["mismatch/ratio_first_minibatch_max_abs_dev"] == 0.0, data
        assert data["response_length/mean"] > 0  # tokens were sampled, so the check saw some


def test_verl_recipe_steps_have_zero_mismatch_at_every_step(runs):
    proc, run_dir = runs("strict")
    _assert_zero_mismatch_at_every_step(proc, run_dir)
    assert (run_dir / "verl" / "overrides.txt").read_text().count("trainer.v1.trainer_mode=zmrl_strict") == 1
    # Hydra's record of the run is in the run directory, and nothing was written where it was started
    assert (run_dir / "verl" / "hydra" / ".hydra" / "overrides.yaml").is_file()
    assert not (run_dir.parent / "outputs").exists()


def test_negative_control_rollout_without_zmrls_kernels_is_stopped_at_step_1(runs):
    proc, run_dir = runs("control")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert "step 1: rollout and trainer log-probs differ" in out, out[-4000:]
    assert "first at sample" in out and "response position" in out and "vs trainer" in out
    assert _steps(run_dir) == []  # stopped before the step's update and its metrics


def test_verl_recipe_with_the_trainer_at_tensor_parallel_2_has_zero_mismatch(runs):
    proc, run_dir = runs("tp2")
    _assert_zero_mismatch_at_every_step(proc, run_dir)
    workers = set(re.findall(r"WorkerDict pid=(\d+)", proc.stdout + proc.stderr))
    assert len(workers) == 2, f"expected two trainer workers, saw {sorted(workers)}"
