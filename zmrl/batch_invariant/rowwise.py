"""Batch-invariant row reductions: rms_norm, softmax, log_softmax, mean.

Every op works on rows in fp32 and is built only from max (exact in any order), sums,
IEEE add/mul/div and exp/log/rsqrt, whose CPU vector lanes and scalar tails agree bit for
bit (lanes.py measures that this machine keeps that promise; torch.sigmoid, for one, does not).

The sums are the one place where order matters. torch.sum splits a single wide row across
threads when the call has few rows (a 128K-vocabulary row at M=1 gets other bits than at
M=130), so the CPU path never calls a reduction kernel for a sum: `tree_sum` adds the two
halves of the row elementwise, again and again, a fixed pairwise tree written in the code.
Elementwise adds are correctly rounded wherever they run, so the order is the same for
every row at every batch size and thread count, and no padding rows are needed.
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant._checks import check_dim, check_float, check_same_device, check_size
from zmrl.batch_invariant._paths import path_for, records_graph, torch_ops, triton_ops


# ----------------------------------------------------------------------------- row math
def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a fixed pairwise tree of elementwise adds -> [..., 1].

    The tree is that of the row zero-padded to the next power of two, halved again and again.
    The first level is taken straight from the unpadded row (adding a padded zero changes
    nothing, so those lanes are just kept), which avoids copying the row into a padded buffer."""
    d = x.shape[-1]
    width = 1 << max(0, d - 1).bit_length()
    if width != d:
        half = width // 2
        first = x[..., :half].clone()
        first[..., : d - half] += x[..., half:]
        x = first
    while x.shape[-1] > 1:
        low, high = x.chunk(2, -1)  # the two halves (a power of two: equal), one call for both views
        x = low + high
    return x


def _plain_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1, keepdim=True)


def _sum_for(path: str):
    return _plain_sum if path == "reference" else tree_sum


# The row math is written once; the reference path sums with torch.sum, the CPU path with tree_sum.
def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, total) -> torch.Tensor:
    xf = x.float()
    mean_sq = total(xf * xf) / xf.shape[-1]
    return (xf * torch.rsqrt(mean_sq + eps) * weight.float()).to(x.dtype)


def _softmax_rows(x: torch.Tensor, total) -> torch.Tensor:
    xf = x.float()
    e = torch.exp(xf - xf.amax(-1, keepdim=True))
    return (e / total(e)).to(x.dtype)


def _log_softmax_rows(x: torch.Tensor, total) -> torch.Tensor:
    xf = x.float()
    shifted = xf - xf.amax(-1, keepdim=True)
    return (shifted - torch.log(total(torch.exp(shifted)))).to(x.dtype)


def _mean_rows(x: torch.Tensor, total) -> torch.Tensor:
    return (total(x.float()) / x.shape[-1]).to(x.dtype)


def _norm_dim(x: torch.Tensor, dim: int, arg: str = "dim") -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{arg}={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


# ----------------------------------------------------------------------------- autograd
class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, eps, path):
        ctx.save_for_backward(x2, weight)
        ctx.eps = eps
        return _rms_norm_rows(x2, weight, eps, _sum_for(path))

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        xf, gf, wf = x2.float(), grad.float(), weight.float()
        rstd = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + ctx.eps)
        normed = xf * rstd
        grad_w = (gf * normed).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gn = gf * wf
        grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
        return grad_x.to(x2.dtype), grad_w, None, None


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, path):
        out = _log_softmax_rows(x2, _sum_for(path))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        gf = grad.float()
        grad_x = gf - torch.exp(out.float()) * gf.sum(-1, keepdim=True)
        return grad_x.to(out.dtype), None


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, path):
        out = _softmax_rows(x2, _sum_for(path))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        of, gf = out.float(), grad.float()
        return (of * (gf - (gf * of).sum(-1, keepdim=True))).to(out.dtype), None


# ----------------------------------------------------------------------------- public
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [*, D], weight [D]: x * rsqrt(mean(x^2) + eps) * weight, in fp32, cast to x.dtype."""
    check_float("x", x)
    check_float("weight", weight)
    check_same_device(x=x, weight=weight)
    check_dim("weight", weight, 1, "[D]")
    check_size("weight", weight.shape[0], x.shape[-1], "length vs x.shape[-1]")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    path = path_for(x)
    if path in ("triton", "torch"):
        return (triton_ops() if path == "triton" else torch_ops()).rms_norm(x, weight, eps)
    x2 = x.reshape(-1, x.shape[-1])
    if not records_graph(x2, weight):  # inference: the same row math without autograd.Function's host cost
        return _rms_norm_rows(x2, weight, float(eps), _sum_for(path)).reshape(x.shape)
    return _RmsNorm.apply(x2, weight, float(eps), path).reshape(x.shape)


def _row_op(name: str, fn_cls, row_math, x: torch.Tensor, dim: int) -> torch.Tensor:
    check_float("x", x)
    dim = _norm_dim(x, dim)
    path = path_for(x)
    if path in ("triton", "torch"):
        return getattr(triton_ops() if path == "triton" else torch_ops(), name)(x, dim)
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    if records_graph(rows):  # else the same row math without autograd.Function's host cost
        out = fn_cls.apply(rows, path)
    else:
        out = row_math(rows, _sum_for(path))
    return out.reshape(moved.shape).movedim(-1, dim)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along `dim` in fp32, output in x.dtype."""
    return _row_op("softmax", _Softmax, _softmax_rows, x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax along `dim` in fp32, output in x.dtype (pass fp32 logits for log-probs)."""
    return _row_op("log_softmax", _LogSoftmax, _log_softmax_rows, x, dim)


def mean(x: torch.Tensor, dim: int | tuple[int, ...] | list[int], keepdim: bool = False) -> torch.Tensor:
    """Mean over `dim` (one or several dims), accumulated in fp32, output in x.dtype."""
    check_float("x", x)
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims:
        raise ValueError("dim must name at least one dimension")
    dims = tuple(sorted({_norm_dim(x, d) for d in dims}))
    path = path_for(x)
    if path in ("triton", "torch"):
        return (triton_ops() if path == "triton" else torch_ops()).mean(x, dims, keepdim)
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims)
    rows = moved.reshape(-1, int(torch.Size([x.shape[d] for d in dims]).numel()))
    out = _mean_rows(rows, _sum_for(path)).reshape([x.shape[d] for d in kept])
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out
