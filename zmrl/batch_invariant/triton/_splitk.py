"""Split-K for narrow GEMMs: fixed K ranges, partial sums added in one fixed order.

A shape with few output tiles (N = 576 or 1536 against K = 7168 on 132 SMs) leaves most SMs
idle; splitting K gives each tile several programs. Batch invariance survives because nothing
about the split depends on M or on the other rows:

- the number of splits is part of the shape's tile configuration, a function of (N, K, dtype)
  (matmul.config_for), never of M;
- split s reduces the K range [s * chunk, (s + 1) * chunk) in ascending BLOCK_K steps into its
  own fp32 accumulator, and chunk (k_chunk below) depends on K, the split count and the
  alignment only; every tile the ladder may pick for the shape divides the chunk, so a rung
  starts and ends each range at the same k as the fixed config;
- _splitk_sum adds the S fp32 partials of each output element in the order s = 0, 1, ..., S-1
  (no atomics: ((p0 + p1) + p2) + ... every time), rounds once to the output dtype and then
  adds the bias, exactly as the one-pass epilogue does.

Where the output tiles fill the SMs without splitting (large M), a ladder rung runs the same
K ranges one after another inside one program (MMConfig.split_inline): a fresh fp32 accumulator
per range, added in the order above, i.e. the same additions without the workspace.

So a row's bits depend on the row, the weight and (N, K, dtype) only. They differ from the
unsplit kernel's bits (a different, equally fixed, summation order): every host runs the same
kernel, so rollout and trainer still agree.
"""
from __future__ import annotations

import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import cdiv

SUM_BLOCK = 1024


def k_chunk(k: int, splits: int, align: int) -> int:
    """K range of one split: ceil(K / splits) rounded up to `align` (a multiple of every BLOCK_K
    that may run the shape), so the last split may be shorter and none is empty for splits <= K /
    align. A function of (K, splits, align) only."""
    return cdiv(cdiv(k, splits), align) * align


def effective_splits(k: int, splits: int, align: int) -> int:
    """How many K ranges actually hold data (a coarse alignment can leave trailing splits empty)."""
    return cdiv(k, k_chunk(k, splits, align))


@triton.jit(do_not_specialize=["total"])
def _splitk_sum(ws_ptr, out_ptr, bias_ptr, total, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    slab = total.to(tl.int64)
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):  # one fixed order: ((p0 + p1) + p2) + ...
        acc = acc + tl.load(ws_ptr + s * slab + offs, mask=mask, other=0.0)
    c = acc.to(out_ptr.dtype.element_ty)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs % N, mask=mask, other=0.0)
        c = (c.to(tl.float32) + bias.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, c, mask=mask)


def sum_partials(ws, out, bias, splits: int):
    """out [B, M, N] (contiguous) = the splits' fp32 partials ws [splits * B, M, N] added in
    order, rounded, plus bias. Returns the compiled kernel (None under the interpreter)."""
    total = out.numel()
    return _splitk_sum[(cdiv(total, SUM_BLOCK),)](
        ws, out, bias if bias is not None else out, total, out.shape[-1],
        SPLITS=splits, BLOCK=SUM_BLOCK, HAS_BIAS=bias is not None, num_warps=4,
    )
