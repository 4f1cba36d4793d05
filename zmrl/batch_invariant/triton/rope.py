"""Triton rotate-half RoPE: one launch forward, one launch backward, the bits of the torch
expression (`zmrl.batch_invariant.rope.rope_torch`) and of its autograd backward.

Forward, in fp32 with every multiply and add rounded on its own (hence `NO_FP_FUSION`):
    out0 = x0 * c - x1 * s,  out1 = x1 * c + x0 * s,  then rounded to x's dtype as torch rounds.
Backward, what torch autograd computes for that expression, from g = grad.float():
    grad_x0 = (g0 * c + g1 * s) + 0,  grad_x1 = (g1 * c - g0 * s) + 0,  then cast to x's dtype.
Autograd forms g1 * c - g0 * s as g1 * c + (-g0) * s, the same IEEE operation since negation is
exact. The trailing + 0 is also autograd's: x0 and x1 are slices of one tensor, so each half's
gradient is scattered into zeros and the two are added, which turns a -0.0 into +0.0.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant._paths import records_graph
from zmrl.batch_invariant.triton._common import INTERPRET, cdiv, check_runnable, next_power_of_2
from zmrl.batch_invariant.triton._launch import keyed
from zmrl.batch_invariant.triton.elementwise import NO_FP_FUSION, round_as_torch

_ELEMS = 2048
"""Pairs per program: enough work per launch slot, few enough registers at any R."""


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, rows, inner, half,
                 stride_xt, stride_xm, stride_xr, stride_ct, stride_cj, stride_st, stride_sj,
                 HALF_P: tl.constexpr, BLOCK_ROWS: tl.constexpr, BACKWARD: tl.constexpr,
                 EMULATE: tl.constexpr):
    # x seen as [T, inner, R] with any strides (a rope slice of a projection's output is not
    # contiguous); a row is one (t, middle index); out is contiguous [rows, R]
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    j = tl.arange(0, HALF_P)
    ok = (row < rows)[:, None] & (j < half)[None, :]
    t = row // inner
    xa = x_ptr + (t * stride_xt + (row % inner) * stride_xm)[:, None] + j[None, :] * stride_xr
    a0 = tl.load(xa, mask=ok, other=0.0).to(tl.float32)
    a1 = tl.load(xa + half * stride_xr, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + (t * stride_ct)[:, None] + j[None, :] * stride_cj, mask=ok, other=0.0)
    s = tl.load(sin_ptr + (t * stride_st)[:, None] + j[None, :] * stride_sj, mask=ok, other=0.0)
    if BACKWARD:
        y0 = (a0 * c + a1 * s) + 0.0
        y1 = (a1 * c - a0 * s) + 0.0
    else:
        y0 = a0 * c - a1 * s
        y1 = a1 * c + a0 * s
    out_ty = out_ptr.dtype.element_ty
    o = out_ptr + row[:, None] * (2 * half) + j[None, :]
    tl.store(o, round_as_torch(y0, out_ty, EMULATE), mask=ok)
    tl.store(o + half, round_as_torch(y1, out_ty, EMULATE), mask=ok)


def _launch(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype,
            backward: bool, options: dict = NO_FP_FUSION) -> torch.Tensor:
    """src [T, ..., R] (x forward, the output's gradient backward) -> [T, ..., R] contiguous.
    `options` are the launch's compiler options; only a test's negative control changes them."""
    t, r = src.shape[0], src.shape[-1]
    inner = math.prod(src.shape[1:-1])
    out = torch.empty(src.shape, dtype=out_dtype, device=src.device)
    if out.numel() == 0:
        return out
    view = src.reshape(t, inner, r)  # a view for slices of the last dim; copies only odd layouts
    half = r // 2
    half_p = next_power_of_2(half)
    block_rows = max(1, _ELEMS // half_p)
    grid = (cdiv(t * inner, block_rows),)
    keyed(_rope_kernel, "rope", num_warps=4, **options)(
        grid, (view, cos, sin, out, t * inner, inner, half, *view.stride(), *cos.stride(), *sin.stride()),
        dict(HALF_P=half_p, BLOCK_ROWS=block_rows, BACKWARD=backward, EMULATE=INTERPRET))
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _launch(x, cos, sin, x.dtype, backward=False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        grad_x = _launch(grad, cos, sin, ctx.x_dtype, backward=True) if ctx.needs_input_grad[0] else None
        return grad_x, None, None  # cos/sin are tables: no gradient


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., R], cos/sin [T, R/2] fp32 (checked by the public op) -> x's shape and dtype,
    contiguous. Differentiable in x."""
    check_runnable("x", x)
    if records_graph(x):
        return _Rope.apply(x, cos, sin)
    return _launch(x, cos, sin, x.dtype, backward=False)  # no graph: skip autograd.Function's host cost
