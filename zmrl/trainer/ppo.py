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
) -> tuple[dict[str, float], int]:
    """-> (metrics averaged over minibatches, number of optimizer steps taken)."""
    if settings.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs the batch's ref_logprobs")
    for group in optimizer.param_groups:
        group.update(lr=settings.lr, betas=tuple(settings.betas), eps=settings.eps, weight_decay=settings.weight_decay)
    clip_high = settings.clip_eps if settings.clip_eps_high is None else settings.clip_eps_high
    keys = ("loss/policy", "loss/kl", "loss/total", "policy/clip_frac", "policy/approx_kl_old", "policy/grad_norm")
    # metrics are summed on the device in float64, one minibatch after another (the very
    # additions a Python float sum makes), and read back once per step: no wait per minibatch
    sums, ratio_dev, num_mb = None, None, 0
    for epoch_mbs in minibatch_order(len(batch), settings, step):
        for idx in epoch_mbs:
            zero_grads()
            lps = logprobs([batch.prompts[i] for i in idx], [batch.completions[i] for i in idx])
            device, lengths = lps[0].device, [lp.numel() for lp in lps]
            # every per-token term over the minibatch's tokens laid end to end: elementwise math,
            # so each token's bits are those of a call per sequence, in a handful of launches
            lp = torch.cat(lps) if len(lps) > 1 else lps[0]
            old = _flat_on(device, [batch.old_logprobs[i] for i in idx], lengths)
            adv = batch.advantages[idx].float().repeat_interleave(torch.tensor(lengths)).to(device, non_blocking=True)
            loss, ratio, was_clipped = ppo_clip_loss(lp, old, adv, settings.clip_eps, clip_high)
            policy_loss = aggregate(loss, lengths, settings.loss_agg)
            if settings.kl_coef > 0:
                ref = _flat_on(device, [batch.ref_logprobs[i] for i in idx], lengths)
                kl_loss = aggregate(kl_estimate(lp, ref, settings.kl_estimator), lengths, settings.loss_agg)
                total = policy_loss + settings.kl_coef * kl_loss
            else:
                kl_loss, total = torch.zeros((), device=device), policy_loss
            if num_mb == 0:  # scored before this update's first optimizer step
                ratio_dev = (ratio.double() - 1.0).abs().max()
            # the backward runs on torch's own aten kernels even when an in-process vLLM has switched
            # the overrides on: gradients need no batch invariance (only the forward's log-probs must
            # match the rollout's), and the update's bits then do not depend on which rollout backend
            # shares the process
            with batch_invariant_mode(False):
                total.backward()
            norm = clip_onto_masters(masters, master_grads(), settings.max_grad_norm)
            optimizer.step()
            write_masters()
            zero_grads()
            row = torch.stack([policy_loss.detach(), kl_loss.detach(), total.detach(),
                               was_clipped.float().mean(), kl_estimate(old, lp.detach(), "k3").mean(),
                               norm.to(device)]).double()
            sums = row if sums is None else sums + row
            num_mb += 1
    *totals, ratio_dev = torch.cat([sums, ratio_dev.view(1)]).tolist()  # the step's one read of its metrics
    out = {k: v / num_mb for k, v in zip(keys, totals)}
    out.update({"policy/lr": settings.lr, "mismatch/ratio_first_minibatch_max_abs_dev": ratio_dev,
                "train/num_minibatches": num_mb, "train/num_tokens": batch.num_tokens})
    return out, num_mb


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
