"""Bad input fails clearly, before any work: a checkpoint that does not fit its config, a TP size
(or EP size) that does not divide the heads or experts, unknown options, token ids outside the vocabulary."""
import dataclasses
import json
import shutil

import pytest

from zmrl.trainer.megatron import MegatronTrainer
from zmrl.trainer.megatron.parallel import check_divisible

pytestmark = pytest.mark.megatron


def _edited(model_dir, tmp_path, **fields):
    out = tmp_path / "edited"
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(fields)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_checkpoint_that_does_not_fit_the_config_raises(model_dir, tmp_path, lora_config):
    bad = _edited(model_dir, tmp_path, moe_intermediate_size=32)
    with pytest.raises(ValueError, match=r"does not match the config.*mlp\.experts\.gate_up_proj"):
        MegatronTrainer.from_dir(bad, lora_config)


def test_tp_size_that_does_not_divide_heads_and_experts_raises_before_reading_weights(
        model_dir, lora_config, monkeypatch):
    import zmrl.trainer.megatron.trainer as trainer_module

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the TP size was checked")

    monkeypatch.setattr(trainer_module, "load_checkpoint", no_weights)
    with pytest.raises(ValueError, match=r"tensor_parallel=3 must divide 8 .*use 1, 2, 4 or 8"):
        MegatronTrainer.from_dir(model_dir, lora_config, options={"tensor_parallel": 3})


def test_check_divisible_names_only_the_failing_dimensions(mt):
    check_divisible(mt.cfg, 2)
    check_divisible(mt.cfg, 4)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 \(4 leaves\)") as info:
        check_divisible(mt.cfg, 8)  # divides the leaves of the 8 experts, not of the 4 attention heads
    # the indexer is replicated (never split), so its 4 heads are not a constraint
    assert "index_n_heads" not in str(info.value) and "n_routed_experts" not in str(info.value)
    with pytest.raises(ValueError, match="int >= 1"):
        check_divisible(mt.cfg, 0)


def test_tp_size_larger_than_the_world_raises(model_dir, lora_config):
    with pytest.raises(ValueError, match=r"world size 1 != max\(tensor_parallel=2, expert_parallel=2\) = 2"):
        MegatronTrainer.from_dir(model_dir, lora_config, options={"tensor_parallel": 2})


def test_ep_size_larger_than_the_world_raises(model_dir, lora_config):
    with pytest.raises(ValueError, match=r"world size 1 != max\(tensor_parallel=1, expert_parallel=2\) = 2"):
        MegatronTrainer.from_dir(model_dir, lora_config, options={"expert_parallel": 2})


def test_bad_expert_parallel_sizes_and_backends_raise_before_reading_weights(model_dir, lora_config, mt, monkeypatch):
    import zmrl.trainer.megatron.trainer as trainer_module

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the options were checked")

    monkeypatch.setattr(trainer_module, "load_checkpoint", no_weights)
    with pytest.raises(ValueError, match=r"expert_parallel=3 must divide 8 .*use 1, 2, 4 or 8"):
        MegatronTrainer.from_dir(model_dir, lora_config, options={"expert_parallel": 3})
    with pytest.raises(ValueError, match=r"expert_parallel must be an int >= 1, got '2'"):
        MegatronTrainer.from_dir(model_dir, lora_config, options={"expert_parallel": "2"})
    with pytest.raises(ValueError, match=r"backend='mpi' must be one of \('nccl', 'gloo'\)"):
        MegatronTrainer.from_dir(model_dir, lora_config, options={"backend": "mpi"})
    # EP must divide the expert leaves, TP need not: 6 experts have gcd(8, 6) = 2 leaves
    cfg = dataclasses.replace(mt.cfg, n_routed_experts=6)
    check_divisible(cfg, 4, 2)
    with pytest.raises(ValueError, match=r"expert_parallel=4 must divide the canonical expert leaves .* "
                                         r"n_routed_experts=6 \(2 leaves\)"):
        check_divisible(cfg, 4)


def test_unknown_option_raises(model_dir, lora_config):
    with pytest.raises(ValueError, match="unknown megatron trainer options.*pipeline_parallel"):
        MegatronTrainer.from_dir(model_dir, lora_config, options={"pipeline_parallel": 2})


def test_token_ids_outside_the_vocabulary_raise(mt):
    with pytest.raises(ValueError, match="vocab_size"):
        mt.logprobs([[1, 2, 3]], [[mt.cfg.vocab_size]], temperature=1.0)
    with pytest.raises(ValueError, match="empty prompt or completion"):
        mt.logprobs([[1, 2, 3]], [[]], temperature=1.0)
