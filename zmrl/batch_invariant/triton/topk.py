"""Exact canonical top-k by radix select: one program per row, no atomics, no sort.

Order: value descending, then index ascending; -0.0 == +0.0; -inf entries are invalid.
Selection is arithmetic-free, so exactness alone makes it batch-invariant; determinism
comes from never letting arrival order decide anything:

1. Map each value to a 32-bit key that orders like the value (invalid -> key 0, below
   every valid key).
2. Find the k-th largest key v* digit by digit (4 passes of 8 bits), each pass a
   256-bin histogram of the rows still matching the prefix found so far.
3. One pass in ascending index order keeps every key > v* and the first
   `need = k - count(> v*)` keys == v*, writing each kept index at its rank among the
   kept ones (a prefix sum), so the output comes out ascending with -1 padding after.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import INTERPRET, check_runnable

BLOCK = 256 if INTERPRET else 2048


@triton.jit
def _keys(x_ptr, offs, N):
    x = tl.load(x_ptr + offs, mask=offs < N, other=float("-inf")).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) != 0
    key = tl.where(neg, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    # invalid: -inf, NaN (only reachable under graph capture, where the NaN check is skipped)
    # and the padding past N
    invalid = (x == float("-inf")) | (x != x)
    return tl.where(invalid, tl.zeros_like(key), key)


@triton.jit
def _next_digit(hist, remaining, above, bins):
    """The largest digit whose inclusive suffix count still reaches `remaining`."""
    suffix = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    d_star = tl.max(tl.where(suffix >= remaining, bins, -1), axis=0)
    return d_star.to(tl.uint32), above + tl.sum(tl.where(bins > d_star, hist, 0), axis=0)


@triton.jit
def _topk_kernel(x_ptr, out_ptr, N, K, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    o_row = out_ptr + row * stride_o
    cols = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)

    hist = tl.zeros((256,), dtype=tl.int32)
    for start in range(0, N, BLOCK):
        key = _keys(x_row, start + cols, N)
        hist += tl.histogram((key >> 24).to(tl.int32), 256, mask=key != 0)
    n_valid = tl.sum(hist, axis=0)

    # when every valid entry fits, v* = 1 (below every valid key) keeps them all
    prefix = tl.full((), 1, dtype=tl.uint32)
    need = tl.zeros((), dtype=tl.int32)
    if n_valid > K:
        above = tl.zeros((), dtype=tl.int32)
        prefix, above = _next_digit(hist, K - above, above, bins)
        for p in tl.static_range(1, 4):
            hist = tl.zeros((256,), dtype=tl.int32)
            for start in range(0, N, BLOCK):
                key = _keys(x_row, start + cols, N)
                match = (key != 0) & ((key >> (32 - 8 * p)) == prefix)
                hist += tl.histogram(((key >> (24 - 8 * p)) & 0xFF).to(tl.int32), 256, mask=match)
            digit, above = _next_digit(hist, K - above, above, bins)
            prefix = (prefix << 8) | digit
        need = K - above

    written = tl.zeros((), dtype=tl.int32)
    ties_seen = tl.zeros((), dtype=tl.int32)
    for start in range(0, N, BLOCK):
        offs = start + cols
        key = _keys(x_row, offs, N)
        tie = ((key == prefix) & (key != 0)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        keep = ((key > prefix) | ((tie != 0) & (tie_rank < need))) & (key != 0)
        keep_i = keep.to(tl.int32)
        slot = written + tl.cumsum(keep_i, axis=0) - keep_i
        tl.store(o_row + slot, offs.to(tl.int64), mask=keep)
        written += tl.sum(keep_i, axis=0)
        ties_seen += tl.sum(tie, axis=0)


def topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, N] float -> [R, k] int64: the canonical top-k, ascending, -1 padded."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"scores has dtype {scores.dtype}; supported: float32, bfloat16, float16")
    if scores.dim() != 2:
        raise ValueError(f"scores must be [R, N], got shape {tuple(scores.shape)}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    check_runnable("scores", scores)
    capturing = scores.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and torch.isnan(scores).any():
        raise ValueError("scores contain NaN; top-k has no order for NaN")
    return topk_launch(scores, k)


def topk_launch(scores: torch.Tensor, k: int, block: int = BLOCK, num_warps: int = 8) -> torch.Tensor:
    """The kernel alone (no NaN check, no host sync): NaN entries are treated as invalid.
    block/num_warps only change speed: selection is exact whatever the launch shape."""
    rows, n = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int64, device=scores.device)
    if rows == 0 or n == 0 or k == 0:
        return out
    x = scores if scores.stride(1) == 1 else scores.contiguous()
    _topk_kernel[(rows,)](x, out, n, k, x.stride(0), out.stride(0), BLOCK=block,
                          num_warps=1 if INTERPRET else num_warps)
    return out
