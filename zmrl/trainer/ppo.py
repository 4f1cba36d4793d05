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
            olds = _to_device([batch.old_logprobs[i] for i in idx], device, lengths)
            advs = batch.advantages[idx].to(device, non_blocking=True)
            refs = _to_device([batch.ref_logprobs[i] for i in idx], device, lengths) if settings.kl_coef > 0 else None
            pol, kls, clipped, approx, devs = [], [], [], [], []
            for j, lp in enumerate(lps):
                old = olds[j]
                loss, ratio, was_clipped = ppo_clip_loss(lp, old, advs[j].expand(lp.shape), settings.clip_eps, clip_high)
                pol.append(loss)
                clipped.append(was_clipped.float())
                approx.append(kl_estimate(old, lp.detach(), "k3"))
                if refs is not None:
                    kls.append(kl_estimate(lp, refs[j], settings.kl_estimator))
                if num_mb == 0:  # scored before this update's first optimizer step
                    devs.append((ratio.detach().double() - 1.0).abs().max())
            policy_loss = aggregate(pol, settings.loss_agg)
            kl_loss = aggregate(kls, settings.loss_agg) if kls else torch.zeros((), device=device)
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
            if num_mb == 0:
                ratio_dev = torch.stack(devs).max()
            row = torch.stack([policy_loss.detach(), kl_loss.detach(), total.detach(),
                               aggregate(clipped, "token_mean"), aggregate(approx, "token_mean"),
                               norm.to(device)]).double()
            sums = row if sums is None else sums + row
            num_mb += 1
    *totals, ratio_dev = torch.cat([sums, ratio_dev.view(1)]).tolist()  # the step's one read of its metrics
    out = {k: v / num_mb for k, v in zip(keys, totals)}
    out.update({"policy/lr": settings.lr, "mismatch/ratio_first_minibatch_max_abs_dev": ratio_dev,
                "train/num_minibatches": num_mb, "train/num_tokens": batch.num_tokens})
    return out, num_mb


def _to_device(tensors: list[torch.Tensor], device: torch.device, lengths: list[int]) -> list[torch.Tensor]:
    """Per-sequence host tensors -> the same on `device`, in one copy."""
    for j, (t, n) in enumerate(zip(tensors, lengths)):
        if t.numel() != n:  # checked per sequence: equal totals could still pair tokens wrongly
            raise ValueError(f"sequence {j} of the minibatch: {t.numel()} log-probs for {n} completion tokens")
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return list(flat.to(device, non_blocking=True).split(lengths))
