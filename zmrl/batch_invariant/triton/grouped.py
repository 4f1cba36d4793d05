"""Grouped GEMMs over experts for the MoE's forward and backward, LoRA terms included.

Rows are grouped by expert (`Groups` in moe.py: expert ascending, tokens ascending within an
expert); every row tile of every expert is one program, and the expert's weights are read through
a 3-D TMA descriptor over [E, rows, cols] (a tile never reads another expert's weights, and the
gate/up halves of a stacked [E, 2I, D] weight are views, never copies). Three kernels:

  rows_forward   c[rows] = a[rows] @ W[e]^T (W [E, N, K], K-major), optionally gated
                 (silu(g) * u, g and u from two weights) and with a LoRA delta joined in the
                 epilogue: out = round(round(a W^T) + round(delta * scale)), exactly the
                 composed path's `linear(x, W) + linear(linear(x, A), B) * scale`.
  rows_backward  c[rows] = (a1[rows] @ W1[e] + a2[rows] @ W2[e]) * alpha (W [E, K, N], N-major),
                 one fp32 accumulator over both K phases; optionally the gated epilogue's
                 backward (dh -> dg, du from the saved g, u).
  expert_wgrad   out[e] = alpha * P_e^T Q_e, the sum over expert e's rows in ascending row order
                 in BLOCK_R steps (one program per expert and output tile: no atomics, no split).

A row's result never depends on the other rows of the batch: the tile configuration comes from
(N, K, dtype) and the schedule's BLOCK_M only, and the K loop runs in ascending order into one
fp32 accumulator (the invariant matmul's arithmetic, matmul.py). Every launch runs without FMA
contraction so products and sums round as torch's separate elementwise kernels do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import INTERPRET, aligned_cols, cdiv, make_desc, next_power_of_2
from zmrl.batch_invariant.triton._launch import keyed
from zmrl.batch_invariant.triton.elementwise import NO_FP_FUSION, round_as_torch, sigmoid_f32
from zmrl.batch_invariant.triton.matmul import _prep_a, config_for


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns as integers
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _join_delta(acc, d_ptr, stride_d, offs_m, offs_n, ok, scale, out_ty: tl.constexpr, HAS_DELTA: tl.constexpr,
                EMULATE: tl.constexpr):
    """The GEMM output rounded (as the GEMM kernel rounds it), plus the LoRA delta rounded after
    its scale, as torch's `y + d * scale` rounds each step."""
    y = acc.to(out_ty)
    if HAS_DELTA:
        d = tl.load(d_ptr + offs_m[:, None].to(tl.int64) * stride_d + offs_n[None, :], mask=ok, other=0.0)
        d = round_as_torch(d.to(tl.float32) * scale, out_ty, EMULATE)
        y = round_as_torch(y.to(tl.float32) + d.to(tl.float32), out_ty, EMULATE)
    return y


@triton.jit
def _program_tile(tile_expert, tile_row, expert_end, num_experts, N, BM: tl.constexpr, BN: tl.constexpr,
                  ORDER: tl.constexpr):
    """(schedule tile, column tile, the tile's expert) of this program, in the launch's program order
    (the ORDER constants below). Which program computes a tile never changes how it is computed."""
    if ORDER == 0:  # COLUMN_TILE_MAJOR: the column tile is the grid's second axis
        tile = tl.program_id(0)
        col = tl.program_id(1)
    else:  # a 1-D grid: a row tile's column tiles are consecutive programs
        n_cols = tl.cdiv(N, BN)
        tile = tl.program_id(0) // n_cols
        col = tl.program_id(0) % n_cols
    e = tl.load(tile_expert + tile)
    if ORDER == 2:  # EXPERT_MAJOR: the same programs, reordered within each expert's block
        # expert e's n_e tiles own programs [first * n_cols, (first + n_e) * n_cols), so the tile
        # found above lies in that expert; within the block, column-tile-major (e stays the tile's)
        if e < num_experts:
            start = tl.where(e > 0, tl.load(expert_end + tl.maximum(e - 1, 0)), 0)
            first = tile - (tl.load(tile_row + tile) - start) // BM
            n_e = tl.cdiv(tl.load(expert_end + e) - start, BM)
            local = tl.program_id(0) - first * n_cols
            tile = first + local % n_e
            col = local // n_e
    return tile, col, e


