"""Batches padded to a few bucketed shapes, so that one captured CUDA graph serves many of them.

A CUDA graph replays fixed shapes, while every PPO minibatch and every log-prob pass holds other
sequence lengths, and a batch's size may change too. Here a batch's sequences, their count rounded
up to a bucket B with padding sequences, are packed end to end into T rows (the tokens' count
rounded up to a bucket), the padding (token 0) spread over the sequences' tails, each sequence with
its padding at most L rows (the longest sequence, rounded up); the completion tokens' log-prob rows
become R rows (their count, rounded up), the rows past the last completion masked. The packing
itself (the sequences' offsets) changes from batch to batch: a graph reads it from device tensors
refilled in place.

Padding leaves every real token's log-prob unchanged, bit for bit: a sequence's padding comes after
its tokens (causal attention never reads it), and the batch-invariant kernels give a row the same
bits whatever else its launch holds and however wide they plan. The loss is a weighted sum over
the R rows, each real token weighed as its aggregation weighs it and padding by 0, so its rounding
(not its value) differs from the unpadded minibatch's mean.

    shape = packed_shape(prompt_lens, completion_lens, max_positions=4096)
    shape               PackedShape(seqs=16, tokens=8192, max_len=640, rows=3072)
    pad = pad_packed(prompts, completions, shape, "token_mean")
    pad.ids             [T] token ids, the sequences end to end, each followed by its padding
    pad.bounds          [B + 1] host offsets of the padded sequences
    pad.rows, pad.tokens, pad.mask, pad.weights     [R] each
    pad.spread(old_logprobs)                        per-sequence tensors -> [R], 0 on padding
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from zmrl.trainer.base import LOSS_AGGREGATIONS

SEQ_LEN_FLOOR = 64
"""L is at least this many rows: batches of short sequences share one shape (and one graph)."""


def bucket(n: int, floor: int = 1) -> int:
    """n (at least `floor`) rounded up to the next of p/2 + k p/8, k = 1..4, p the smallest power
    of two >= n: 4 buckets per doubling, so padding adds less than 25% and a run sees few shapes."""
    n = max(int(n), floor)
    if n <= 4:
        return n
    step = 1 << ((n - 1).bit_length() - 3)  # p / 8
    return -(-n // step) * step


@dataclass(frozen=True)
class PackedShape:
    """B sequences packed end to end and padded to T rows, each sequence (its padding included) at
    most L rows, and R log-prob rows: the sequences' lengths change from batch to batch, the shape
    does not. Padding is spread over the sequences' tails, so far less of it runs than if every
    sequence were padded to the longest."""

    seqs: int
    """B: the batch's sequences rounded up to a bucket; the sequences past the batch's own are
    padding, one token each at least (a batch whose size changes from step to step, as under
    dynamic sampling or in an uneven last minibatch, still meets few shapes)."""
    tokens: int
    """T: packed rows, the real tokens' count (and one per padding sequence) rounded up to a bucket,
    at most B * L."""
    max_len: int
    """L: the longest sequence rounded up to a bucket (at least SEQ_LEN_FLOOR, at most the model's
    positions), its padding included."""
    rows: int
    """R: log-prob rows, the completion tokens' count rounded up to a bucket."""


def packed_shape(prompt_lens: list[int], completion_lens: list[int], max_positions: int) -> PackedShape:
    """The bucketed shape of a batch with these lengths; a sequence longer than `max_positions` is
    refused (the model could not run it either)."""
    lengths = [p + c for p, c in zip(prompt_lens, completion_lens)]
    if max(lengths) > max_positions:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds max_position_embeddings={max_positions}")
    max_len = min(bucket(max(lengths), SEQ_LEN_FLOOR), max_positions)
    seqs = bucket(len(lengths))
    tokens = min(bucket(sum(lengths) + seqs - len(lengths)), seqs * max_len)
    return PackedShape(seqs, tokens, max_len, bucket(sum(completion_lens)))


