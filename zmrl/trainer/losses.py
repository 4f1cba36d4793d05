"""Advantages, the PPO-clip token loss and KL estimators: plain torch math, deterministic.

Shapes: rewards [P, G] (P prompts, G completions each); per-token tensors [T] (one sequence) or
any shape broadcastable with each other. Reductions run in float64 where a value is reported,
so that a metric of exactly-equal inputs is exactly 0.0.
"""
from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [P, G] -> fp32 [P, G]: (r - mean_g r) / (std_g r + eps) within each prompt's group
    (std with Bessel's correction, as GRPO's reference implementation; normalize_std=False gives
    Dr. GRPO's mean-only centering). A group whose rewards are all equal gets advantage 0."""
    r = _check_groups(rewards).double()
    centered = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    return centered.float()


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [P, G] -> fp32 [P, G]: r_i minus the mean of the other G - 1 rewards of its group
    (REINFORCE leave-one-out baseline)."""
    r = _check_groups(rewards).double()
    g = r.shape[1]
    baseline = (r.sum(dim=1, keepdim=True) - r) / (g - 1)
    return (r - baseline).float()


def _check_groups(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, G >= 2 samples], got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    return rewards


ADVANTAGES = {"grpo": grpo_advantages, "rloo": rloo_advantages,
              "dr_grpo": lambda r: grpo_advantages(r, normalize_std=False)}


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(lp - old).

    -> (loss [T] fp32, ratio [T] (detached), clipped [T] bool: the clipped term was the active one)."""
    ratio = torch.exp(logprobs.float() - old_logprobs.float())
    adv = advantages.float()
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    return loss, ratio.detach(), (clipped < unclipped).detach()


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3):
    k1 = lp - ref, k2 = (lp - ref)^2 / 2, k3 = exp(ref - lp) - (ref - lp) - 1 (unbiased, >= 0)."""
    d = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def aggregate(token_values: torch.Tensor, lengths: list[int], mode: str) -> torch.Tensor:
    """Per-token values of sequences laid end to end (`lengths` tokens each) -> one scalar:
    token_mean (every token weighs the same) or seq_mean_token_mean (every sequence weighs the same)."""
    if sum(lengths) != token_values.numel():
        raise ValueError(f"{token_values.numel()} token values for sequences of {sum(lengths)} tokens")
    if mode == "token_mean":
        return token_values.mean()
    if mode == "seq_mean_token_mean":
        return torch.stack([v.mean() for v in token_values.split(lengths)]).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}")


def exact_mismatch(rollout: list[torch.Tensor], trainer: list[torch.Tensor]) -> dict:
    """Both sides' per-token fp32 log-probs of the same sampled tokens -> the mismatch report:
    max |diff|, number of differing tokens (bitwise), k1 KL estimate mean(lp_rollout - lp_trainer)
    over all tokens (exactly 0.0 when every token matches) and the first differing
    (sequence, token) or None."""
    diffs, count, first = [], 0, None
    for i, (a, b) in enumerate(zip(rollout, trainer, strict=True)):
        if a.shape != b.shape:
            raise ValueError(f"sequence {i}: rollout has {a.numel()} log-probs, trainer {b.numel()}")
        ne = a != b
        n = int(ne.sum())
        if n and first is None:
            j = int(ne.nonzero()[0])
            first = (i, j, float(a[j]), float(b[j]))
        count += n
        diffs.append(a.double() - b.double())
    d = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    return {"logprob_abs_diff_max": float(d.abs().max()) if d.numel() else 0.0, "tokens_different": count,
            "kl": float(d.mean()) if d.numel() else 0.0, "num_tokens": int(d.numel()), "first": first}
