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
    sums = {"loss/policy": 0.0, "loss/kl": 0.0, "loss/total": 0.0, "policy/clip_frac": 0.0,
            "policy/approx_kl_old": 0.0, "policy/grad_norm": 0.0}
    ratio_dev, num_mb = None, 0
    for epoch_mbs in minibatch_order(len(batch), settings, step):
        for idx in epoch_mbs:
            zero_grads()
            lps = logprobs([batch.prompts[i] for i in idx], [batch.completions[i] for i in idx])
            pol, kls, clipped, approx = [], [], [], []
            for lp, i in zip(lps, idx):
                old = batch.old_logprobs[i].to(lp.device)
                adv = batch.advantages[i].to(lp.device).expand(lp.shape)
                loss, ratio, was_clipped = ppo_clip_loss(lp, old, adv, settings.clip_eps, clip_high)
                pol.append(loss)
                clipped.append(was_clipped.float())
                approx.append(kl_estimate(old, lp.detach(), "k3"))
                if settings.kl_coef > 0:
                    kls.append(kl_estimate(lp, batch.ref_logprobs[i].to(lp.device), settings.kl_estimator))
                if num_mb == 0:  # scored before this update's first optimizer step
                    ratio_dev = max(ratio_dev or 0.0, float((ratio.double() - 1.0).abs().max()))
            policy_loss = aggregate(pol, settings.loss_agg)
            kl_loss = aggregate(kls, settings.loss_agg) if kls else torch.zeros(())
            total = policy_loss + settings.kl_coef * kl_loss if kls else policy_loss
            # the backward runs on torch's own aten kernels even when an in-process vLLM has switched
            # the overrides on: gradients need no batch invariance (only the forward's log-probs must
            # match the rollout's), and the update's bits then do not depend on which rollout backend
            # shares the process
            with batch_invariant_mode(False):
                total.backward()
            for m, g in zip(masters, master_grads()):
                m.grad = g.float()
            norm = torch.nn.utils.clip_grad_norm_(masters, settings.max_grad_norm or float("inf"), foreach=False)
            optimizer.step()
            write_masters()
            zero_grads()
            num_mb += 1
            sums["loss/policy"] += float(policy_loss.detach())
            sums["loss/kl"] += float(kl_loss.detach())
            sums["loss/total"] += float(total.detach())
            sums["policy/clip_frac"] += float(aggregate(clipped, "token_mean"))
            sums["policy/approx_kl_old"] += float(aggregate(approx, "token_mean"))
            sums["policy/grad_norm"] += float(norm)
    out = {k: v / num_mb for k, v in sums.items()}
    out.update({"policy/lr": settings.lr, "mismatch/ratio_first_minibatch_max_abs_dev": ratio_dev,
                "train/num_minibatches": num_mb, "train/num_tokens": batch.num_tokens})
    return out, num_mb
