"""Elementwise ops whose fused Triton form must keep the bits of torch's separate eager ops.

`add_scaled(y, d, scale)` is how every LoRA delta joins its base output (zmrl.lora's canonical
form, y = x W^T + ((x A^T) B^T) * scale): torch rounds the product `d * scale` to the tensors'
dtype, then rounds the sum. On the Triton path one launch computes both, rounding each step as
torch does, where the composed form took two launches and wrote the scaled delta out between them.
"""
from __future__ import annotations

import numbers

import torch

from zmrl.batch_invariant._checks import check_float, check_same_device, check_same_dtype
from zmrl.batch_invariant._paths import path_for, triton_ops

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def add_scaled_composed(y: torch.Tensor, d: torch.Tensor, scale: float) -> torch.Tensor:
    """`add_scaled` as torch ops (the CPU, reference and "torch" paths; what the kernel repeats)."""
    return y + d * scale


def add_scaled(y: torch.Tensor, d: torch.Tensor, scale: float) -> torch.Tensor:
    """y + d * scale for y, d of one shape and dtype (d may be any strided view; y's last dim
    contiguous on the Triton path, else it runs composed) -> a new tensor shaped like y, with the
    bits of torch's `y + d * scale`: the product rounded to the dtype, then the sum rounded.
    Differentiable in y and d, with autograd's gradients for that expression (y's: the output
    gradient; d's: the output gradient times scale)."""
    check_float("y", y, _DTYPES)
    check_float("d", d, _DTYPES)
    check_same_dtype(y=y, d=d)
    check_same_device(y=y, d=d)
    if y.shape != d.shape:
        raise ValueError(f"add_scaled: d has shape {tuple(d.shape)}, y {tuple(y.shape)}; they must match")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if path_for(y) == "triton":
        return triton_ops().add_scaled(y, d, float(scale))
    return add_scaled_composed(y, d, scale)
