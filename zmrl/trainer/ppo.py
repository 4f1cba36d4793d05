"""The PPO-clip update over LoRA parameters, shared by every trainer backend.

A backend supplies how to score sequences with the adapter on, how to clear and read its LoRA
gradients (in the canonical adapter order of `masters`) and how to write the stepped fp32 masters
back into the parameters its forward multiplies by. Everything else, and therefore every bit of
the update, is this one loop: minibatch order from `minibatch_order`, the losses of losses.py,
AdamW on fp32 masters, gradient clipping, metrics.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from zmrl.batch_invariant import batch_invariant_mode
from zmrl.trainer.base import TrainBatch, UpdateSettings, minibatch_order
from zmrl.trainer.losses import aggregate, kl_estimate, ppo_clip_loss


EagerRun = Callable[[list[int], bool], tuple[torch.Tensor, "torch.Tensor | None"]]
"""(the minibatch's sequence indices, whether it is the step's first) -> (its metrics row: policy,
KL and total loss, clip fraction, approx KL to old, gradient norm, float64 [6] on the device; for
the first, max |ratio - 1| as a device scalar, else None), with the clipped fp32 gradient left on
the masters' .grad for the optimizer step."""
MinibatchRun = Callable[[list[int], bool, EagerRun], tuple[torch.Tensor, "torch.Tensor | None"]]
"""A backend's own run of a minibatch: as EagerRun, also handed ppo_update's eager run, which it
may delegate to (a minibatch it cannot run its own way)."""


