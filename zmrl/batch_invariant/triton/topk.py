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

Rows up to SINGLE_MAX long run as one program. Longer rows (a decode step's indexer scores
over a 128K context) are cut into SEG-long segments, one program each, so a lone row does
not leave the GPU idle: per pass the segments' histograms are written out and one program
per row sums them (integer counts: any order gives the same sum) and picks the digit; the
output pass places each segment's picks after the counts of the segments before it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant._checks import fail_if
from zmrl.batch_invariant.triton._common import INTERPRET, cdiv, check_runnable, next_power_of_2
from zmrl.batch_invariant.triton._launch import keyed

BLOCK = 256 if INTERPRET else 4096
SINGLE_MAX = 512 if INTERPRET else 16384
SEG = 1024 if INTERPRET else 8192


@triton.jit
def order_keys(x):
    """fp32 -> uint32 keys in the canonical order (larger key, earlier in the order; -0.0 as
    +0.0); 0 for the invalid: -inf and NaN (NaN only reachable under graph capture, where the
    NaN check is skipped)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) != 0
    key = tl.where(neg, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    invalid = (x == float("-inf")) | (x != x)
    return tl.where(invalid, tl.zeros_like(key), key)


@triton.jit
def _keys(x_ptr, offs, N):
    """The keys of a row's entries at offs; the padding past N is invalid (-inf)."""
    return order_keys(tl.load(x_ptr + offs, mask=offs < N, other=float("-inf")).to(tl.float32))


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
    # the slots past the kept entries: -1 (the output is not pre-filled)
    for start in range(0, K, BLOCK):
        slots = start + cols
        tl.store(o_row + slots, tl.full((BLOCK,), -1, dtype=tl.int64), mask=(slots >= written) & (slots < K))


