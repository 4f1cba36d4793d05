"""What every rollout engine returns, and the one log-prob convention they all report.

The convention itself (`token_logprobs`) lives in zmrl.model.logprobs, below both rollout and
trainer; it is re-exported here for the engines.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zmrl.model.logprobs import token_logprobs

__all__ = ["Sample", "derive_seed", "token_logprobs"]


@dataclass
class Sample:
    """One completion: token_ids [L] and their log-probs [L] (fp32)."""

    token_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: str | None = None


def derive_seed(seed: int, prompt: int, sample: int) -> int:
    """The seed of completion `sample` of prompt `prompt` (a fixed mix, no hash randomization)."""
    return (seed * 1_000_003 + prompt * 10_007 + sample) % (2**31 - 1)
