"""Shared fixtures for the loop tests: one tiny model (with tokenizer) and one arithmetic dataset per
session, and `make_config`, the tiny recipe shrunk by --set overrides to reference backends and a
few small steps (seconds each on 2 cores)."""
from pathlib import Path

import pytest

from zmrl.config import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_cpu.toml"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from zmrl.model.factory import init_model

    return Path(init_model("tiny", str(tmp_path_factory.mktemp("models") / "tiny"), seed=0))


@pytest.fixture(scope="session")
def tiny_bf16_model(tmp_path_factory):
    """The same tiny model stored in bf16 (its config says "dtype": "bfloat16")."""
    from zmrl.model.factory import init_model

    return Path(init_model("tiny", str(tmp_path_factory.mktemp("models") / "tiny_bf16"), seed=0, dtype="bfloat16"))


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    from zmrl.data.arithmetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("data") / "arith.jsonl", size=64, seed=0)


def small_overrides(model: Path, data: Path, run_dir: Path) -> list[str]:
    return [f'model.path="{model}"', f'data.path="{data}"', f'run.dir="{run_dir}"',
            'rollout.backend="reference"', 'trainer.backend="reference"', "run.steps=3", "run.prompts_per_step=2",
            "rollout.n=2", "rollout.max_tokens=3", 'tracking.wandb="disabled"', "run.progress=false",
            "run.checkpoint_every=2", "run.num_threads=1",
            # credit for any number: a random model then gets rewards that differ within a group,
            # so the adapter really moves (exact matches alone are too rare for it)
            "reward.kwargs={format_reward=0.5}"]


@pytest.fixture
def make_config(tiny_model, dataset, tmp_path):
    def make(*overrides, run_dir: Path | None = None):
        return load_recipe(RECIPE, small_overrides(tiny_model, dataset, run_dir or tmp_path / "run") + list(overrides))
    return make
