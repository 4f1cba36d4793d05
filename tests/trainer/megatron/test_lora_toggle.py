"""The trainer's LoRA switch and mode changes without walking every module per forward: the LoRA
modules are found once, the switch sets what changes, and log-probs leave the model in eval mode
whatever mode it was in."""
import torch


def _walk(model):
    return [m for m in model.modules() if getattr(m, "lora_rows", None)]


def test_lora_modules_are_the_walks_and_found_once(mt, monkeypatch):
    found = mt.model.lora_modules()
    assert found and all(a is b for a, b in zip(found, _walk(mt.model))) and len(found) == len(_walk(mt.model))
    walks = []
    real = type(mt.model).modules
    monkeypatch.setattr(type(mt.model), "modules", lambda self: (walks.append(1), real(self))[1])
    mt.model.lora_modules()
    assert not walks
    mt.model._lora_found = None  # what add_lora does: the next call walks again (the control)
    assert [id(m) for m in mt.model.lora_modules()] == [id(m) for m in found] and len(walks) == 1


def test_the_switch_reaches_every_lora_module(mt):
    try:
        mt.model.set_lora_enabled(False)
        assert not any(m.lora_on for m in _walk(mt.model))
        mt.model.set_lora_enabled(False)  # unchanged: nothing to set, still off
        assert not any(m.lora_on for m in _walk(mt.model))
    finally:
        mt.model.set_lora_enabled(True)
    assert all(m.lora_on for m in _walk(mt.model))


def test_logprobs_put_a_training_model_in_eval_mode(mt):
    prompts, completions = [[5, 6, 7]], [[8, 9]]
    want = mt.logprobs(prompts, completions, temperature=1.0)
    mt.model.train()
    got = mt.logprobs(prompts, completions, temperature=1.0)
    assert not any(m.training for m in mt.model.modules())
    assert torch.equal(got[0], want[0])
