"""`zmrl train` / `zmrl report` from the command line: bad input gives a clear error (exit 2, or 4 for a
raising reward function) and never damages a run directory; --dry-run validates the GPU recipe on CPU;
report writes plots and a summary; the config and CLI modules import no heavy library."""
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zmrl.cli import main
from zmrl.rl import checkpoint
from zmrl.rl.tracking import read_metrics

from tests.loop.conftest import RECIPE, ROOT, small_overrides  # noqa: E402


def train(capsys, *args):
    code = main(["train", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def snapshot(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


BOOM = '''
import os
from zmrl.data.arithmetic import reward as arithmetic


def reward(completion, example, **kwargs):
    if os.environ.get("ZMRL_TEST_BOOM"):
        return 1 / 0
    return arithmetic(completion, example, **kwargs)
'''


@pytest.fixture
def finished_run(tiny_model, dataset, tmp_path, monkeypatch, capsys):
    """A 2-step run (checkpoint at step 2) whose reward function can be made to raise."""
    (tmp_path / "boom_reward.py").write_text(BOOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = small_overrides(tiny_model, dataset, tmp_path / "run") + ["run.steps=2", 'reward.function="boom_reward:reward"']
    code, _, err = train(capsys, RECIPE, *sets(overrides))
    assert code == 0, err
    return tmp_path / "run", overrides


def test_unknown_recipe_key_names_it(tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.read_text().replace("[run]\n", "[run]\nstepz = 3\n"))
    code, _, err = train(capsys, recipe)
    assert code == 2 and "run.stepz" in err and "unknown key" in err, err


@pytest.mark.parametrize("override, key", [("run.steps=abc", "run.steps"), ("trainer.lr=fast", "trainer.lr"),
                                           ("rollout.n=2.5", "rollout.n"), ("rollout.backend=tpu", "rollout.backend"),
                                           ("nosuch.key=1", "nosuch"), ("run.device=tpu", "run.device")])
def test_bad_override_names_the_key(capsys, tmp_path, override, key):
    code, _, err = train(capsys, RECIPE, "--set", override, "--set", f'run.dir="{tmp_path / "run"}"')
    assert code == 2 and key in err, err
    assert not (tmp_path / "run").exists()


def test_missing_dataset_file(tiny_model, dataset, tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.read_text().replace('generate = "arithmetic"\n', ""))
    overrides = small_overrides(tiny_model, tmp_path / "nope.jsonl", tmp_path / "run")
    code, _, err = train(capsys, recipe, *sets(overrides))
    assert code == 2 and "nope.jsonl" in err and "does not exist" in err, err
    assert not (tmp_path / "run").exists()


def test_model_dir_without_tokenizer(tiny_model, dataset, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tiny_model / name).read_bytes())
    code, _, err = train(capsys, RECIPE, *sets(small_overrides(bare, dataset, tmp_path / "run")))
    assert code == 2 and "tokenizer.json" in err, err
    assert not (tmp_path / "run").exists()


def test_run_dir_in_use_needs_resume(finished_run, capsys):
    run_dir, overrides = finished_run
    before = snapshot(run_dir)
    code, _, err = train(capsys, RECIPE, *sets(overrides + ["run.steps=3"]))
    assert code == 2 and "--resume" in err, err
    assert snapshot(run_dir) == before


def test_resume_from_a_different_recipe_is_refused(finished_run, capsys):
    run_dir, overrides = finished_run
    before = snapshot(run_dir)
    code, _, err = train(capsys, RECIPE, *sets(overrides + ["run.steps=4", "algorithm.clip_eps=0.3"]),
                         "--resume", run_dir)
    assert code == 2 and "different recipe" in err and "algorithm.clip_eps" in err, err
    assert snapshot(run_dir) == before


def test_raising_reward_function_is_named_and_the_run_dir_survives(finished_run, capsys, monkeypatch):
    run_dir, overrides = finished_run
    checkpoints = snapshot(run_dir / "checkpoints")
    metrics = read_metrics(run_dir)
    monkeypatch.setenv("ZMRL_TEST_BOOM", "1")
    code, _, err = train(capsys, RECIPE, *sets(overrides + ["run.steps=4"]), "--resume", run_dir)
    assert code == 4 and "boom_reward:reward" in err and "ZeroDivisionError" in err, err
    assert snapshot(run_dir / "checkpoints") == checkpoints
    assert read_metrics(run_dir) == metrics
    monkeypatch.delenv("ZMRL_TEST_BOOM")
    code, _, err = train(capsys, RECIPE, *sets(overrides + ["run.steps=3"]), "--resume", run_dir)
    assert code == 0, err
    assert checkpoint.latest(run_dir).name == "step_000003"


def test_report_writes_plots_and_summary(finished_run, capsys):
    run_dir, _ = finished_run
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "exactly 0 at every step" in out, out
    for name in ("reward.png", "mismatch.png", "kl_ref.png", "throughput.png", "summary.txt"):
        assert (run_dir / "report" / name).stat().st_size > 0, name


def test_dry_run_validates_the_gpu_recipe_on_cpu(tmp_path, capsys):
    from zmrl.model.factory import init_model

    k31 = init_model("k31-layer", str(tmp_path / "k31"))  # per-layer dims, config.json only
    code, out, err = train(capsys, ROOT / "recipes" / "k31_lora_gpu.toml", "--dry-run", "--set", f'model.path="{k31}"')
    assert code == 0, err
    assert "rank 32 on 10 weights in 1 layer(s) (896 routed experts each)" in out and "dry run: recipe valid" in out, out
    assert not Path("runs/k31_lora_gpu").exists()


def test_dry_run_validates_the_small_gpu_recipe_on_cpu(capsys):
    code, out, err = train(capsys, ROOT / "recipes" / "small_gpu.toml", "--dry-run")
    assert code == 0, err
    assert "device: cuda" in out and 'init_dtype = "bfloat16"' in out and "dry run: recipe valid" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the property is about a machine without a CUDA GPU")
def test_device_cuda_without_a_gpu_is_refused_before_anything_is_written(tiny_model, dataset, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, _, err = train(capsys, RECIPE, *sets(small_overrides(tiny_model, dataset, run_dir) + ['run.device="cuda"']))
    assert code == 2 and "run.device" in err and "no CUDA GPU" in err, err
    assert not run_dir.exists()


def test_config_and_cli_import_no_heavy_library():
    code = ("import sys, zmrl.config, zmrl.cli; zmrl.cli.build_parser(); "
            "heavy = [m for m in ('vllm', 'megatron', 'wandb', 'datasets', 'matplotlib', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
