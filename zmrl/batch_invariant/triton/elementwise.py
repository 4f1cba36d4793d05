"""The Triton path's elementwise rules that a fused kernel must repeat bit for bit: sigmoid (its
backward in one launch); and `add_scaled` (y + d * scale, how a LoRA delta joins its base output)
in one launch.

On CUDA the MoE runs either fused (the grouped kernel's epilogue computes silu(g) * u) or
composed (per-expert `linear` calls, then `zmrl.batch_invariant.silu`), depending on whether an
expert adapter is active; both must give the same bits, or a host holding a zero adapter and a
host holding none disagree. So there is one sigmoid on the Triton path, `sigmoid_f32` below:
the public `sigmoid` (hence `silu`) runs it as its own kernel, and the grouped kernel inlines the
same function. torch's CUDA `exp` is not Triton's `tl.exp` (an ex2.approx-based exponential), so
mixing the two would differ in the last bit.

Every kernel that must agree with torch's separately rounded ops is launched with
`NO_FP_FUSION`: Triton otherwise contracts a multiply feeding an add into one FMA (one rounding
instead of two), which torch's elementwise kernels never do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import INTERPRET, cdiv, check_runnable, next_power_of_2
from zmrl.batch_invariant.triton._launch import keyed

NO_FP_FUSION = {"enable_fp_fusion": False}
"""Launch option: every fp32 multiply and add rounded on its own, as torch's eager kernels do."""

_BLOCK = 1024


@triton.jit
def sigmoid_f32(x):
    """1 / (1 + exp(-x)) in fp32 with an IEEE-rounded division: the Triton path's one sigmoid."""
    return tl.div_rn(1.0, 1.0 + tl.exp(-x))


@triton.jit
def round_as_torch(x, out_ty: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 -> out_ty rounded to nearest even, as torch's elementwise kernels round. Compiled
    Triton converts so already; the interpreter truncates to bfloat16 (numpy has no bfloat16),
    so with EMULATE (the interpreter) the rounding is done on the bits first."""
    if EMULATE:
        if out_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(out_ty)


@triton.jit
def _sigmoid_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, sigmoid_f32(x), mask=ok)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    flat = x.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.float32, device=x.device)
    if flat.numel():
        keyed(_sigmoid_kernel, "sigmoid", num_warps=4, **NO_FP_FUSION)(
            (cdiv(flat.numel(), _BLOCK),), (flat, out, flat.numel()), dict(BLOCK=_BLOCK))
    return out.view(x.shape)


@triton.jit
def _sigmoid_backward_kernel(g_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=ok, other=0.0)
    dx = (g * y) * (1.0 - y)  # rounded step by step (NO_FP_FUSION), in this order
    tl.store(out_ptr + offs, round_as_torch(dx, out_ptr.dtype.element_ty, EMULATE), mask=ok)


def sigmoid_backward_composed(grad: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sigmoid's input gradient as torch ops: (grad * y) * (1 - y) in fp32, cast to x's dtype."""
    return (grad.float() * y * (1.0 - y)).to(dtype)


def _sigmoid_backward(grad: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`sigmoid_backward_composed` in one launch (three or four before) with its bits."""
    if not (grad.is_contiguous() and y.is_contiguous()):
        return sigmoid_backward_composed(grad, y, dtype)  # the same bits, torch's own ops
    out = torch.empty(y.shape, dtype=dtype, device=y.device)
    if out.numel():
        keyed(_sigmoid_backward_kernel, "sigmoid_backward", num_warps=4, **NO_FP_FUSION)(
            (cdiv(out.numel(), _BLOCK),), (grad, y, out, out.numel()), dict(BLOCK=_BLOCK, EMULATE=INTERPRET))
    return out


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = _sigmoid(x)
        ctx.save_for_backward(y)
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return _sigmoid_backward(grad, y, ctx.in_dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """x (fp32/bf16/fp16) -> sigmoid(x) in fp32, by `sigmoid_f32`. Differentiable."""
    check_runnable("x", x)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x has dtype {x.dtype}; supported: float32, bfloat16, float16")
    return _Sigmoid.apply(x)


# ----------------------------------------------------------------------------- y + d * scale
@triton.jit
def _add_scaled_kernel(y_ptr, d_ptr, out_ptr, N, D1, stride_d0, stride_d1, scale,
                       BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    # one program per row segment of y's memory (y and out share it: [rows, N] contiguous once
    # permuted), d read at the same index as [D0, D1, N] through its own strides
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    y = tl.load(y_ptr + row * N + cols, mask=ok, other=0.0)
    d = tl.load(d_ptr + (row // D1) * stride_d0 + (row % D1) * stride_d1 + cols, mask=ok, other=0.0)
    out_ty = out_ptr.dtype.element_ty
    scaled = round_as_torch(d.to(tl.float32) * scale, out_ty, EMULATE)
    total = round_as_torch(y.to(tl.float32) + scaled.to(tl.float32), out_ty, EMULATE)
    tl.store(out_ptr + row * N + cols, total, mask=ok)


def _rows_of(d: torch.Tensor) -> tuple[int, int, int] | None:
    """d [..., N] as [D0, D1, N] with its last dim contiguous: (D1, stride0, stride1), or None
    where its layout does not fit (a strided last dim, leading dims that do not flatten)."""
    if d.dim() and d.stride(-1) != 1 and d.shape[-1] > 1:
        return None
    if d.dim() < 2:
        return 1, 0, 0
    if d.dim() == 2:
        return 1, d.stride(0), 0
    lead = range(d.dim() - 3)  # dims before the last three must flatten into dim -3
    if not all(d.stride(i) == d.stride(i + 1) * d.shape[i + 1] for i in lead):
        return None
    return d.shape[-2], d.stride(-3), d.stride(-2)


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The permutation of t's dims that makes it contiguous (outermost first), or None where t is
    not dense (a slice, a broadcast)."""
    if t.is_contiguous() and 1 not in t.shape:  # most calls: strides strictly falling, the dims in order
        return list(range(t.dim()))
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), t.shape[i] != 1))  # size-1 dims outside
    return order if t.permute(order).is_contiguous() else None


