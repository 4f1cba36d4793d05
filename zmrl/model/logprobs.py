"""The one log-prob convention every engine reports and every trainer recomputes.

The log-prob of a sampled token is log_softmax(logits.float() / T)[token], in fp32, by
zmrl.batch_invariant.log_softmax, T the request's temperature (T = 1 when T = 0, greedy), no
top-k/top-p masking. It lives here, below both zmrl.rollout and zmrl.trainer, so that neither
imports the other; zmrl.rollout.sample.token_logprobs is the same computation.
"""
from __future__ import annotations

import array

import torch

from zmrl.batch_invariant import log_softmax


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [L, V] (row i predicts tokens[i]), tokens [L] -> fp32 [L].

    The division is by an fp32 [L, 1] tensor, as vLLM's sampler does (logits.div_(temp[:, None]));
    true division is correctly rounded, so any broadcast of the same fp32 value gives the same bits.
    bf16 logits are promoted to fp32 inside the division (exactly, on load): no fp32 copy first."""
    t = temperature if temperature > 0 else 1.0
    scaled = logits / torch.full((logits.shape[0], 1), t, dtype=torch.float32, device=logits.device)
    return log_softmax(scaled, -1).gather(-1, tokens.long().view(-1, 1)).view(-1)


def pack_sequences(prompts, completions) -> list[torch.Tensor]:
    """(prompt, completion) token-id lists -> one [len(p) + len(c)] int64 tensor per pair."""
    seqs = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if not p or not c:
            raise ValueError(f"sequence {i}: empty prompt or completion")
        # an int64 array converts each id in C, half the time of torch.tensor(list) (~15k ids a
        # trainer batch, every log-prob pass), and refuses floats and strings instead of truncating
        try:
            ids = array.array("q", p)
            ids.extend(c)
        except (TypeError, OverflowError) as e:
            raise ValueError(f"sequence {i}: token ids must be integers in the int64 range ({e})") from None
        seqs.append(torch.frombuffer(ids, dtype=torch.int64))
    return seqs


def completion_logprobs(logits, prompts, seqs, temperature: float) -> list[torch.Tensor]:
    """Per sequence: logits [L, V] of prompt + completion -> the completion tokens' log-probs.
    Row len(p) - 1 + j predicts completion token j (the rollout's convention)."""
    return [token_logprobs(lg[len(p) - 1:len(seq) - 1], seq[len(p):].to(lg.device), temperature)
            for lg, p, seq in zip(logits, prompts, seqs)]
