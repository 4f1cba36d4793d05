"""Row reductions: rms_norm, softmax, log_softmax, mean. One row per program, fp32 math.

A row's reduction order is fixed by its length alone: the row is read in chunks of BLOCK
(a function of the length) in ascending order. rms_norm and mean keep one fp32 partial per
lane across chunks and combine the lanes by one tl.sum tree at the end; softmax keeps a
running max and sum, rescaled chunk by chunk (online softmax). How many rows a call has
only changes how many programs run. Division and square root are the IEEE-rounded ones
(div_rn, sqrt_rn) so the results sit as close as possible to the fp32 references.

The input gradients are one kernel launch per call as well, with the forward's blocking: a
row's sums (sum(g * w * normed) for rms_norm, sum(g * y) for softmax, sum(g) for log_softmax)
are taken chunk by chunk in ascending order and lane by lane through one tl.sum tree, and
rms_norm recomputes rstd with the forward's own operations. No other engine computes these
gradients (the rollout engine runs forward passes only), so their bits need not equal those
of any torch expression; what counts is this kernel's own fixed in-row order, which makes a
row's gradient depend on that row alone: the same bits alone or among any number of rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import INTERPRET, check_runnable, next_power_of_2
from zmrl.batch_invariant.triton._launch import keyed

MAX_SINGLE_BLOCK = 16384  # a row this long or shorter is held in registers in one block
CHUNK = 16384  # longer rows (vocabularies) stream through in chunks of this size
LOAD_STAGES = 3  # chunk loads kept in flight: a lone row is latency-bound on one SM
CHUNK_WARPS = 32  # with CHUNK: the fastest lone-row shape measured on an H200 (2026-11-30)


def _blocking(length: int) -> tuple[int, bool, int]:
    """(BLOCK, single_pass, num_warps) from the row length only."""
    if length <= MAX_SINGLE_BLOCK:
        block = max(16, next_power_of_2(length))
        single = True
    else:
        block, single = CHUNK, False
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    if not single:
        warps = CHUNK_WARPS
    return block, single, (1 if INTERPRET else warps)


@triton.jit
def _rstd(sumsq, D, eps):
    """1 / sqrt(mean(x^2) + eps), IEEE-rounded: shared so the backward's rstd is the forward's."""
    # tl.cast, not D.to: the compiler turns an integer argument equal to 1 into a Python int
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sumsq, tl.cast(D, tl.float32)) + eps))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps,
                     BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        x = tl.load(x_row + cols, mask=cols < D, other=0.0).to(tl.float32)
        sumsq = tl.sum(x * x, axis=0)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            xc = tl.load(x_row + start + cols, mask=start + cols < D, other=0.0).to(tl.float32)
            acc += xc * xc
        sumsq = tl.sum(acc, axis=0)
    rstd = _rstd(sumsq, D, eps)
    if SINGLE:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=cols < D)
    else:
        for start in range(0, D, BLOCK):
            m = start + cols < D
            xc = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, (xc * rstd * w).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _f32(ptr, mask):
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rms_norm_backward_kernel(x_ptr, w_ptr, g_ptr, dx_ptr, D, stride_x, stride_g, stride_dx, eps,
                              BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    """dx = rstd * (gn - normed * mean(gn * normed)), gn = g * w, normed = x * rstd."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    g_row = g_ptr + row * stride_g
    dx_row = dx_ptr + row * stride_dx
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        m = cols < D
        x = _f32(x_row + cols, m)
        rstd = _rstd(tl.sum(x * x, axis=0), D, eps)
        normed = x * rstd
        gn = _f32(g_row + cols, m) * _f32(w_ptr + cols, m)
        proj = tl.div_rn(tl.sum(gn * normed, axis=0), tl.cast(D, tl.float32))
        tl.store(dx_row + cols, (rstd * (gn - normed * proj)).to(dx_ptr.dtype.element_ty), mask=m)
    else:
        # three passes: sum(x^2) as the forward takes it, then sum(gn * normed), then the output
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            xc = _f32(x_row + start + cols, start + cols < D)
            acc += xc * xc
        rstd = _rstd(tl.sum(acc, axis=0), D, eps)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            m = start + cols < D
            gn = _f32(g_row + start + cols, m) * _f32(w_ptr + start + cols, m)
            acc += gn * (_f32(x_row + start + cols, m) * rstd)
        proj = tl.div_rn(tl.sum(acc, axis=0), tl.cast(D, tl.float32))
        for start in range(0, D, BLOCK):
            m = start + cols < D
            gn = _f32(g_row + start + cols, m) * _f32(w_ptr + start + cols, m)
            normed = _f32(x_row + start + cols, m) * rstd
            dx = rstd * (gn - normed * proj)
            tl.store(dx_row + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, N, stride_x, stride_y,
                    BLOCK: tl.constexpr, SINGLE: tl.constexpr, LOG: tl.constexpr, STAGES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        x = tl.load(x_row + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        row_max = tl.max(x, axis=0)
        shifted = x - row_max
        e = tl.exp(shifted)
        total = tl.sum(e, axis=0)
        if LOG:
            out = shifted - tl.log(total)
        else:
            out = e * tl.div_rn(1.0, total)
        tl.store(y_row + cols, out.to(y_ptr.dtype.element_ty), mask=cols < N)
    else:
        # online max/sum, one chunk at a time in ascending order: one exp per element
        row_max = tl.full((), float("-inf"), dtype=tl.float32)
        total = tl.zeros((), dtype=tl.float32)
        for start in tl.range(0, N, BLOCK, num_stages=STAGES):
            x = tl.load(x_row + start + cols, mask=start + cols < N, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(row_max, tl.max(x, axis=0))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp gives 0, not NaN
            total = total * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
            row_max = m_new
        log_total = tl.log(total)
        inv_total = tl.div_rn(1.0, total)
        for start in tl.range(0, N, BLOCK, num_stages=STAGES):
            m = start + cols < N
            x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
            shifted = x - row_max
            if LOG:
                out = shifted - log_total
            else:
                # one reciprocal per row: an IEEE division per element made a lone row compute-bound
                out = tl.exp(shifted) * inv_total
            tl.store(y_row + start + cols, out.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _softmax_backward_kernel(y_ptr, g_ptr, dx_ptr, N, stride_y, stride_g, stride_dx,
                             BLOCK: tl.constexpr, SINGLE: tl.constexpr, LOG: tl.constexpr):
    """From the forward's output y: softmax dx = y * (g - sum(g * y)), log dx = g - exp(y) * sum(g)."""
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_y
    g_row = g_ptr + row * stride_g
    dx_row = dx_ptr + row * stride_dx
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        m = cols < N
        y = _f32(y_row + cols, m)
        g = _f32(g_row + cols, m)
        if LOG:
            dx = g - tl.exp(y) * tl.sum(g, axis=0)
        else:
            dx = y * (g - tl.sum(g * y, axis=0))
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
    else:
        # plain loops, not the forward's staged ones: two fp32 chunk streams in flight over
        # LOAD_STAGES buffers outgrow shared memory, and a backward always has many rows
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            m = start + cols < N
            if LOG:
                acc += _f32(g_row + start + cols, m)
            else:
                acc += _f32(g_row + start + cols, m) * _f32(y_row + start + cols, m)
        total = tl.sum(acc, axis=0)
        for start in range(0, N, BLOCK):
            m = start + cols < N
            y = _f32(y_row + start + cols, m)
            g = _f32(g_row + start + cols, m)
            if LOG:
                dx = g - tl.exp(y) * total
            else:
                dx = y * (g - total)
            tl.store(dx_row + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)


@triton.jit
def _mean_kernel(x_ptr, y_ptr, L, stride_x, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        total = tl.sum(tl.load(x_row + cols, mask=cols < L, other=0.0).to(tl.float32), axis=0)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, L, BLOCK):
            acc += tl.load(x_row + start + cols, mask=start + cols < L, other=0.0).to(tl.float32)
        total = tl.sum(acc, axis=0)
    tl.store(y_ptr + row, tl.div_rn(total, tl.cast(L, tl.float32)).to(y_ptr.dtype.element_ty))  # L == 1: an int


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[*, L] -> [R, L] with unit inner stride (a copy only when needed)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] <= 1 else x2.contiguous()


def _check_x(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x has dtype {x.dtype}; supported: float32, bfloat16, float16")
    check_runnable("x", x)


def rms_norm_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, d = x2.shape
    y = torch.empty(rows, d, dtype=x2.dtype, device=x2.device)
    if rows and d:
        block, single, warps = _blocking(d)
        keyed(_rms_norm_kernel, "rms_norm", num_warps=warps)(
            (rows,), (x2, weight, y, d, x2.stride(0), y.stride(0), float(eps)), dict(BLOCK=block, SINGLE=single))
    return y


def softmax_forward(x2: torch.Tensor, log: bool) -> torch.Tensor:
    rows, n = x2.shape
    y = torch.empty(rows, n, dtype=x2.dtype, device=x2.device)
    if rows and n:
        block, single, warps = _blocking(n)
        keyed(_softmax_kernel, "softmax", num_warps=warps)(
            (rows,), (x2, y, n, x2.stride(0), y.stride(0)),
            dict(BLOCK=block, SINGLE=single, LOG=log, STAGES=LOAD_STAGES))
    return y


def rms_norm_backward(x2: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """The input gradient of rms_norm_forward, one program per row."""
    rows, d = x2.shape
    dx = torch.empty(rows, d, dtype=x2.dtype, device=x2.device)
    if rows and d:
        g2 = _rows(grad)  # the arriving gradient may be strided; the kernel takes unit inner stride
        block, single, warps = _blocking(d)
        keyed(_rms_norm_backward_kernel, "rms_norm_backward", num_warps=warps)(
            (rows,), (x2, weight, g2, dx, d, x2.stride(0), g2.stride(0), dx.stride(0), float(eps)),
            dict(BLOCK=block, SINGLE=single))
    return dx


def softmax_backward(out: torch.Tensor, grad: torch.Tensor, log: bool) -> torch.Tensor:
    """The input gradient of softmax_forward from its output, one program per row."""
    rows, n = out.shape
    dx = torch.empty(rows, n, dtype=out.dtype, device=out.device)
    if rows and n:
        g2 = _rows(grad)
        block, single, warps = _blocking(n)
        keyed(_softmax_backward_kernel, "softmax_backward", num_warps=warps)(
            (rows,), (out, g2, dx, n, out.stride(0), g2.stride(0), dx.stride(0)),
            dict(BLOCK=block, SINGLE=single, LOG=log))
    return dx


def _rms_norm_weight_grad(x2: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                          eps: float) -> torch.Tensor:
    # a sum over rows, so batch-dependent by nature; torch ops (deterministic, no atomics) suffice
    # for the rare run that trains the norm weight (LoRA freezes it)
    xf, gf = x2.float(), grad.float()
    rstd = torch.rsqrt((xf * xf).sum(-1, keepdim=True) / xf.shape[-1] + eps)
    return (gf * (xf * rstd)).sum(0).to(weight.dtype)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, eps):
        ctx.save_for_backward(x2, weight)
        ctx.eps = eps
        return rms_norm_forward(x2, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        grad_w = _rms_norm_weight_grad(x2, weight, grad, ctx.eps) if ctx.needs_input_grad[1] else None
        grad_x = rms_norm_backward(x2, weight, grad, ctx.eps) if ctx.needs_input_grad[0] else None
        return grad_x, grad_w, None


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, log):
        out = softmax_forward(x2, log)
        ctx.save_for_backward(out)
        ctx.log = log
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return softmax_backward(out, grad, ctx.log), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [*, D], weight [D] -> x * rsqrt(mean(x^2) + eps) * weight in fp32, cast to x.dtype."""
    _check_x(x)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [D={x.shape[-1]}], got {getattr(weight, 'shape', weight)}")
    check_runnable("weight", weight)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    x2 = _rows(x)
    return _RmsNorm.apply(x2, weight.contiguous(), float(eps)).reshape(x.shape)


def _along(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    _check_x(x)
    if x.dim() == 0:
        return _along(x.reshape(1), 0, log).reshape(())
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    moved = x.movedim(dim, -1)
    out = _Softmax.apply(_rows(moved), log).reshape(moved.shape)
    return out.movedim(-1, dim).contiguous() if dim % x.dim() != x.dim() - 1 else out


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along `dim`, fp32 math, output in x.dtype."""
    return _along(x, dim, log=False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax along `dim`, fp32 math, output in x.dtype."""
    return _along(x, dim, log=True)


class _Mean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows):
        ctx.shape = rows.shape
        out = torch.empty(rows.shape[0], dtype=rows.dtype, device=rows.device)
        if rows.shape[0]:
            block, single, warps = _blocking(max(rows.shape[1], 1))
            _mean_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0),
                                           BLOCK=block, SINGLE=single, num_warps=warps)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad.float()[:, None] / ctx.shape[1]).expand(ctx.shape).to(grad.dtype), None


def mean(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """Mean over `dim` (an int, a sequence of ints, or None for all), fp32 sum, x.dtype out."""
    _check_x(x)
    if dim is None:
        dims = tuple(range(x.dim()))
    else:
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if not -max(x.dim(), 1) <= d < max(x.dim(), 1):
            raise ValueError(f"dim={d} is out of range for a tensor of shape {tuple(x.shape)}")
    dims = tuple(sorted({d % max(x.dim(), 1) for d in dims})) if x.dim() else ()
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims)
    length = 1
    for d in dims:
        length *= x.shape[d]
    rows = moved.reshape(-1, length)
    rows = rows if rows.stride(-1) == 1 or length <= 1 else rows.contiguous()
    out = _Mean.apply(rows).reshape([x.shape[d] for d in kept])
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out
