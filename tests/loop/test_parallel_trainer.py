"""`zmrl train` with trainer.options.tensor_parallel = 2, or expert_parallel = 2 alone: the loop starts
two Megatron trainer ranks (zmrl.rl.launcher) and drives them; mismatch is exactly 0 at every step and
every stable metric equals the TP = 1 run's bit for bit, with the tiny model in fp32 and in bf16. A
rank that fails, or does not answer in time, ends the run with an error naming it."""
import pytest

from zmrl.model.checkpoint import read_config
from zmrl.rl.launcher import TrainerRankError, TrainerRanks
from zmrl.rl.loop import RLRun

from tests.loop.test_loop import MISMATCH, stable

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tp2_and_ep2_loops_have_zero_mismatch_and_the_tp1_metrics(make_config, tiny_bf16_model, tmp_path, dtype):
    common = ('trainer.backend="megatron"', "run.steps=2", "algorithm.num_minibatches=2")
    if dtype == "bf16":
        common += (f'model.path="{tiny_bf16_model}"',)
    cfg = make_config(*common, run_dir=tmp_path / "tp1")
    assert read_config(cfg.model.path).torch_dtype == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    one = RLRun(cfg).run()
    for name, options in (("tp2", "{tensor_parallel=2}"), ("ep2", "{expert_parallel=2}")):
        run = RLRun(make_config(*common, f"trainer.options={options}", run_dir=tmp_path / name))
        assert isinstance(run.trainer, TrainerRanks) and run.trainer.world == 2
        many = run.run()
        for step, m in enumerate(many, 1):
            for key in MISMATCH:
                assert m[key] == 0, f"{name} step {step}: {key} = {m[key]!r}"
        assert [stable(m) for m in many] == [stable(m) for m in one], name


def test_a_failing_rank_ends_the_run_naming_it(tmp_path):
    from zmrl.lora import LoraConfig

    with pytest.raises(TrainerRankError, match=r"trainer rank \d of 2 failed in building the trainer"):
        TrainerRanks("megatron", str(tmp_path / "no-model"), LoraConfig(r=2), options={"tensor_parallel": 2})


def test_a_rank_that_does_not_answer_in_time_ends_the_run(tiny_model):
    from zmrl.lora import LoraConfig

    with pytest.raises(TrainerRankError, match=r"did not finish building the trainer within"):
        TrainerRanks("megatron", str(tiny_model), LoraConfig(r=2), options={"tensor_parallel": 2}, timeout_s=0.5)