def _add_scaled(y: torch.Tensor, d: torch.Tensor, scale: float) -> torch.Tensor:
    # the output takes y's layout, as torch's `y + d * scale` does for a dense y (its first operand
    # decides where the two layouts disagree); the kernel walks y's memory order
    order = _memory_order(y)
    rows_d = None if order is None else _rows_of(d.permute(order))
    if rows_d is None:
        return y + d * scale  # a layout the kernel does not index: torch's own two ops, the same bits
    out = torch.empty_like(y)
    if out.numel():
        n = y.shape[order[-1]] if y.dim() else 1
        block = min(1024, next_power_of_2(n))
        keyed(_add_scaled_kernel, "add_scaled", num_warps=4, **NO_FP_FUSION)(
            (out.numel() // n, cdiv(n, block)), (y, d.permute(order), out, n, *rows_d, scale),
            dict(BLOCK=block, EMULATE=INTERPRET))
    return out


class _AddScaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, d, scale):
        ctx.scale = scale
        return _add_scaled(y, d, scale)

    @staticmethod
    def backward(ctx, grad):
        # autograd's own formulas for y + d * scale: AddBackward hands the gradient to both
        # terms, MulBackward multiplies it by the (wrapped) scalar in the gradient's dtype
        return grad, grad * ctx.scale if ctx.needs_input_grad[1] else None, None


def add_scaled(y: torch.Tensor, d: torch.Tensor, scale: float) -> torch.Tensor:
    """y + d * scale in one launch with torch's two roundings (zmrl.batch_invariant.add_scaled)."""
    check_runnable("y", y)
    if torch.is_grad_enabled() and (y.requires_grad or d.requires_grad):
        return _AddScaled.apply(y, d, scale)
    return _add_scaled(y, d, scale)
