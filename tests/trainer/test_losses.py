"""Advantages, PPO-clip, KL estimators, the exact mismatch report and the minibatch order:
properties checked in float64 against the formulas, with negative controls."""
import pytest
import torch

from zmrl.trainer.base import UpdateSettings, minibatch_order
from zmrl.trainer.losses import (aggregate, exact_mismatch, grpo_advantages, kl_estimate, ppo_clip_loss,
                                 rloo_advantages)


def test_grpo_advantages_are_group_standardized():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 0.0]])
    adv = grpo_advantages(r, eps=0.0 + 1e-12)
    for g in range(3):
        row = r[g].double()
        want = (row - row.mean()) / (row.std() + 1e-12)
        assert torch.allclose(adv[g].double(), want.nan_to_num(0.0), atol=1e-6)
    assert torch.equal(adv[1], torch.zeros(4)), "a group of equal rewards carries no signal"
    assert torch.equal(grpo_advantages(r, normalize_std=False)[2], torch.tensor([1.5, -0.5, 0.5, -1.5]))


def test_rloo_baseline_leaves_one_out():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [4.0, 1.0, 2.0, 3.0]])
    adv = rloo_advantages(r)
    for g in range(2):
        for i in range(4):
            others = torch.cat([r[g, :i], r[g, i + 1:]])
            assert adv[g, i].item() == pytest.approx(r[g, i].item() - others.mean().item(), abs=1e-6)


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(3, 1), torch.tensor([[0.0, float("nan")]])])
def test_advantages_reject_bad_groups(bad):
    with pytest.raises(ValueError):
        grpo_advantages(bad)


def test_ppo_clip_gradient_vanishes_outside_the_trust_region():
    old = torch.zeros(4)
    # ratios: 1.5 (A>0, clipped), 0.5 (A<0, clipped), 1.1 (A>0, inside), 0.5 (A>0: unclipped min)
    lp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.5])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    loss, ratio, clipped = ppo_clip_loss(lp, old, adv, 0.2, 0.2)
    loss.sum().backward()
    assert torch.allclose(loss, torch.tensor([-1.2, 0.8, -1.1, -0.5]))
    assert lp.grad[0] == 0 and lp.grad[1] == 0, "clipped tokens must not push further"
    assert lp.grad[2] != 0 and lp.grad[3] != 0, "negative control: tokens inside the region get a gradient"
    assert clipped.tolist() == [True, True, False, False]


def test_ppo_ratio_is_exactly_one_on_policy():
    lp = torch.randn(100)
    loss, ratio, _ = ppo_clip_loss(lp, lp.clone(), torch.ones(100), 0.2, 0.28)
    assert torch.equal(ratio, torch.ones(100))
    assert torch.equal(loss, -torch.ones(100))


def test_kl_estimators_k1_and_k3_are_unbiased():
    # E_{x~p}[k(x)] over the whole support equals KL(p || q) exactly (up to float64 rounding)
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, generator=gen, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(50, generator=gen, dtype=torch.float64), 0)
    kl = float((p * (p.log() - q.log())).sum())
    for est in ("k1", "k3"):
        value = float((p * kl_estimate(p.log(), q.log(), est).double()).sum())
        assert value == pytest.approx(kl, rel=1e-5), est
    assert (kl_estimate(p.log(), q.log(), "k3") >= 0).all()
    assert torch.equal(kl_estimate(p.log().float(), p.log().float(), "k3"), torch.zeros(50))


def test_aggregation_weights():
    values = torch.tensor([1.0, 1.0, 1.0, 4.0])  # a sequence of three tokens, then one of one
    assert aggregate(values, [3, 1], "token_mean").item() == 7 / 4
    assert aggregate(values, [3, 1], "seq_mean_token_mean").item() == 2.5
    with pytest.raises(ValueError, match="4 token values for sequences of 5 tokens"):
        aggregate(values, [3, 2], "token_mean")


def test_exact_mismatch_sees_one_ulp():
    gen = torch.Generator().manual_seed(1)
    rollout = [-torch.rand(5, generator=gen) for _ in range(3)]
    same = exact_mismatch(rollout, [t.clone() for t in rollout])
    assert same["tokens_different"] == 0 and same["logprob_abs_diff_max"] == 0.0 and same["kl"] == 0.0
    assert same["first"] is None
    trainer = [t.clone() for t in rollout]
    trainer[2][3] = torch.nextafter(trainer[2][3], torch.tensor(0.0))
    diff = exact_mismatch(rollout, trainer)
    assert diff["tokens_different"] == 1 and diff["first"][:2] == (2, 3)
    assert diff["logprob_abs_diff_max"] > 0 and diff["kl"] != 0


def test_minibatch_order_partitions_and_is_seeded():
    s = UpdateSettings(num_minibatches=3, epochs=3, seed=5)
    order = minibatch_order(10, s, step=7)
    assert order[0] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]], "epoch 0 keeps batch order"
    for epoch in order:
        assert sorted(i for mb in epoch for i in mb) == list(range(10))
    assert order == minibatch_order(10, s, step=7)
    assert order[1] != minibatch_order(10, s, step=8)[1]
    with pytest.raises(ValueError):
        minibatch_order(2, s, step=0)
