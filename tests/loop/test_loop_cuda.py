"""The RL loop on one GPU, as `recipes/small_gpu.toml` runs it but on the tiny model: the weights
stored in bf16, the reference rollout and the Megatron trainer on CUDA, the trainer's CUDA graphs on,
prompts longer than index_topk. The mismatch is exactly 0 at every step, a resumed run repeats an
uninterrupted one bit for bit, and a 1-ulp change of one rollout-side weight shows up in the
mismatch metrics (negative control)."""
import pytest
import torch

from tests.loop.test_loop import MISMATCH, bump_one_ulp, stable
from zmrl.rl import checkpoint
from zmrl.rl.loop import RLRun
from zmrl.rl.tracking import read_metrics

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory):
    from zmrl.data.arithmetic import write_dataset

    # 4 solved examples before each question: about 23 tokens, past the tiny model's index_topk (16)
    return write_dataset(tmp_path_factory.mktemp("data") / "arith_4shot.jsonl", size=64, seed=0,
                         first_operands=[1], max_operand=8, equals=False, shots=4)


@pytest.fixture
def cuda_config(make_config, tiny_bf16_model, long_prompts):
    """The loop tests' small recipe (conftest.small_overrides), moved onto CUDA with the Megatron
    trainer, the bf16 model and the long prompts; later overrides win."""
    def make(*overrides, run_dir=None):
        return make_config(f'model.path="{tiny_bf16_model}"', f'data.path="{long_prompts}"', 'run.device="cuda"',
                           'trainer.backend="megatron"', "run.steps=4", "run.prompts_per_step=4", "rollout.n=4",
                           "rollout.max_tokens=4", "algorithm.num_minibatches=2", *overrides, run_dir=run_dir)
    return make


def test_the_loop_on_cuda_has_zero_mismatch_and_resumes_bitwise(cuda_config, tmp_path):
    full_run = RLRun(cuda_config(run_dir=tmp_path / "full"))
    full = full_run.run()
    assert full_run.device.type == "cuda"
    graphs = full_run.trainer.minibatch_graphs
    assert graphs is not None and graphs.replays > 0, "the train step ran from its CUDA graphs"
    for step, m in enumerate(full, 1):
        for key in MISMATCH:
            assert m[key] == 0, f"step {step}: {key} = {m[key]!r}"
    RLRun(cuda_config("run.steps=2", run_dir=tmp_path / "part")).run()
    resumed = RLRun(cuda_config(run_dir=tmp_path / "part"), resume=True)
    assert resumed.step_done == 2
    tail = resumed.run()
    assert [stable(m) for m in tail] == [stable(m) for m in full[2:]]
    assert [stable(r) for r in read_metrics(tmp_path / "part")] == [stable(r) for r in read_metrics(tmp_path / "full")]
    a = checkpoint.load(checkpoint.latest(tmp_path / "full"))
    b = checkpoint.load(checkpoint.latest(tmp_path / "part"))
    assert any(v.abs().sum() > 0 for k, v in a["trainer"]["adapter"].items() if k.endswith("__B")), \
        "the adapter moved, so equality is not trivial"
    for part in ("adapter", "masters"):
        for k, v in a["trainer"][part].items():
            assert torch.equal(v, b["trainer"][part][k]), f"{part} {k}"


def test_a_one_ulp_rollout_weight_shows_in_the_mismatch_on_cuda(cuda_config):
    run = RLRun(cuda_config("mismatch.strict=false", "run.steps=1"))
    bump_one_ulp(run.rollout, "model.norm.weight")
    (m,) = run.run()
    assert m["mismatch/tokens_different"] > 0 and m["mismatch/logprob_abs_diff_max"] > 0