@triton.jit
def _seg_hist_kernel(x_ptr, hist_ptr, state_ptr, N, stride_x, num_segs,
                     PASS: tl.constexpr, SEG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    hist = tl.zeros((256,), dtype=tl.int32)
    done = tl.load(state_ptr + row * 4 + 3) != 0 if PASS > 0 else False
    if not done:
        prefix = tl.load(state_ptr + row * 4).to(tl.uint32)
        for start in range(0, SEG, BLOCK):
            key = _keys(x_row, seg * SEG + start + cols, N)
            if PASS == 0:
                hist += tl.histogram((key >> 24).to(tl.int32), 256, mask=key != 0)
            else:
                match = (key != 0) & ((key >> (32 - 8 * PASS)) == prefix)
                hist += tl.histogram(((key >> (24 - 8 * PASS)) & 0xFF).to(tl.int32), 256, mask=match)
    tl.store(hist_ptr + (row * num_segs + seg) * 256 + tl.arange(0, 256), hist)


@triton.jit
def _seg_select_kernel(hist_ptr, state_ptr, num_segs, K, PASS: tl.constexpr, SEGS: tl.constexpr):
    """state[row] = (prefix so far, count above it, need, all-valid-fit flag)."""
    row = tl.program_id(0).to(tl.int64)
    segs = tl.arange(0, SEGS)
    bins = tl.arange(0, 256)
    h = tl.load(hist_ptr + (row * num_segs + segs[:, None]) * 256 + bins[None, :],
                mask=segs[:, None] < num_segs, other=0)
    hist = tl.sum(h, axis=0)
    st = state_ptr + row * 4
    if PASS == 0:
        done = tl.sum(hist, axis=0) <= K
        prefix = tl.zeros((), dtype=tl.uint32)
        above = tl.zeros((), dtype=tl.int32)
        tl.store(st + 3, done.to(tl.int64))
        if done:  # every valid entry fits: v* = 1 keeps them all
            tl.store(st, 1)
            tl.store(st + 2, 0)
    else:
        done = tl.load(st + 3) != 0
        prefix = tl.load(st).to(tl.uint32)
        above = tl.load(st + 1).to(tl.int32)
    if not done:
        digit, above = _next_digit(hist, K - above, above, bins)
        tl.store(st, ((prefix << 8) | digit).to(tl.int64))
        tl.store(st + 1, above.to(tl.int64))
        tl.store(st + 2, (K - above).to(tl.int64))


@triton.jit
def _seg_count_kernel(x_ptr, count_ptr, state_ptr, N, stride_x, num_segs, SEG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    v_star = tl.load(state_ptr + row * 4).to(tl.uint32)
    above = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    for start in range(0, SEG, BLOCK):
        key = _keys(x_ptr + row * stride_x, seg * SEG + start + cols, N)
        above += tl.sum(((key > v_star) & (key != 0)).to(tl.int32), axis=0)
        ties += tl.sum(((key == v_star) & (key != 0)).to(tl.int32), axis=0)
    tl.store(count_ptr + (row * num_segs + seg) * 2, above)
    tl.store(count_ptr + (row * num_segs + seg) * 2 + 1, ties)


@triton.jit
def _seg_write_kernel(x_ptr, out_ptr, state_ptr, base_ptr, N, stride_x, stride_o, num_segs,
                      SEG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    v_star = tl.load(state_ptr + row * 4).to(tl.uint32)
    need = tl.load(state_ptr + row * 4 + 2).to(tl.int32)
    written = tl.load(base_ptr + (row * num_segs + seg) * 2).to(tl.int32)
    ties_seen = tl.load(base_ptr + (row * num_segs + seg) * 2 + 1).to(tl.int32)
    for start in range(0, SEG, BLOCK):
        offs = seg * SEG + start + cols
        key = _keys(x_ptr + row * stride_x, offs, N)
        tie = ((key == v_star) & (key != 0)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        keep = ((key > v_star) | ((tie != 0) & (tie_rank < need))) & (key != 0)
        keep_i = keep.to(tl.int32)
        slot = written + tl.cumsum(keep_i, axis=0) - keep_i
        tl.store(out_ptr + row * stride_o + slot, offs.to(tl.int64), mask=keep)
        written += tl.sum(keep_i, axis=0)
        ties_seen += tl.sum(tie, axis=0)


def _topk_segmented(x: torch.Tensor, out: torch.Tensor, k: int, num_warps: int) -> None:
    rows, n = x.shape
    segs = cdiv(n, SEG)
    dev = x.device
    state = torch.zeros(rows, 4, dtype=torch.int64, device=dev)
    hist = torch.empty(rows, segs, 256, dtype=torch.int32, device=dev)
    block = min(BLOCK, SEG)
    for p in range(4):
        _seg_hist_kernel[(rows, segs)](x, hist, state, n, x.stride(0), segs, PASS=p, SEG=SEG, BLOCK=block,
                                       num_warps=num_warps)
        _seg_select_kernel[(rows,)](hist, state, segs, k, PASS=p, SEGS=next_power_of_2(segs),
                                    num_warps=4 if not INTERPRET else 1)
    counts = torch.empty(rows, segs, 2, dtype=torch.int32, device=dev)
    _seg_count_kernel[(rows, segs)](x, counts, state, n, x.stride(0), segs, SEG=SEG, BLOCK=block,
                                    num_warps=num_warps)
    # how many each earlier segment keeps: all its keys above v*, and its ties while need lasts
    above, ties = counts[..., 0].long(), counts[..., 1].long()
    ties_before = torch.cumsum(ties, 1) - ties
    kept = above + torch.minimum((state[:, 2:3] - ties_before).clamp(min=0), ties)
    base = torch.stack([torch.cumsum(kept, 1) - kept, ties_before], -1).contiguous()
    _seg_write_kernel[(rows, segs)](x, out, state, base, n, x.stride(0), out.stride(0), segs,
                                    SEG=SEG, BLOCK=block, num_warps=num_warps)


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
    if scores.numel():  # deferred on a GPU (no host sync); the kernel treats NaN entries as invalid
        fail_if(torch.isnan(scores).any(), "scores contain NaN; top-k has no order for NaN")
    return topk_launch(scores, k)


def topk_launch(scores: torch.Tensor, k: int, block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """The kernel alone (no NaN check, no host sync): NaN entries are treated as invalid.

    The launch shape may follow the row count: selection does no arithmetic, so every launch
    shape returns the same exact answer (unlike the GEMMs, whose tiles must not follow M).
    Few rows get wide programs (latency), many rows narrow ones (occupancy)."""
    check_runnable("scores", scores)
    rows, n = scores.shape
    if rows == 0 or n == 0 or k == 0:
        return torch.full((rows, k), -1, dtype=torch.int64, device=scores.device)
    x = scores if scores.stride(1) == 1 else scores.contiguous()
    if n > SINGLE_MAX:  # the segmented kernels write the kept slots only: -1 everywhere first
        out = torch.full((rows, k), -1, dtype=torch.int64, device=scores.device)
        _topk_segmented(x, out, k, 1 if INTERPRET else 8)
        return out
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)  # the kernel writes every slot
    if block is None:
        # many rows: a block about the row's width (a router's 64 experts, an indexer's few hundred
        # keys), not a fixed 2,048 lanes mostly masked off
        block = BLOCK if rows < 256 or INTERPRET else max(256, min(2048, next_power_of_2(n)))
    if num_warps is None:
        num_warps = 16 if rows < 256 else max(2, min(8, block // 128))
    keyed(_topk_kernel, "topk", num_warps=1 if INTERPRET else num_warps)(
        (rows,), (x, out, n, k, x.stride(0), out.stride(0)), dict(BLOCK=block))
    return out
