"""What every RoPE path must reproduce, for the RoPE tests: the torch expression apply_rope ran
before the op existed, frozen here rather than imported from zmrl/batch_invariant/rope.py, so a
change to the op cannot also change the oracle it is checked against."""
from __future__ import annotations

import torch


def old_expression(x, cos, sin):
    half = x.shape[-1] // 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    x0, x1 = xf[..., :half], xf[..., half:]
    return torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], -1).to(x.dtype)


def tables(t: int, half: int, device="cpu", seed: int = 1, span: float = 50.0):
    """cos, sin [t, half] fp32 from float64 angles in [0, span)."""
    angles = torch.rand(t, half, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * span
    return angles.cos().float().to(device), angles.sin().float().to(device)


def value_and_grad(fn, x, cos, sin, grad):
    """fn's output and x's gradient for the output gradient `grad`."""
    leaf = x.detach().requires_grad_()
    out = fn(leaf, cos, sin)
    out.backward(grad)
    return out.detach(), leaf.grad
