"""What every rollout engine returns, and the one log-prob convention they all report.

The convention itself (`token_logprobs`) lives in zmrl.model.logprobs, below both rollout and
trainer; it is re-exported here for the engines.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zmrl.model.logprobs import token_logprobs

__all__ = ["Sample", "check_sampling", "derive_seed", "token_logprobs"]


@dataclass
class Sample:
    """One completion: token_ids [L] and their log-probs [L] (fp32)."""

    token_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: str | None = None


def derive_seed(seed: int, prompt: int, sample: int) -> int:
    """The seed of completion `sample` of prompt `prompt` (a fixed mix, no hash randomization)."""
    return (seed * 1_000_003 + prompt * 10_007 + sample) % (2**31 - 1)


def check_sampling(n: int, max_tokens: int, temperature: float,
                   names: tuple[str, str, str] = ("n", "max_tokens", "temperature")) -> None:
    """The sampling arguments every engine (and `zmrl check`, under its flag names) accepts."""
    if n < 1:
        raise ValueError(f"{names[0]} must be >= 1, got {n}")
    if max_tokens < 1:
        raise ValueError(f"{names[1]} must be >= 1, got {max_tokens}")
    if not temperature >= 0 or temperature == float("inf"):  # nan fails every comparison
        raise ValueError(f"{names[2]} must be >= 0 and finite, got {temperature}")
