"""The Megatron trainer's recomputed log-probs are the reference host's, bit for bit, and its LoRA
gradients and PPO steps are the reference trainer's (docs/design.md, "The numerics contract").

The reference host scores each sequence alone (zmrl.rollout.reference.ReferenceEngine.score:
one forward_packed over that sequence); Megatron packs every sequence of the call into one THD
batch, so equality also shows that a token's log-prob does not depend on its batchmates.
"""
import pytest
import torch

import zmrl.batch_invariant as bi
from tests.bitwise import first_difference as first_diff
from tests.trainer.megatron.conftest import T, random_adapter, set_reference_adapter
from zmrl.model.packed import forward_packed
from zmrl.rollout.reference import ReferenceEngine
from zmrl.trainer.base import TrainBatch, UpdateSettings

pytestmark = pytest.mark.megatron

def _assert_scores_equal(got, engine, prompts, completions):
    for i, (lp, p, c) in enumerate(zip(got, prompts, completions)):
        want = engine.score(p, c, T)
        assert torch.equal(lp, want), f"sequence {i} (prompt {len(p)}, completion {len(c)}): {first_diff(lp, want)}"


def test_logprobs_equal_reference_host_bitwise(mt, reference_engine, sampled):
    prompts, completions = sampled
    assert max(len(p) + len(c) for p, c in zip(prompts, completions)) > mt.cfg.index_topk
    assert len({len(p) + len(c) for p, c in zip(prompts, completions)}) > 1
    # a fresh adapter (B = 0) and the adapter switched off both give the base model's bits
    _assert_scores_equal(mt.logprobs(prompts, completions, temperature=T), reference_engine, prompts, completions)
    _assert_scores_equal(mt.logprobs(prompts, completions, temperature=T, adapter=False), reference_engine,
                         prompts, completions)


def test_logits_equal_forward_packed_bitwise(mt, reference_engine, sampled):
    prompts, completions = sampled
    seqs = [torch.tensor(p + c) for p, c in zip(prompts, completions)]
    got = mt.logits(seqs, adapter=False)
    want = forward_packed(mt.cfg, reference_engine.weights, reference_engine.w_layers, seqs)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"sequence {i}: {first_diff(a, b)}"


def test_logprobs_equal_reference_host_after_lora_updates(mt, reference_engine, sampled):
    prompts, completions = sampled
    old = mt.logprobs(prompts, completions, temperature=T)
    adv = torch.linspace(-1.0, 1.0, len(prompts))
    settings = UpdateSettings(lr=5e-3, num_minibatches=2, temperature=T)  # two optimizer steps
    mt.train_step(TrainBatch(prompts=prompts, completions=completions, old_logprobs=old, advantages=adv),
                  settings, step=0)
    tensors = mt.adapter_tensors()
    assert max(float(t.abs().max()) for k, t in tensors.items() if k.endswith("__B")) > 0
    device = next(iter(reference_engine.weights.values())).device
    adapter = mt.adapter().to(device)  # gathered on the host; the reference engine may be on CUDA
    host = ReferenceEngine(mt.cfg, reference_engine.weights, adapter.projections)
    got = mt.logprobs(prompts, completions, temperature=T)
    assert any(not torch.equal(a, b) for a, b in zip(got, old)), "the updates changed nothing"
    _assert_scores_equal(got, host, prompts, completions)
    # the reference policy (adapter off) is still the base model
    _assert_scores_equal(mt.logprobs(prompts, completions, temperature=T, adapter=False), reference_engine,
                         prompts, completions)


def test_lora_gradients_match_reference_trainer(mt, ref, sampled):
    prompts, completions = sampled
    tensors = random_adapter(mt, seed=5)  # nonzero B, so every A receives a gradient too
    mt.load_adapter_tensors(tensors)
    set_reference_adapter(ref, tensors)
    weights = torch.linspace(-1.0, 2.0, len(prompts))
    for trainer in (mt, ref):
        lps = trainer._logprobs(prompts, completions, T, True)
        # as the trainers' own backward: torch's aten kernels even when an earlier test's vLLM
        # engine switched the overrides on (they reject sparse MLA's float64 backward recompute)
        with bi.batch_invariant_mode(False):
            torch.stack([w * lp.sum() for w, lp in zip(weights, lps)]).sum().backward()
    got = mt.lora_grads()
    for p in mt.params.values():
        p.grad = None
    for key, p in ref.adapter.factors.items():
        want = p.grad
        p.grad = None
        assert want is not None and float(want.abs().max()) > 0, f"{key}: no gradient on the reference side"
        assert torch.equal(got[key], want), f"{key}: {first_diff(got[key], want)}"


def test_train_step_matches_reference_trainer(mt, ref, sampled, reference_engine):
    """Same start, batch and settings: the same metrics and the same adapter after 2 epochs of
    2 minibatches; the first minibatch's importance ratio is exactly 1 (old = rollout log-probs)."""
    prompts, completions = sampled
    old = [reference_engine.score(p, c, T) for p, c in zip(prompts, completions)]
    batch = TrainBatch(prompts=prompts, completions=completions, old_logprobs=old,
                       advantages=torch.linspace(1.0, -1.0, len(prompts)),
                       ref_logprobs=ref.logprobs(prompts, completions, temperature=T, adapter=False))
    settings = UpdateSettings(lr=1e-2, num_minibatches=2, epochs=2, kl_coef=0.05, temperature=T)
    got = mt.train_step(batch, settings, step=3)
    want = ref.train_step(batch, settings, step=3)
    assert got["mismatch/ratio_first_minibatch_max_abs_dev"] == 0.0
    assert got == want
    a, b = mt.adapter_tensors(), ref.adapter_tensors()  # the Megatron trainer's live on its device
    for key in b:
        assert torch.equal(a[key].cpu(), b[key]), f"{key}: {first_diff(a[key].cpu(), b[key])}"


def _packed_vs_alone(mt, prompts, completions) -> list[int]:
    """Per sequence, how many of its log-probs differ between one packed call holding every
    sequence and a call holding that sequence alone (the same trainer, the same kernels)."""
    packed = mt.logprobs(prompts, completions, temperature=T)
    alone = [mt.logprobs([p], [c], temperature=T)[0] for p, c in zip(prompts, completions)]
    return [int((a != b).sum()) for a, b in zip(packed, alone)]


def test_logprobs_do_not_depend_on_the_batch(mt, sampled):
    prompts, completions = sampled
    assert _packed_vs_alone(mt, prompts, completions) == [0] * len(prompts)


def test_negative_control_batch_variant_kernels_depend_on_the_batch(mt, sampled):
    """The same comparison with batch invariance off (torch's default kernels) fails: a packed
    batch of all sequences gives other bits than each sequence alone, so the equalities in this
    file test batch invariance and are not vacuous. Only the kernels differ from the test above."""
    prompts, completions = sampled
    mt.invariant = False
    try:
        differing = _packed_vs_alone(mt, prompts, completions)
    finally:
        mt.invariant = True
    assert sum(differing) > 0, "invariance off still gave every sequence the same bits in and out of the batch"
