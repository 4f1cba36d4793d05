"""Weights in and out of the Megatron modules: the HF checkpoint maps in and back bit for bit, the
adapter starts as zmrl.lora's, covers every routed expert, exports to PEFT and to the rollout's
weight-sync keys, and the trainer state resumes bit for bit."""
import copy

import pytest
import torch

from tests.trainer.megatron.conftest import T
from zmrl.lora import LoraAdapter, load_peft
from zmrl.model.checkpoint import load_checkpoint
from zmrl.trainer.base import TrainBatch, UpdateSettings

pytestmark = pytest.mark.megatron


def test_checkpoint_maps_in_and_back_bitwise(mt, model_dir):
    _, weights = load_checkpoint(model_dir)
    back = mt.hf_state_dict()
    assert set(back) == set(weights)
    for name, t in weights.items():
        assert torch.equal(back[name], t), name


def test_megatron_names_hold_the_checkpoint_tensors(mt, model_dir):
    """Spot checks of the mapping: Megatron's names, gate rows before up rows in a gated fc1."""
    _, w = load_checkpoint(model_dir)
    params = dict(mt.model.named_parameters())
    layer = mt.cfg.first_k_dense_replace  # the first MoE layer
    mg, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    assert torch.equal(params[mg + "self_attention.linear_kv_up_proj.weight"], w[hf + "self_attn.kv_b_proj.weight"])
    assert torch.equal(params[mg + "mlp.experts.linear_fc1.weight"], w[hf + "mlp.experts.gate_up_proj"])
    assert torch.equal(params[mg + "mlp.experts.linear_fc2.weight"], w[hf + "mlp.experts.down_proj"])
    fc1 = params[mg + "mlp.shared_experts.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([w[hf + "mlp.shared_experts.gate_proj.weight"],
                                       w[hf + "mlp.shared_experts.up_proj.weight"]]))
    assert torch.equal(dict(mt.model.named_buffers())[mg + "mlp.router.expert_bias"],
                       w[hf + "mlp.gate.e_score_correction_bias"])


def test_base_is_frozen_and_lora_covers_every_expert(mt):
    trainable = {n for n, p in mt.model.named_parameters() if p.requires_grad}
    assert trainable == set(mt.params) and all(".lora_" in n for n in trainable)
    moe_layers = [i for i in range(mt.cfg.num_hidden_layers) if mt.cfg.is_moe_layer(i)]
    for layer in moe_layers:
        for fc in ("linear_fc1", "linear_fc2"):
            for f in ("A", "B"):
                stacked = mt.params[f"decoder.layers.{layer}.mlp.experts.{fc}.lora_{f}"]
                assert stacked.shape[0] == mt.cfg.n_routed_experts


def test_adapter_starts_as_zmrl_lora_and_has_its_layout(mt, lora_config):
    want = LoraAdapter(mt.cfg, lora_config, seed=0)
    got = mt.adapter_tensors()
    assert list(got) == list(want.factors.keys())
    for key, p in want.factors.items():
        assert got[key].dtype == p.dtype and torch.equal(got[key], p.detach()), key


def test_grouped_experts_are_the_expert_stacks_in_zmrl_lora_layout(mt, lora_config, model_dir):
    """What the grouped expert path (CUDA) reads from the Megatron modules: the checkpoint's expert
    weights and zmrl.lora's factors, stacked over experts, and these are the stacked parameters
    themselves (no copy); with the adapter switched off (the reference policy), no factors."""
    layer = mt.cfg.first_k_dense_replace
    want = LoraAdapter(mt.cfg, lora_config, seed=0)
    _, ckpt = load_checkpoint(model_dir)
    moe = mt.model.mlp(layer)
    w, proj = moe.weights_and_projections()
    got = proj.grouped_experts(w)
    assert got.first_expert == 0 and got.scale == lora_config.scale
    assert torch.equal(got.gate_up, ckpt[f"model.layers.{layer}.mlp.experts.gate_up_proj"])
    assert torch.equal(got.down, ckpt[f"model.layers.{layer}.mlp.experts.down_proj"])
    for name, pair in (("mlp.experts.gate_up_proj", got.lora_gate_up), ("mlp.experts.down_proj", got.lora_down)):
        for t, ref in zip(pair, want.pair(layer, name)):
            assert torch.equal(t, ref.detach()), name
    fc1, fc2 = moe.experts.linear_fc1, moe.experts.linear_fc2
    assert got.gate_up is fc1.weight and got.down is fc2.weight
    for pair, stack in ((got.lora_gate_up, fc1), (got.lora_down, fc2)):
        assert pair[0] is stack.lora_A and pair[1] is stack.lora_B
    mt.model.set_lora_enabled(False)
    try:
        off = moe.weights_and_projections()[1].grouped_experts(w)
    finally:
        mt.model.set_lora_enabled(True)
    assert off.lora_gate_up is None and off.lora_down is None


def _train(mt, sampled, step: int = 0):
    prompts, completions = sampled
    old = mt.logprobs(prompts, completions, temperature=T)
    batch = TrainBatch(prompts=prompts, completions=completions, old_logprobs=old,
                       advantages=torch.linspace(-1.0, 1.0, len(prompts)))
    return mt.train_step(batch, UpdateSettings(lr=1e-2, temperature=T), step)


def test_peft_export_holds_the_trained_factors(mt, sampled, tmp_path):
    _train(mt, sampled)
    path = mt.save_adapter(tmp_path / "adapter", base_model_name_or_path="tiny")
    loaded = load_peft(path, mt.cfg)
    tensors = mt.adapter_tensors()
    assert loaded.lcfg.r == mt.lora.r and loaded.lcfg.lora_alpha == mt.lora.lora_alpha
    for key, p in loaded.factors.items():
        assert torch.equal(p.detach(), tensors[key]), key
    assert any(float(t.abs().max()) > 0 for k, t in tensors.items() if k.endswith("__B"))


def test_state_dict_resumes_bitwise(mt, sampled):
    _train(mt, sampled, step=0)
    state = copy.deepcopy(mt.state_dict())
    first = _train(mt, sampled, step=1), mt.adapter_tensors()
    mt.load_state_dict(state)
    second = _train(mt, sampled, step=1), mt.adapter_tensors()
    assert first[0] == second[0]
    for key in first[1]:
        assert torch.equal(first[1][key], second[1][key]), key
