"""The reference trainer: its log-probs are the rollout's bits (ReferenceEngine's, which run the same
kernels), its first minibatch's importance ratio is exactly 1, its updates are deterministic and
resumable from state_dict, and its adapter round-trips through PEFT files."""
import pytest
import torch

from zmrl.lora import LoraAdapter, LoraConfig, load_peft
from zmrl.model.checkpoint import save_weights, write_config
from zmrl.model.config import ModelConfig
from zmrl.model.layers import init_weights
from zmrl.model.presets import PRESETS
from zmrl.rollout.reference import ReferenceEngine
from zmrl.trainer.base import TrainBatch, UpdateSettings
from zmrl.trainer.reference import ReferenceTrainer

LORA = LoraConfig(r=4, lora_alpha=8.0)
SETTINGS = UpdateSettings(lr=1e-2, num_minibatches=2, epochs=2, max_grad_norm=1.0, temperature=0.9)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    cfg = ModelConfig(**PRESETS["tiny"])
    write_config(cfg, out)
    save_weights(cfg, init_weights(cfg, seed=0), out)
    return out


def _rollout(trainer: ReferenceTrainer, prompts, seed):
    """A ReferenceEngine with its own copies of the weights and of the trainer's adapter."""
    engine = ReferenceEngine(trainer.cfg, {k: v.clone() for k, v in trainer.weights.items()})
    adapter = LoraAdapter(trainer.cfg, trainer.lora, seed=99).requires_grad_(False)
    with torch.no_grad():
        for k, v in trainer.adapter_tensors().items():
            adapter.factors[k].copy_(v)
    engine.projections = adapter.projections
    samples = engine.generate(prompts, n=2, max_tokens=5, temperature=0.9, seed=seed, stop_at_eos=False)
    flat = [(p, s) for p, group in zip(prompts, samples) for s in group]
    return engine, [p for p, _ in flat], [s.token_ids for _, s in flat], [s.logprobs for _, s in flat]


