"""What every rollout engine returns, and the one log-prob convention they all report.

Convention: the log-prob of a sampled token is log_softmax(logits.float() / T)[token], in fp32,
by zmrl.batch_invariant.log_softmax, T the request's temperature (T = 1 when T = 0, greedy),
no top-k/top-p masking. The trainer side calls `token_logprobs` on its full-sequence logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zmrl.batch_invariant import log_softmax


@dataclass
class Sample:
    """One completion: token_ids [L] and their log-probs [L] (fp32)."""

    token_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: str | None = None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [L, V] (row i predicts tokens[i]), tokens [L] -> fp32 [L].

    The division is by an fp32 [L, 1] tensor, as vLLM's sampler does (logits.div_(temp[:, None]));
    true division is correctly rounded, so any broadcast of the same fp32 value gives the same bits."""
    t = temperature if temperature > 0 else 1.0
    scaled = logits.float() / torch.full((logits.shape[0], 1), t, dtype=torch.float32, device=logits.device)
    return log_softmax(scaled, -1).gather(-1, tokens.long().view(-1, 1)).view(-1)


def derive_seed(seed: int, prompt: int, sample: int) -> int:
    """The seed of completion `sample` of prompt `prompt` (a fixed mix, no hash randomization)."""
    return (seed * 1_000_003 + prompt * 10_007 + sample) % (2**31 - 1)
