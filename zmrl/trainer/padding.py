"""Minibatches padded to a few bucketed shapes, so that one captured CUDA graph serves many of them.

A CUDA graph replays fixed shapes and a fixed packing, while every PPO minibatch packs other
sequence lengths. Here a minibatch of n sequences becomes S slots of L tokens each (S, L: n and the
longest sequence rounded up to a bucket), every sequence at the start of its slot, the rest of the
slot filled with token 0; its log-prob rows become C rows per slot (C: the longest completion,
rounded up), the rows past a completion's end masked.

Padding leaves every real token's log-prob unchanged, bit for bit: a slot's padding comes after
its sequence (causal attention never reads it), and the batch-invariant kernels give a row the
same bits whatever else its launch holds. The loss is a weighted sum over the slot layout, each
real token weighed as its aggregation weighs it and padding by 0, so its rounding (not its value)
differs from the unpadded minibatch's mean.

    pad = pad_minibatch(prompts, completions, "token_mean", max_positions=4096)
    pad.shape           SlotShape(slots=16, seq_len=640, completion_len=256)
    pad.ids             [S * L] token ids, slot after slot
    pad.rows, pad.tokens, pad.mask, pad.weights     [S * C] each
    pad.spread(old_logprobs)                        per-sequence tensors -> [S * C], 0 on padding
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from zmrl.trainer.base import LOSS_AGGREGATIONS

SEQ_LEN_FLOOR = 64
"""Slots hold at least this many tokens: shorter minibatches share one shape (and one graph)."""


def bucket(n: int, floor: int = 1) -> int:
    """n (at least `floor`) rounded up to the next of p/2 + k p/8, k = 1..4, p the smallest power
    of two >= n: 4 buckets per doubling, so padding adds less than 25% and a run sees few shapes."""
    n = max(int(n), floor)
    if n <= 4:
        return n
    step = 1 << ((n - 1).bit_length() - 3)  # p / 8
    return -(-n // step) * step


@dataclass(frozen=True)
class SlotShape:
    slots: int
    """S: sequences of the minibatch, padded with empty slots."""
    seq_len: int
    """L: tokens per slot."""
    completion_len: int
    """C: log-prob rows per slot."""

    @property
    def tokens(self) -> int:
        """S * L: the tokens a minibatch of this shape runs through the model, padding included."""
        return self.slots * self.seq_len


def slot_shape(prompt_lens: list[int], completion_lens: list[int], max_positions: int) -> SlotShape:
    """The bucketed shape of a minibatch with these lengths; a slot never exceeds `max_positions`
    tokens (a longer sequence is refused: the model could not run it either)."""
    longest = max(p + c for p, c in zip(prompt_lens, completion_lens))
    if longest > max_positions:
        raise ValueError(f"a sequence of {longest} tokens exceeds max_position_embeddings={max_positions}")
    seq_len = min(bucket(longest, SEQ_LEN_FLOOR), max_positions)
    completion_len = min(bucket(max(completion_lens)), seq_len - 1)
    return SlotShape(bucket(len(prompt_lens)), seq_len, completion_len)


@dataclass(frozen=True)
class PaddedMinibatch:
    shape: SlotShape
    ids: torch.Tensor
    """[S * L] int64: each sequence at the start of its slot, then token 0."""
    rows: torch.Tensor
    """[S * C] int64: the packed row whose logits predict each log-prob row's token (a padding row
    reads its slot's first row)."""
    tokens: torch.Tensor
    """[S * C] int64: the token each row scores (0 on padding)."""
    mask: torch.Tensor
    """[S * C] bool: the real completion tokens."""
    weights: torch.Tensor
    """[S * C] fp32: each token's weight in the loss aggregation (0 on padding; sums to 1)."""
    num_tokens: int
    """Real completion tokens."""
    completion_lens: tuple[int, ...]

    def spread(self, per_sequence: list[torch.Tensor]) -> torch.Tensor:
        """One [L_i] tensor per sequence -> [S * C] fp32, each at the start of its slot's rows, 0 elsewhere."""
        c = self.shape.completion_len
        out = torch.zeros(self.shape.slots, c, dtype=torch.float32)
        for i, (t, n) in enumerate(zip(per_sequence, self.completion_lens, strict=True)):
            if t.numel() != n:
                raise ValueError(f"sequence {i} of the minibatch: {t.numel()} values for {n} completion tokens")
            out[i, :n] = t.reshape(-1).float()
        return out.view(-1)

    def broadcast(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """[n] values, one per sequence -> [S * C] fp32: each over its sequence's tokens, 0 elsewhere."""
        out = torch.zeros(self.shape.slots, self.shape.completion_len, dtype=torch.float32)
        for i, n in enumerate(self.completion_lens):
            out[i, :n] = per_sequence[i].float()
        return out.view(-1)


def pad_minibatch(prompts: list[list[int]], completions: list[list[int]], loss_agg: str,
                  max_positions: int, shape: SlotShape | None = None) -> PaddedMinibatch:
    """A minibatch's sequences in the slots of `shape` (default: its bucketed `slot_shape`)."""
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {loss_agg!r}")
    p_lens, c_lens = [len(p) for p in prompts], [len(c) for c in completions]
    if not prompts or min(p_lens) < 1 or min(c_lens) < 1:
        raise ValueError("every sequence of a minibatch needs a prompt and a completion token")
    shape = shape or slot_shape(p_lens, c_lens, max_positions)
    s, seq_len, c = shape.slots, shape.seq_len, shape.completion_len
    if len(prompts) > s or max(p + n for p, n in zip(p_lens, c_lens)) > seq_len or max(c_lens) > c:
        raise ValueError(f"the minibatch does not fit {shape}")
    ids = torch.zeros(s, seq_len, dtype=torch.int64)
    rows = torch.arange(s, dtype=torch.int64).mul_(seq_len).view(s, 1).repeat(1, c)
    tokens = torch.zeros(s, c, dtype=torch.int64)
    mask = torch.zeros(s, c, dtype=torch.bool)
    weights = torch.zeros(s, c, dtype=torch.float64)
    num_tokens = sum(c_lens)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        p, n = len(prompt), len(completion)
        ids[i, :p] = torch.tensor(prompt, dtype=torch.int64)
        ids[i, p:p + n] = torch.tensor(completion, dtype=torch.int64)
        rows[i, :n] = torch.arange(i * seq_len + p - 1, i * seq_len + p - 1 + n)
        tokens[i, :n] = ids[i, p:p + n]
        mask[i, :n] = True
        # token_mean: every token of the minibatch weighs the same; seq_mean_token_mean: every sequence
        weights[i, :n] = 1.0 / num_tokens if loss_agg == "token_mean" else 1.0 / (n * len(prompts))
    return PaddedMinibatch(shape, ids.view(-1), rows.view(-1), tokens.view(-1), mask.view(-1),
                           weights.float().view(-1), num_tokens, tuple(c_lens))


# ----------------------------------------------------------------------------- packed end to end
@dataclass(frozen=True)
class PackedShape:
    """A forward-only pass of B sequences packed end to end and padded to T rows, each sequence (its
    padding included) at most L rows: the sequences' lengths change from pass to pass, the shape
    does not. Padding is spread over the sequences' tails, so far less of it runs than in slots
    (where every sequence is padded to the longest)."""

    seqs: int
    """B: the batch's sequences, exactly (a run's passes score batches of one size)."""
    tokens: int
    """T: packed rows, the real tokens' count rounded up to a bucket (at most B * L)."""
    max_len: int
    """L: the longest sequence rounded up to a bucket, its padding included."""
    rows: int
    """R: log-prob rows, the completion tokens' count rounded up to a bucket."""


def packed_shape(prompt_lens: list[int], completion_lens: list[int], max_positions: int) -> PackedShape:
    lengths = [p + c for p, c in zip(prompt_lens, completion_lens)]
    if max(lengths) > max_positions:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds max_position_embeddings={max_positions}")
    max_len = min(bucket(max(lengths), SEQ_LEN_FLOOR), max_positions)
    tokens = min(bucket(sum(lengths)), len(lengths) * max_len)
    return PackedShape(len(lengths), tokens, max_len, bucket(sum(completion_lens)))


@dataclass(frozen=True)
class PaddedPass:
    shape: PackedShape
    ids: torch.Tensor
    """[T] int64: the sequences end to end, each followed by its share of the padding (token 0)."""
    bounds: tuple[int, ...]
    """[B + 1] offsets of the padded sequences (each sequence's padding counts as its own)."""
    rows: torch.Tensor
    """[R] int64: the packed row whose logits predict each log-prob row's token (padding: row 0)."""
    tokens: torch.Tensor
    """[R] int64: the token each row scores (0 on padding)."""
    completion_lens: tuple[int, ...]


def pad_packed(prompts: list[list[int]], completions: list[list[int]], shape: PackedShape) -> PaddedPass:
    """The sequences packed end to end in `shape`, the padding after each sequence's own tokens (its
    rows never attend to it): the first sequences filled up to L rows each, in order."""
    p_lens, c_lens = [len(p) for p in prompts], [len(c) for c in completions]
    if not prompts or min(p_lens) < 1 or min(c_lens) < 1:
        raise ValueError("every sequence of a pass needs a prompt and a completion token")
    lengths = [p + c for p, c in zip(p_lens, c_lens)]
    if (len(prompts) != shape.seqs or max(lengths) > shape.max_len or sum(lengths) > shape.tokens
            or sum(c_lens) > shape.rows):
        raise ValueError(f"the pass does not fit {shape}")
    spare, padded = shape.tokens - sum(lengths), []
    for n in lengths:
        extra = min(spare, shape.max_len - n)
        padded.append(n + extra)
        spare -= extra
    bounds = (0, *itertools.accumulate(padded))
    ids = torch.zeros(shape.tokens, dtype=torch.int64)
    rows = torch.zeros(shape.rows, dtype=torch.int64)
    tokens = torch.zeros(shape.rows, dtype=torch.int64)
    r = 0
    for start, prompt, completion in zip(bounds, prompts, completions):
        p, n = len(prompt), len(completion)
        ids[start:start + p] = torch.tensor(prompt, dtype=torch.int64)
        ids[start + p:start + p + n] = torch.tensor(completion, dtype=torch.int64)
        rows[r:r + n] = torch.arange(start + p - 1, start + p - 1 + n)
        tokens[r:r + n] = ids[start + p:start + p + n]
        r += n
    return PaddedPass(shape, ids, bounds, rows, tokens, tuple(c_lens))
