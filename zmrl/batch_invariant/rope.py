"""Batch-invariant rotate-half (NeoX) RoPE: x [T, ..., R], cos/sin [T, R/2] fp32.

The math is elementwise, so torch's kernels are already batch-invariant here: the reference,
CPU and torch paths all run the plain torch expression, in fp32, then cast to x's dtype. On
CUDA that expression is a handful of kernels forward and backward per call (and RoPE runs on
four tensors per layer), so the Triton path is one kernel each way that repeats the
expression's roundings exactly: a host that rotates on CPU and one that rotates on a GPU
disagree in no bit, nor do the rollout and the trainer.
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant._checks import check_dim, check_float, check_same_device, check_size
from zmrl.batch_invariant._paths import path_for, triton_ops

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The expression every path must reproduce bit for bit, autograd's backward included:
    out = [x0 * c - x1 * s, x1 * c + x0 * s] in fp32 (each multiply and add rounded on its
    own), cast to x's dtype; x0/x1 the first/second half of x's last dim."""
    half = x.shape[-1] // 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    x0, x1 = xf[..., :half], xf[..., half:]
    return torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], -1).to(x.dtype)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_float("x", x, X_DTYPES)
    check_float("cos", cos, (torch.float32,))
    check_float("sin", sin, (torch.float32,))
    check_same_device(x=x, cos=cos, sin=sin)
    if x.dim() < 2:
        raise ValueError(f"x must be [T, ..., R] (at least 2-D), got shape {tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"x: the rotated dim R = {x.shape[-1]} must be even (channel i pairs with i + R/2)")
    check_dim("cos", cos, 2, "[T, R/2]")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    check_size("cos", cos.shape[0], x.shape[0], "T (rows) vs x.shape[0]")
    check_size("cos", cos.shape[1], x.shape[-1] // 2, "width vs R/2 = x.shape[-1] / 2")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, ..., R] (fp32/bf16/fp16, any strides), cos/sin [T, R/2] fp32 ->
    x's shape and dtype. Differentiable in x; cos/sin are tables and get no gradient on the
    Triton path."""
    _check(x, cos, sin)
    if path_for(x) == "triton":
        return triton_ops().rope(x, cos, sin)
    return rope_torch(x, cos, sin)  # reference, cpu and torch: the expression itself