@dataclass(frozen=True)
class PackedBatch:
    shape: PackedShape
    ids: torch.Tensor
    """[T] int64: the sequences end to end, each followed by its share of the padding (token 0)."""
    bounds: tuple[int, ...]
    """[B + 1] offsets of the padded sequences (each sequence's padding counts as its own), the
    padding sequences last."""
    rows: torch.Tensor
    """[R] int64: the packed row whose logits predict each log-prob row's token (padding: row 0)."""
    tokens: torch.Tensor
    """[R] int64: the token each row scores (0 on padding)."""
    mask: torch.Tensor
    """[R] bool: the real completion tokens (the first sum(completion_lens) rows)."""
    weights: torch.Tensor
    """[R] fp32: each token's weight in the loss aggregation (0 on padding; sums to 1)."""
    completion_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Real completion tokens."""
        return sum(self.completion_lens)

    def spread(self, per_sequence: list[torch.Tensor]) -> torch.Tensor:
        """One [L_i] tensor per sequence -> [R] fp32: the sequences' values in order, 0 on padding."""
        for i, (t, n) in enumerate(zip(per_sequence, self.completion_lens, strict=True)):
            if t.numel() != n:
                raise ValueError(f"sequence {i} of the batch: {t.numel()} values for {n} completion tokens")
        out = torch.zeros(self.shape.rows, dtype=torch.float32)
        out[:self.num_tokens] = torch.cat([t.reshape(-1).float() for t in per_sequence])
        return out

    def broadcast(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """[B] values, one per sequence -> [R] fp32: each over its sequence's tokens, 0 on padding."""
        out = torch.zeros(self.shape.rows, dtype=torch.float32)
        out[:self.num_tokens] = per_sequence.float().repeat_interleave(torch.tensor(self.completion_lens))
        return out


def pad_packed(prompts: list[list[int]], completions: list[list[int]], shape: PackedShape,
               loss_agg: str = "token_mean") -> PackedBatch:
    """The sequences packed end to end in `shape`, then the padding sequences. The padding follows
    each sequence's own tokens (its rows never attend to it), the first sequences filled up to L rows
    each, in order. loss_agg sets the weights: `token_mean` weighs every token of the batch the same,
    `seq_mean_token_mean` every sequence."""
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {loss_agg!r}")
    p_lens, c_lens = [len(p) for p in prompts], [len(c) for c in completions]
    if not prompts or min(p_lens) < 1 or min(c_lens) < 1:
        raise ValueError("every sequence of a batch needs a prompt and a completion token")
    lengths = [p + c for p, c in zip(p_lens, c_lens)]
    extra_seqs = shape.seqs - len(prompts)  # padding sequences, one token each at least
    if (extra_seqs < 0 or max(lengths) > shape.max_len or sum(lengths) + extra_seqs > shape.tokens
            or sum(c_lens) > shape.rows):
        raise ValueError(f"the batch does not fit {shape}")
    spare, padded = shape.tokens - sum(lengths) - extra_seqs, []
    for n in [*lengths, *[1] * extra_seqs]:
        extra = min(spare, shape.max_len - n)
        padded.append(n + extra)
        spare -= extra
    bounds = (0, *itertools.accumulate(padded))
    ids = torch.zeros(shape.tokens, dtype=torch.int64)
    rows = torch.zeros(shape.rows, dtype=torch.int64)
    tokens = torch.zeros(shape.rows, dtype=torch.int64)
    weights = torch.zeros(shape.rows, dtype=torch.float64)
    num_tokens, r = sum(c_lens), 0
    for start, prompt, completion in zip(bounds, prompts, completions):
        p, n = len(prompt), len(completion)
        ids[start:start + p] = torch.tensor(prompt, dtype=torch.int64)
        ids[start + p:start + p + n] = torch.tensor(completion, dtype=torch.int64)
        rows[r:r + n] = torch.arange(start + p - 1, start + p - 1 + n)
        tokens[r:r + n] = ids[start + p:start + p + n]
        weights[r:r + n] = 1.0 / num_tokens if loss_agg == "token_mean" else 1.0 / (n * len(prompts))
        r += n
    mask = torch.arange(shape.rows) < num_tokens
    return PackedBatch(shape, ids, bounds, rows, tokens, mask, weights.float(), tuple(c_lens))
