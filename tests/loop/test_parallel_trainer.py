"""`zmrl train` with trainer.options.tensor_parallel = 2: the loop starts two Megatron trainer ranks
(zmrl.rl.launcher) and drives them; mismatch is exactly 0 at every step and every stable metric
equals the TP = 1 run's bit for bit. A rank that fails, or does not answer in time, ends the run
with an error naming it."""
import pytest

from zmrl.rl.launcher import TrainerRankError, TrainerRanks
from zmrl.rl.loop import RLRun

from tests.loop.test_loop import MISMATCH, stable

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def test_tp2_loop_has_zero_mismatch_and_the_tp1_metrics(make_config, tmp_path):
    common = ('trainer.backend="megatron"', "run.steps=2", "algorithm.num_minibatches=2")
    tp2 = RLRun(make_config(*common, "trainer.options={tensor_parallel=2}", run_dir=tmp_path / "tp2"))
    assert isinstance(tp2.trainer, TrainerRanks)
    many = tp2.run()
    one = RLRun(make_config(*common, run_dir=tmp_path / "tp1")).run()
    for step, m in enumerate(many, 1):
        for key in MISMATCH:
            assert m[key] == 0, f"step {step}: {key} = {m[key]!r}"
    assert [stable(m) for m in many] == [stable(m) for m in one]


def test_a_failing_rank_ends_the_run_naming_it(tmp_path):
    from zmrl.lora import LoraConfig

    with pytest.raises(TrainerRankError, match=r"trainer rank \d of 2 failed in building the trainer"):
        TrainerRanks("megatron", str(tmp_path / "no-model"), LoraConfig(r=2), options={"tensor_parallel": 2})


def test_a_rank_that_does_not_answer_in_time_ends_the_run(tiny_model):
    from zmrl.lora import LoraConfig

    with pytest.raises(TrainerRankError, match=r"did not finish building the trainer within"):
        TrainerRanks("megatron", str(tiny_model), LoraConfig(r=2), options={"tensor_parallel": 2}, timeout_s=0.5)