def _batch(prompts, completions, old, ref=None):
    adv = torch.tensor([1.0, -1.0] * (len(prompts) // 2))
    return TrainBatch(prompts=prompts, completions=completions, old_logprobs=old, advantages=adv, ref_logprobs=ref)


PROMPTS = [[5, 9, 13], list(range(20, 41)), [7]]  # 21 tokens > index_topk = 16: sparse attention


def test_logprobs_equal_rollout_bitwise_after_updates(model_dir):
    trainer = ReferenceTrainer.from_dir(model_dir, LORA, seed=0)
    for step in range(2):  # a non-zero adapter from step 1 on
        _, P, C, old = _rollout(trainer, PROMPTS, seed=step)
        lp = trainer.logprobs(P, C, temperature=0.9)
        for i, (a, b) in enumerate(zip(old, lp)):
            assert torch.equal(a, b), f"step {step} sequence {i}: {a} vs {b}"
        metrics = trainer.train_step(_batch(P, C, old), SETTINGS, step)
        assert metrics["mismatch/ratio_first_minibatch_max_abs_dev"] == 0.0
    assert any(v.abs().sum() > 0 for k, v in trainer.adapter_tensors().items() if k.endswith("__B"))


def test_logprobs_do_not_depend_on_batchmates(model_dir, monkeypatch):
    import zmrl.batch_invariant as bi
    from tests.model.test_invariance import _plain_torch_linear

    trainer = ReferenceTrainer.from_dir(model_dir, LORA, seed=0)
    _, P, C, _ = _rollout(trainer, PROMPTS, seed=3)

    def differing():
        together = trainer.logprobs(P, C, temperature=1.0)
        return sum(not torch.equal(trainer.logprobs([P[i]], [C[i]], temperature=1.0)[0], together[i])
                   for i in range(len(P)))

    assert differing() == 0
    with monkeypatch.context() as m, bi.batch_invariant_mode(False):  # negative control: torch's GEMMs
        _plain_torch_linear(m)
        assert differing() > 0


def test_reference_policy_is_the_base_model(model_dir):
    trainer = ReferenceTrainer.from_dir(model_dir, LORA, seed=0)
    engine, P, C, old = _rollout(trainer, PROMPTS, seed=4)
    trainer.train_step(_batch(P, C, old), SETTINGS, 0)
    engine.projections = None
    ref = trainer.logprobs(P, C, temperature=1.0, adapter=False)
    pol = trainer.logprobs(P, C, temperature=1.0)
    for p, c, r, q in zip(P, C, ref, pol):
        assert torch.equal(engine.score(p, c, 1.0), r)
    assert any(not torch.equal(r, q) for r, q in zip(ref, pol)), "negative control: the adapter changes log-probs"


def test_ratio_metric_sees_a_one_ulp_difference(model_dir):
    trainer = ReferenceTrainer.from_dir(model_dir, LORA, seed=0)
    _, P, C, old = _rollout(trainer, PROMPTS, seed=5)
    old = [t.clone() for t in old]
    old[0][0] = torch.nextafter(old[0][0], torch.tensor(0.0))
    metrics = trainer.train_step(_batch(P, C, old), SETTINGS, 0)
    assert metrics["mismatch/ratio_first_minibatch_max_abs_dev"] > 0


def test_policy_gradient_direction(model_dir):
    trainer = ReferenceTrainer.from_dir(model_dir, LORA, seed=0)
    _, P, C, old = _rollout(trainer, PROMPTS[:1], seed=6)
    trainer.train_step(_batch(P, C, old), UpdateSettings(lr=1e-2, temperature=0.9), 0)
    new = trainer.logprobs(P, C, temperature=0.9)
    assert new[0].sum() > old[0].sum(), "advantage +1: the sequence gets likelier"
    assert new[1].sum() < old[1].sum(), "advantage -1: the sequence gets less likely"


def test_updates_are_deterministic_and_resume_from_state_dict(model_dir, tmp_path):
    a = ReferenceTrainer.from_dir(model_dir, LORA, seed=0)
    _, P, C, old = _rollout(a, PROMPTS, seed=7)
    ref = a.logprobs(P, C, temperature=0.9, adapter=False)
    batch = _batch(P, C, old, ref)
    settings = UpdateSettings(lr=1e-2, num_minibatches=2, epochs=2, kl_coef=0.1, temperature=0.9)
    m1 = a.train_step(batch, settings, 0)
    saved = a.state_dict()
    torch.save(saved, tmp_path / "t.pt")
    m2 = a.train_step(batch, settings, 1)

    b = ReferenceTrainer.from_dir(model_dir, LORA, seed=0)
    assert b.train_step(batch, settings, 0) == m1
    b2 = ReferenceTrainer.from_dir(model_dir, LORA, seed=123)  # other init: fully replaced by the state
    b2.load_state_dict(torch.load(tmp_path / "t.pt", weights_only=False))
    assert b2.train_step(batch, settings, 1) == m2
    for k, v in a.adapter_tensors().items():
        assert torch.equal(v, b2.adapter_tensors()[k]), k
    assert m2["loss/kl"] > 0.0, "the policy has moved from the reference: the penalty is active"


def test_state_from_another_lora_is_refused(model_dir):
    a = ReferenceTrainer.from_dir(model_dir, LORA, seed=0)
    b = ReferenceTrainer.from_dir(model_dir, LoraConfig(r=2, lora_alpha=8.0), seed=0)
    with pytest.raises(ValueError, match="LoRA"):
        b.load_state_dict(a.state_dict())


def test_state_that_does_not_fit_is_refused_and_restores_nothing(model_dir):
    a = ReferenceTrainer.from_dir(model_dir, LORA, seed=0)
    b = ReferenceTrainer.from_dir(model_dir, LORA, seed=1)
    before = {k: v.clone() for k, v in b.adapter_tensors().items()}
    key = next(iter(a.state_dict()["adapter"]))
    cases = [("format", lambda st: st.update(format="zmrl.trainer.other/9")),
             ("missing", lambda st: st["masters"].pop(key)),
             ("shape", lambda st: st["adapter"].update({key: st["adapter"][key][:1]}))]
    for what, spoil in cases:
        state = a.state_dict()
        spoil(state)
        with pytest.raises(ValueError, match="format" if what == "format" else key):
            b.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in b.adapter_tensors().items())
    assert b.num_steps == 0


def test_peft_export_round_trips(model_dir, tmp_path):
    trainer = ReferenceTrainer.from_dir(model_dir, LORA, seed=0)
    _, P, C, old = _rollout(trainer, PROMPTS[:1], seed=8)
    trainer.train_step(_batch(P, C, old), UpdateSettings(lr=1e-2, temperature=0.9), 0)
    trainer.save_adapter(tmp_path / "adapter")
    loaded = load_peft(tmp_path / "adapter", trainer.cfg)
    for k, v in trainer.adapter_tensors().items():
        assert torch.equal(loaded.factors[k], v), k


def test_trainer_never_imports_the_rollout():
    import subprocess
    import sys

    code = ("import sys, zmrl.trainer.reference, zmrl.trainer.losses; "
            "bad = [m for m in sys.modules if m.startswith('zmrl.rollout')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_log_probs_of_the_wrong_length_are_refused_per_sequence():
    # lengths swapped between two sequences keep the totals equal: only a per-sequence check sees it
    prompts, completions = [[1], [2]], [[3, 4, 5], [6]]
    right = [torch.zeros(3), torch.zeros(1)]
    swapped = [torch.zeros(1), torch.zeros(3)]
    _batch(prompts, completions, right, right)  # the control: matching lengths are taken
    with pytest.raises(ValueError, match="sequence 0: 3 completion tokens but 1 old log-probs"):
        _batch(prompts, completions, swapped)
    with pytest.raises(ValueError, match="sequence 0: 3 completion tokens but 1 reference log-probs"):
        _batch(prompts, completions, right, swapped)
