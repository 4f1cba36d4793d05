"""What every GEMM schedule does to one output tile: where it lies, how one K range is reduced,
how a tile's K ranges are added, and how the tile is stored (Triton device functions).

The schedules (_gemm_kernel.py's one-tile-per-program loop, _gemm_stream.py's K ranges dealt
out across programs) differ only in which program runs these, never in what they compute.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_at(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of tile t of one batch entry, in grouped order: GROUP_M row-tiles
    share each weight column-tile while it is in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_rows
    pid_n = (t % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def k_range(a_desc, b_desc, row_a, b_row0, off_n, k_start, k_tiles, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, B_KMAJOR: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One K range: ascending BLOCK_K steps from k_start into a fresh fp32 accumulator."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(k_tiles):
        k_off = k_start + ki * BK
        a = a_desc.load([row_a, k_off])
        if B_KMAJOR:
            b = b_desc.load([b_row0 + off_n, k_off]).T
        else:
            b = b_desc.load([b_row0 + k_off, off_n])
        if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns as integers
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def range_tiles(K, k_chunk, s, BK: tl.constexpr):
    """BLOCK_K steps in K range s (the last range may be shorter)."""
    return tl.cdiv(tl.minimum(K - s * k_chunk, k_chunk), BK)


@triton.jit
def ranges_onto(total, a_desc, b_desc, row_a, b_row0, off_n, K, k_chunk, first, last, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, B_KMAJOR: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
    """total + p_first + ... + p_last, added left to right (the split's fixed order)."""
    for s in range(first, last + 1):
        total = total + k_range(a_desc, b_desc, row_a, b_row0, off_n, s * k_chunk, range_tiles(K, k_chunk, s, BK),
                                BM, BN, BK, B_KMAJOR, PRECISION, UPCAST)
    return total


@triton.jit
def whole_tile(a_desc, b_desc, row_a, b_row0, off_n, K, k_chunk, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, B_KMAJOR: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
               SPLIT_K: tl.constexpr):
    """Every K range of a tile, each from a fresh accumulator, added in order: ((p0 + p1) + p2) + ...
    (one range, the whole of K, for an unsplit shape)."""
    acc = k_range(a_desc, b_desc, row_a, b_row0, off_n, 0, range_tiles(K, k_chunk, 0, BK), BM, BN, BK, B_KMAJOR,
                  PRECISION, UPCAST)
    for s in tl.static_range(1, SPLIT_K):
        acc = acc + k_range(a_desc, b_desc, row_a, b_row0, off_n, s * k_chunk, range_tiles(K, k_chunk, s, BK),
                            BM, BN, BK, B_KMAJOR, PRECISION, UPCAST)
    return acc


@triton.jit
def store_tile(acc, c_desc, c_ptr, bias_ptr, slab, pid_m, pid_n, M, N, stride_cb, stride_cm, BM: tl.constexpr,
               BN: tl.constexpr, HAS_BIAS: tl.constexpr, TMA_STORE: tl.constexpr):
    """Round the fp32 tile to the output dtype, add the bias, store rows < M and columns < N of
    output slab `slab` (a batch entry, or a split's partial)."""
    off_n = pid_n * BN
    offs_n = off_n + tl.arange(0, BN)
    c = acc.to(c_ptr.dtype.element_ty)
    if HAS_BIAS:
        # as torch's `gemm_out + bias`: the GEMM result is rounded first, then one add
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        c = (c.to(tl.float32) + bias.to(tl.float32)).to(c_ptr.dtype.element_ty)
    if TMA_STORE:
        # [B, M, N] descriptor: the copy engine clips rows past this batch entry's M
        # and columns past N, and a [BM, BN] tile of 64-bit pointers never exists
        c_desc.store([slab, pid_m * BM, off_n], c.reshape(1, BM, BN))
    else:
        offs_m = pid_m * BM + tl.arange(0, BM)
        ptrs = c_ptr + slab * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
