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
    """y + d * scale for y, d of one shape and dtype -> a new tensor shaped like y, in y's layout
    where y is dense, with the bits of torch's `y + d * scale`: the product rounded to the dtype,
    then the sum rounded. On the Triton path one launch for a dense y and a d whose rows it can
    index (any strided view with a unit last stride), torch's two ops otherwise.
    Differentiable in y and d, with autograd's gradients for that expression (y's: the output
    gradient; d's: the output gradient times scale)."""
    # every LoRA projection calls this: arguments that plainly fit skip the itemized checks below
    # (which name what is wrong) at half the host time
    if not (type(y) is type(d) is torch.Tensor and y.dtype is d.dtype and y.dtype in _DTYPES
            and y.shape == d.shape and y.device == d.device and type(scale) in (float, int)):
        _check_args(y, d, scale)
    if path_for(y) == "triton":
        return triton_ops().add_scaled(y, d, float(scale))
    return add_scaled_composed(y, d, scale)


def _check_args(y, d, scale) -> None:
    check_float("y", y, _DTYPES)
    check_float("d", d, _DTYPES)
    check_same_dtype(y=y, d=d)
    check_same_device(y=y, d=d)
    if y.shape != d.shape:
        raise ValueError(f"add_scaled: d has shape {tuple(d.shape)}, y {tuple(y.shape)}; they must match")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