def ppo_update(
    batch: TrainBatch,
    settings: UpdateSettings,
    step: int,
    *,
    optimizer: torch.optim.Optimizer,
    masters: list[torch.Tensor],
    logprobs: Callable[[list[list[int]], list[list[int]]], list[torch.Tensor]],
    zero_grads: Callable[[], None],
    master_grads: Callable[[], list[torch.Tensor]],
    write_masters: Callable[[], None],
    minibatch: MinibatchRun | None = None,
) -> tuple[dict[str, float], int]:
    """-> (metrics averaged over minibatches, number of optimizer steps taken).

    minibatch: a backend's own run of a minibatch's forward, loss, backward and clipping (the
    Megatron trainer's padded CUDA graphs), handed the eager one below to fall back on; by
    default the eager one, through `logprobs`, `zero_grads` and `master_grads`."""
    if settings.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs the batch's ref_logprobs")
    for group in optimizer.param_groups:
        group.update(lr=settings.lr, betas=tuple(settings.betas), eps=settings.eps, weight_decay=settings.weight_decay)
    keys = ("loss/policy", "loss/kl", "loss/total", "policy/clip_frac", "policy/approx_kl_old", "policy/grad_norm")

    def eager(idx: list[int], first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        zero_grads()
        lps = logprobs([batch.prompts[i] for i in idx], [batch.completions[i] for i in idx])
        device, lengths = lps[0].device, [lp.numel() for lp in lps]
        # every per-token term over the minibatch's tokens laid end to end: elementwise math,
        # so each token's bits are those of a call per sequence, in a handful of launches
        lp = torch.cat(lps) if len(lps) > 1 else lps[0]
        old = _flat_on(device, [batch.old_logprobs[i] for i in idx], lengths)
        adv = batch.advantages[idx].float().repeat_interleave(torch.tensor(lengths)).to(device, non_blocking=True)
        loss, ratio, was_clipped = ppo_clip_loss(lp, old, adv, settings.clip_eps, settings.clip_high)
        policy_loss = aggregate(loss, lengths, settings.loss_agg)
        if settings.kl_coef > 0:
            ref = _flat_on(device, [batch.ref_logprobs[i] for i in idx], lengths)
            kl_loss = aggregate(kl_estimate(lp, ref, settings.kl_estimator), lengths, settings.loss_agg)
            total = policy_loss + settings.kl_coef * kl_loss
        else:
            kl_loss, total = torch.zeros((), device=device), policy_loss
        ratio_dev = (ratio.double() - 1.0).abs().max() if first else None
        # the backward runs on torch's own aten kernels even when an in-process vLLM has switched
        # the overrides on: gradients need no batch invariance (only the forward's log-probs must
        # match the rollout's), and the update's bits then do not depend on which rollout backend
        # shares the process
        with batch_invariant_mode(False):
            total.backward()
        norm = clip_onto_masters(masters, master_grads(), settings.max_grad_norm)
        row = torch.stack([policy_loss.detach(), kl_loss.detach(), total.detach(),
                           was_clipped.float().mean(), kl_estimate(old, lp.detach(), "k3").mean(),
                           norm.to(device)]).double()
        return row, ratio_dev

    def run(idx: list[int], first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return eager(idx, first) if minibatch is None else minibatch(idx, first, eager)

    # metrics are summed on the device in float64, one minibatch after another (the very
    # additions a Python float sum makes), and read back once per step: no wait per minibatch
    sums, ratio_dev, num_mb = None, None, 0
    for epoch_mbs in minibatch_order(len(batch), settings, step):
        for idx in epoch_mbs:
            row, dev = run(idx, num_mb == 0)  # the first is scored before this update's first optimizer step
            if num_mb == 0:
                ratio_dev = dev
            optimizer.step()
            write_masters()
            zero_grads()
            sums = row if sums is None else sums + row
            num_mb += 1
    *totals, ratio_dev = torch.cat([sums, ratio_dev.view(1)]).tolist()  # the step's one read of its metrics
    out = {k: v / num_mb for k, v in zip(keys, totals)}
    out.update({"policy/lr": settings.lr, "mismatch/ratio_first_minibatch_max_abs_dev": ratio_dev,
                "train/num_minibatches": num_mb, "train/num_tokens": batch.num_tokens})
    return out, num_mb


def padded_minibatch_terms(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, ref: torch.Tensor | None,
                           weights: torch.Tensor, mask: torch.Tensor,
                           settings: UpdateSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager minibatch's loss and metrics over a padded minibatch's rows (zmrl.trainer.padding:
    [R] each, `weights` the aggregation's per-token weights, 0 on padding). Fixed shapes and no
    host ints, so a CUDA graph can hold it. -> (total loss, [5] float64: policy loss, KL loss, total,
    clip fraction, approx KL to old; max |ratio - 1| over the real tokens)."""
    lp = torch.where(mask, lp, 0.0)  # a padding row scores some token: keep it out of every term
    loss, ratio, was_clipped = ppo_clip_loss(lp, old, adv, settings.clip_eps, settings.clip_high)
    policy_loss = (loss * weights).sum()
    if settings.kl_coef > 0:
        kl_loss = (kl_estimate(lp, ref, settings.kl_estimator) * weights).sum()
        total = policy_loss + settings.kl_coef * kl_loss
    else:
        kl_loss, total = torch.zeros((), device=lp.device), policy_loss
    real = mask.float()
    count = real.sum()
    clip_frac = (was_clipped.float() * real).sum() / count
    approx_kl = (kl_estimate(old, lp.detach(), "k3") * real).sum() / count
    ratio_dev = torch.where(mask, (ratio.double() - 1.0).abs(), 0.0).max()
    terms = torch.stack([policy_loss.detach(), kl_loss.detach(), total.detach(), clip_frac, approx_kl]).double()
    return total, terms, ratio_dev


def adamw(masters: list[torch.Tensor]) -> torch.optim.AdamW:
    """AdamW over the fp32 masters, every backend the same: torch's fused kernel (a few launches per
    step on a GPU instead of about eight per tensor). Its math is elementwise, so the bits do not
    depend on how the tensors are grouped, and every trainer that steps the same masters with it
    gets the same bits."""
    return torch.optim.AdamW(masters, lr=1e-4, fused=True)


def clip_onto_masters(masters: list[torch.Tensor], grads: list[torch.Tensor],
                      max_grad_norm: float | None) -> torch.Tensor:
    """The canonical LoRA gradients (masters' order) onto the fp32 masters' .grad, clipped to
    `max_grad_norm` (None: not clipped). -> the gradient's global L2 norm before clipping (a
    device tensor: nothing here waits for the device)."""
    if len(grads) != len(masters):
        raise ValueError(f"{len(grads)} gradients for {len(masters)} masters")
    for m in masters:
        if m.grad is None:  # the fp32 buffers are made once and reused every step
            m.grad = torch.empty_like(m)
    torch._foreach_copy_([m.grad for m in masters], grads)  # one launch casts every gradient to fp32
    return torch.nn.utils.clip_grad_norm_(masters, max_grad_norm or float("inf"), foreach=True)


def _flat_on(device: torch.device, tensors: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """Per-sequence host tensors -> one tensor of them end to end on `device`, in one copy."""
    for j, (t, n) in enumerate(zip(tensors, lengths)):
        if t.numel() != n:  # checked per sequence: equal totals could still pair tokens wrongly
            raise ValueError(f"sequence {j} of the minibatch: {t.numel()} log-probs for {n} completion tokens")
    return torch.cat([t.reshape(-1) for t in tensors]).to(device, non_blocking=True)