@triton.jit
def _rows_forward_kernel(a_desc, w_desc, w2_desc, c_ptr, d_ptr, d2_ptr, gu_ptr, tile_expert, tile_row, expert_end,
                         N, K, num_experts, stride_c, stride_d, stride_gu, scale,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr,
                         HAS_DELTA: tl.constexpr, STORE_GU: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                         ORDER: tl.constexpr):
    pid, pid_n, e = _program_tile(tile_expert, tile_row, expert_end, num_experts, N, BM, BN, ORDER)
    if e < num_experts:
        row0 = tl.load(tile_row + pid)
        row_end = tl.load(expert_end + e)
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            a = a_desc.load([row0, ki * BK])
            b = w_desc.load([e, off_n, ki * BK]).reshape(BN, BK).T
            acc = _dot(a, b, acc, IEEE, UPCAST)
            if GATED:
                b2 = w2_desc.load([e, off_n, ki * BK]).reshape(BN, BK).T
                acc2 = _dot(a, b2, acc2, IEEE, UPCAST)
        offs_m = row0 + tl.arange(0, BM)
        if GATED:  # the epilogue in column quarters, as silu's backward's (_column_quarters)
            gs = _column_quarters(acc, BM, BN)
            us = _column_quarters(acc2, BM, BN)
            for i in tl.static_range(4):
                q = off_n + i * (BN // 4) + tl.arange(0, BN // 4)
                _forward_store(gs[i], us[i], c_ptr, d_ptr, d2_ptr, gu_ptr, stride_c, stride_d, stride_gu, offs_m, q,
                               row_end, N, scale, GATED, HAS_DELTA, STORE_GU, UPCAST)
        else:
            _forward_store(acc, acc, c_ptr, d_ptr, d2_ptr, gu_ptr, stride_c, stride_d, stride_gu, offs_m,
                           off_n + tl.arange(0, BN), row_end, N, scale, GATED, HAS_DELTA, STORE_GU, UPCAST)


@triton.jit
def _forward_store(acc, acc2, c_ptr, d_ptr, d2_ptr, gu_ptr, stride_c, stride_d, stride_gu, offs_m, offs_n, row_end,
                   N, scale, GATED: tl.constexpr, HAS_DELTA: tl.constexpr, STORE_GU: tl.constexpr,
                   UPCAST: tl.constexpr):
    """rows_forward's output for these columns from the fp32 accumulator(s): the deltas joined,
    then (GATED) g and u kept if asked and silu(g) * u."""
    out_ty = c_ptr.dtype.element_ty
    ok = (offs_m[:, None] < row_end) & (offs_n[None, :] < N)
    y = _join_delta(acc, d_ptr, stride_d, offs_m, offs_n, ok, scale, out_ty, HAS_DELTA, UPCAST)
    if GATED:
        u = _join_delta(acc2, d2_ptr, stride_d, offs_m, offs_n, ok, scale, out_ty, HAS_DELTA, UPCAST)
        if STORE_GU:  # the backward's g and u ([rows, 2N]: gate columns, then up columns)
            gp = gu_ptr + offs_m[:, None].to(tl.int64) * stride_gu + offs_n[None, :]
            tl.store(gp, y, mask=ok)
            tl.store(gp + N, u, mask=ok)
        g = y.to(tl.float32)
        # zmrl.batch_invariant.silu(g) * u.float(), with the Triton path's one sigmoid
        y = round_as_torch(g * sigmoid_f32(g) * u.to(tl.float32), out_ty, UPCAST)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_c + offs_n[None, :], y, mask=ok)


@triton.jit
def _column_halves(t, BM: tl.constexpr, BN: tl.constexpr):
    """A [BM, BN] tile as its left and right [BM, BN / 2] column blocks."""
    return tl.split(tl.permute(tl.reshape(t, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _column_quarters(t, BM: tl.constexpr, BN: tl.constexpr):
    """A [BM, BN] tile as four [BM, BN / 4] column blocks, left to right. An epilogue run per block
    keeps a quarter of its loaded operands and temporaries live: silu's backward over a whole
    128 x 128 tile (dh, g, u, sigmoid(g) at once) spilled 1,938 bytes at 8 warps, per quarter none
    (ptxas, sm_90). Elementwise work per element is unchanged, so are the bits."""
    left, right = _column_halves(t, BM, BN)
    a, b = _column_halves(left, BM, BN // 2)
    c, d = _column_halves(right, BM, BN // 2)
    return a, b, c, d


@triton.jit
def _silu_backward_store(dh, gu_ptr, c_ptr, rows64, offs_n, offs_m, row_end, N, stride_gu, stride_c,
                         out_ty: tl.constexpr):
    """h = silu(g) * u: dg = dh u s (1 + g (1 - s)), du = dh g s for these columns, stored as
    [rows, 2N] (dg columns, then du), from the forward's g and u ([rows, 2N] the same way)."""
    ok = (offs_m[:, None] < row_end) & (offs_n[None, :] < N)
    gp = gu_ptr + rows64 * stride_gu + offs_n[None, :]
    g = tl.load(gp, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gp + N, mask=ok, other=0.0).to(tl.float32)
    s = sigmoid_f32(g)
    cp = c_ptr + rows64 * stride_c + offs_n[None, :]
    tl.store(cp, (dh * u * s * (1.0 + g * (1.0 - s))).to(out_ty), mask=ok)
    tl.store(cp + N, (dh * g * s).to(out_ty), mask=ok)


@triton.jit
def _rows_backward_kernel(a_desc, w_desc, a2_desc, w2_desc, c_ptr, gu_ptr, tile_expert, tile_row, expert_end,
                          N, K, K2, num_experts, stride_c, stride_gu, alpha,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BK2: tl.constexpr,
                          TWO: tl.constexpr, SILU_BWD: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                          ORDER: tl.constexpr):
    pid, pid_n, e = _program_tile(tile_expert, tile_row, expert_end, num_experts, N, BM, BN, ORDER)
    if e < num_experts:
        row0 = tl.load(tile_row + pid)
        row_end = tl.load(expert_end + e)
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            a = a_desc.load([row0, ki * BK])
            b = w_desc.load([e, ki * BK, off_n]).reshape(BK, BN)
            acc = _dot(a, b, acc, IEEE, UPCAST)
        if TWO:  # the second K phase continues the same accumulator
            for ki in range(tl.cdiv(K2, BK2)):
                a = a2_desc.load([row0, ki * BK2])
                b = w2_desc.load([e, ki * BK2, off_n]).reshape(BK2, BN)
                acc = _dot(a, b, acc, IEEE, UPCAST)
        acc = acc * alpha
        offs_m = row0 + tl.arange(0, BM)
        rows64 = offs_m[:, None].to(tl.int64)
        out_ty = c_ptr.dtype.element_ty
        if SILU_BWD:
            dhs = _column_quarters(acc, BM, BN)  # acc = dh, the epilogue per quarter
            for i in tl.static_range(4):
                q = off_n + i * (BN // 4) + tl.arange(0, BN // 4)
                _silu_backward_store(dhs[i], gu_ptr, c_ptr, rows64, q, offs_m, row_end, N, stride_gu, stride_c, out_ty)
        else:
            offs_n = off_n + tl.arange(0, BN)
            ok = (offs_m[:, None] < row_end) & (offs_n[None, :] < N)
            tl.store(c_ptr + rows64 * stride_c + offs_n[None, :], acc.to(out_ty), mask=ok)


@triton.jit
def _expert_wgrad_kernel(p_ptr, q_ptr, out_ptr, expert_end, counts, N1, N2, stride_p, stride_q, alpha,
                         B1: tl.constexpr, B2: tl.constexpr, BR: tl.constexpr, IEEE: tl.constexpr,
                         UPCAST: tl.constexpr):
    e = tl.program_id(0)
    tiles2 = tl.cdiv(N2, B2)
    off1 = (tl.program_id(1) // tiles2) * B1
    off2 = (tl.program_id(1) % tiles2) * B2
    end = tl.load(expert_end + e).to(tl.int32)
    start = end - tl.load(counts + e).to(tl.int32)
    o1 = off1 + tl.arange(0, B1)
    o2 = off2 + tl.arange(0, B2)
    acc = tl.zeros((B1, B2), dtype=tl.float32)
    for r0 in range(start, end, BR):  # the expert's rows, ascending
        rows = r0 + tl.arange(0, BR)
        live = rows < end
        rows64 = rows.to(tl.int64)
        p = tl.load(p_ptr + rows64[:, None] * stride_p + o1[None, :], mask=live[:, None] & (o1[None, :] < N1),
                    other=0.0)
        q = tl.load(q_ptr + rows64[:, None] * stride_q + o2[None, :], mask=live[:, None] & (o2[None, :] < N2),
                    other=0.0)
        acc = _dot(tl.trans(p), q, acc, IEEE, UPCAST)
    acc = acc * alpha
    ptrs = out_ptr + e.to(tl.int64) * N1 * N2 + o1[:, None].to(tl.int64) * N2 + o2[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(o1[:, None] < N1) & (o2[None, :] < N2))


def _weight3(w: torch.Tensor) -> torch.Tensor:
    """A [E, R, C] weight (or a view of one) a 3-D TMA descriptor can address; a copy only when the
    column pitch is not 16-byte aligned (zero columns read as TMA's own out-of-bounds zeros)."""
    es = w.element_size()
    if w.stride(2) == 1 and (w.stride(1) * es) % 16 == 0 and (w.stride(0) * es) % 16 == 0 and w.data_ptr() % 16 == 0:
        return w
    out = w.new_zeros(w.shape[0], w.shape[1], aligned_cols(w.shape[2], es))
    out[..., : w.shape[2]] = w
    return out


def _block_n(n: int, base_n: int) -> int:
    # the store is a pointer tile (rows end at the expert's last row, which TMA cannot clip), so
    # BLOCK_N <= 128; a narrow N (a LoRA rank) takes the smallest tile that covers it
    return max(16, min(base_n, 128, next_power_of_2(max(n, 1))))


def _warps_stages(base, bm: int, bn: int, live_tiles: int) -> tuple[int, int]:
    """Warps and pipeline stages of a grouped launch (neither changes a product's K order, so
    neither changes the bits). A 4-warp program keeps bm * bn / 128 fp32 registers per thread for
    each [bm, bn] tile live at once; two 128 x 128 tiles (the gated forward's g and u, or silu's
    backward's dh beside the loaded g and u) are 256 and spill, so such a launch takes 8 warps:
    3.3x (gated forward) and 3.5x (silu's backward) faster on an H100 at the small preset's
    86,016 rows. A lone 128 x 128 accumulator ran 16% faster with 3 stages than with 4 there
    (34-36% with K = 8; docs/benchmarks.md, "The grouped expert kernels' warps and stages")."""
    if bm * bn * live_tiles > 128 * 128:
        return 8, base.num_stages
    if bm * bn >= 128 * 128:
        return base.num_warps, 3
    return base.num_warps, base.num_stages


# The order of a grouped launch's programs (_program_tile); none changes a result's bits.
# COLUMN_TILE_MAJOR: every schedule tile for column tile 0, then for column tile 1, ...: a row
#   tile's A rows are read again for every column tile, from memory once A outgrows the L2.
# ROW_TILE_MAJOR: a row tile's column tiles in a row: A read once, but an expert's weight tile
#   again for each of its row tiles.
# EXPERT_MAJOR: expert by expert, column-tile-major within one: the expert's A rows (a few MB) stay
#   in L2 across its column tiles, and its row tiles share each weight tile.
COLUMN_TILE_MAJOR, ROW_TILE_MAJOR, EXPERT_MAJOR = 0, 1, 2
PROGRAM_ORDER: int | None = None  # None: _program_order's rule; a benchmark or test may force one


def _program_order(k: int) -> int:
    """The order of a launch with this K. Measured on an H100 (docs/benchmarks.md, "The grouped
    launches' program order"): expert-major ran a K3.1 layer's expert GEMMs 20-36% faster than
    column-tile-major (the down GEMM 3.14 -> 2.00 ms, dx 6.40 -> 4.07 ms) and the small preset's
    10-28% faster. Where K is a LoRA rank up to 64 (the B products), A is small: column-tile-major
    was within 5% of the best order there and 3-15% faster than expert-major. At rank 128 the B
    products take expert-major: 20-22% faster than column-tile-major on the small preset, 3-6%
    slower on the K3.1 layer's dims."""
    if PROGRAM_ORDER is not None:
        return PROGRAM_ORDER
    return EXPERT_MAJOR if k > 64 else COLUMN_TILE_MAJOR


def _grid(groups, n: int, bn: int, order: int) -> tuple[int, int]:
    if order == COLUMN_TILE_MAJOR:
        return groups.max_tiles, cdiv(n, bn)
    return groups.max_tiles * cdiv(n, bn), 1


def _launcher(kernel, name: str, num_warps: int, num_stages: int | None = None):
    """The call site's launcher: after the first launch of a kind, straight to Triton's C launcher
    (_launch.KeyedLaunch: the same compiled kernel with the same arguments)."""
    stages = {} if num_stages is None else {"num_stages": num_stages}
    return keyed(kernel, name, num_warps=num_warps, **stages, **NO_FP_FUSION)


def rows_forward(a, w, groups, w2=None, delta=None, delta2=None, scale=0.0, store_gu=False):
    """a [rows, K] grouped by expert, w (and w2) [E, N, K] -> [rows, N] in a's dtype (and, with
    store_gu, the gated path's g and u as [rows, 2N]). delta/delta2 [rows, N]: LoRA deltas
    (unscaled) joined to the GEMM output(s) as `out + delta * scale`."""
    rows, k = a.shape
    n = w.shape[1]
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    gu = torch.empty(rows, 2 * n, dtype=a.dtype, device=a.device) if store_gu else None
    if rows == 0 or n == 0:
        return (out, gu) if store_gu else out
    base = config_for(n, k, a.dtype)
    bm, bn, bk = groups.block_m, _block_n(n, base.block_n), base.block_k
    w_desc = make_desc(_weight3(w), [1, bn, bk])
    w2_desc = make_desc(_weight3(w2), [1, bn, bk]) if w2 is not None else w_desc
    d = delta if delta is not None else out
    d2 = delta2 if delta2 is not None else d
    if delta is not None and (delta.stride(1) != 1 or d2.stride() != delta.stride()):
        raise ValueError("rows_forward: the deltas must share one row stride with unit column stride")
    order = _program_order(k)
    warps, stages = _warps_stages(base, bm, bn, 2 if w2 is not None else 1)
    _launcher(_rows_forward_kernel, "rows_forward", warps, stages)(_grid(groups, n, bn, order), (
        make_desc(_prep_a(a), [bm, bk]), w_desc, w2_desc, out, d, d2, gu if gu is not None else out,
        groups.tile_expert, groups.tile_row, groups.end32, n, k, groups.num_real, out.stride(0), d.stride(0),
        gu.stride(0) if gu is not None else 0, float(scale),
    ), dict(BM=bm, BN=bn, BK=bk, GATED=w2 is not None, HAS_DELTA=delta is not None, STORE_GU=store_gu,
            IEEE=a.dtype == torch.float32, UPCAST=INTERPRET, ORDER=order))
    return (out, gu) if store_gu else out


def rows_backward(a, w, groups, a2=None, w2=None, alpha=1.0, gu=None, out_dtype=None):
    """a [rows, K] @ w[e] ([E, K, N]) (+ a2 [rows, K2] @ w2[e]), one fp32 accumulator, times alpha
    -> [rows, N] (out_dtype, default a's). gu [rows, 2N] (the forward's g, u): the accumulator is
    dh and the result is [dg, du] as [rows, 2N] instead."""
    rows, k = a.shape
    n = w.shape[2]
    dtype = out_dtype or a.dtype
    out = torch.empty(rows, 2 * n if gu is not None else n, dtype=dtype, device=a.device)
    if rows == 0 or n == 0:
        return out
    base = config_for(n, k, a.dtype)
    bm, bn, bk = groups.block_m, _block_n(n, base.block_n), base.block_k
    bk2 = config_for(n, a2.shape[1], a.dtype).block_k if a2 is not None else bk
    a_desc = make_desc(_prep_a(a), [bm, bk])
    w_desc = make_desc(_weight3(w), [1, bk, bn])
    a2_desc = make_desc(_prep_a(a2), [bm, bk2]) if a2 is not None else a_desc
    w2_desc = make_desc(_weight3(w2), [1, bk2, bn]) if a2 is not None else w_desc
    order = _program_order(k)
    warps, stages = _warps_stages(base, bm, bn, 2 if gu is not None else 1)
    _launcher(_rows_backward_kernel, "rows_backward", warps, stages)(_grid(groups, n, bn, order), (
        a_desc, w_desc, a2_desc, w2_desc, out, gu if gu is not None else out, groups.tile_expert, groups.tile_row,
        groups.end32, n, k, a2.shape[1] if a2 is not None else 0, groups.num_real, out.stride(0),
        gu.stride(0) if gu is not None else 0, float(alpha),
    ), dict(BM=bm, BN=bn, BK=bk, BK2=bk2, TWO=a2 is not None, SILU_BWD=gu is not None,
            IEEE=a.dtype == torch.float32, UPCAST=INTERPRET, ORDER=order))
    return out


def expert_wgrad(p, q, groups, num_experts, alpha=1.0, out_dtype=None):
    """p [rows, N1], q [rows, N2] grouped by expert -> [E, N1, N2]: alpha * sum over each expert's
    rows (ascending) of p_row^T q_row, in fp32, cast once; zeros for an expert without rows."""
    n1, n2 = p.shape[1], q.shape[1]
    out = torch.empty(num_experts, n1, n2, dtype=out_dtype or p.dtype, device=p.device)
    if out.numel() == 0:
        return out
    fp32 = p.dtype == torch.float32
    b1 = b2 = 32 if (INTERPRET or fp32) else 64
    b1 = max(16, min(b1, next_power_of_2(n1)))
    b2 = max(16, min(b2, next_power_of_2(n2)))
    br = 16 if (INTERPRET or fp32) else 64
    p = p if p.stride(1) == 1 else p.contiguous()
    q = q if q.stride(1) == 1 else q.contiguous()
    grid = (num_experts, cdiv(n1, b1) * cdiv(n2, b2))
    _launcher(_expert_wgrad_kernel, "expert_wgrad", 4)(
        grid, (p, q, out, groups.end, groups.counts, n1, n2, p.stride(0), q.stride(0), float(alpha)),
        dict(B1=b1, B2=b2, BR=br, IEEE=fp32, UPCAST=INTERPRET))
    return out
