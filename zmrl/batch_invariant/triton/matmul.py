"""Batch-invariant matmul, linear and bmm on the GPU (Triton): the public entry points.

The GEMM is built in layers, each its own module:
- _gemm_config.py: the tile configuration, one fixed config per (N, K, dtype) (`TUNED`, the
  split-K count of narrow shapes included) and the tile ladder's rungs for small M;
- _gemm_kernel.py: the kernel (why its bits cannot depend on M) and one launch of a config;
- _splitk.py: the K ranges of a split-K shape and their fixed-order sum;
- _gemm_ladder.py: per call, which config runs (the ladder's per-process self-check);
- _gemm_plan.py and _launch.py: a call seen before repeats its launch without the JIT;
- _workspace.py: a planned split-K call's fp32 workspace, kept per stream between calls.
`gemm` below ties them together; matmul / linear / bmm check their arguments, add autograd
(deterministic backward GEMMs) and take a launch plan straight from a known argument key.
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant.triton import _gemm_plan
from zmrl.batch_invariant.triton._common import check_runnable, device_index, env_reader, num_sms
from zmrl.batch_invariant.triton._gemm_config import (  # noqa: F401 - also this module's interface
    TUNED,
    MMConfig,
    config_for,
    ladder_config,
    ladder_plan,
    pads_rows,
    row_parts,
)
from zmrl.batch_invariant.triton._gemm_kernel import (  # noqa: F401 - grouped.py: _prep_a
    _prep_a,
    b_layout,
    launch_config,
    persistent_at,
    row_views,
)
from zmrl.batch_invariant.triton._gemm_ladder import (  # noqa: F401 - also this module's interface
    _capturing,
    _select,
    chosen_config,
    ladder_decision,
    ladder_decisions,
    ladder_mode,
    reset_ladder_decisions,
)


# the ladder's switch is part of every plan key: a call made after it changes is planned afresh
_ladder_switch = env_reader("ZMRL_GEMM_LADDER")


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
         cfg: MMConfig | None = None, pad_rows: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [B, M, K] x b [B, K, N] (+ bias [N]) -> [B, M, N] in a's dtype. B may be 1 with a
    weight shared by all rows. No autograd here; see the Function classes below.
    cfg None (the public ops): the fixed config, or the ladder's rung for this M where the
    shape's self-check passed (_gemm_ladder.py). An explicit cfg is used as given.
    pad_rows: copy a lone partial row tile into BLOCK_M zero rows first, which changes no
    product, only how much of the TMA box lies past the tensor's edge (the ladder does this).
    out: write into this [B, M, N] tensor (contiguous rows) instead of a new one.

    A call whose shapes, strides, alignment and arguments were seen before reuses that call's
    launch plan (_gemm_plan.py): no selection, no descriptor objects, no JIT binding."""
    return _gemm(a, b, bias, cfg, pad_rows, out)[0]


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, cfg: MMConfig | None, pad_rows: bool,
          out: torch.Tensor | None) -> tuple[torch.Tensor, _gemm_plan.Plan | _gemm_plan.RowSplitPlan | None]:
    """gemm, and the launch plan that now serves this exact call (None: none)."""
    key = _plan_key(a, b, bias, cfg, pad_rows) if a.is_cuda else None
    if key is not None:
        plan = _gemm_plan.PLANS.get(key)
        if plan is not None and plan.usable():
            return plan.run(a, b, bias, plan.out_shape, out), plan
    batches, m, k = a.shape
    n = b.shape[2]
    dtype = a.dtype
    if m == 0 or n == 0 or k == 0:
        zeros = torch.zeros(batches, m, n, dtype=dtype, device=a.device)
        zeros = zeros if bias is None or zeros.numel() == 0 else zeros + bias.to(dtype)
        return (zeros if out is None else out.copy_(zeros)), None
    explicit = cfg is not None
    if cfg is None:
        cfg, pad = _select(m, n, k, dtype, a.device, b_layout(b), b, batches)
        pad_rows = pad_rows or pad
    out = torch.empty(batches, m, n, dtype=dtype, device=a.device) if out is None else out
    # a choice made while a CUDA graph is captured may be provisional (_select): not remembered
    remembered = key is not None and (explicit or not _capturing(a.device))
    if cfg.tail is not None:
        return out, _row_split(a, b, bias, cfg, out, key if remembered else None)
    family = None
    if remembered and batches == 1 and not pad_rows:
        family = _gemm_plan.family_key(key, cfg, persistent_at(cfg, m, n, 1, a.device.index))
        plan = _gemm_plan.for_rows(key, family, m)  # a plan made at another M of the same family
        if plan is not None and plan.usable():
            return plan.run(a, b, bias, plan.out_shape, out), plan
    launched = launch_config(a, b, bias, cfg, pad_rows, out)
    if remembered and launched is not None:
        return out, _gemm_plan.remember(key, launched, dtype, a.device, family)
    return out, None


def _row_split(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, cfg: MMConfig, out: torch.Tensor,
               key: tuple | None) -> _gemm_plan.RowSplitPlan | None:
    """A row-split config (_gemm_config.row_parts): each part a gemm call of its own rows into its
    rows of `out`, through that part's launch plan when it has one; `key`: remember the parts'
    plans as this call's plan, returned (None: not)."""
    batches, m, k = a.shape
    if batches != 1:
        raise ValueError(f"a row-split config runs one batch entry, got {batches}")
    parts = []
    for lo, hi, part in row_parts(m, b.shape[2], cfg, num_sms(device_index(a))):
        rows_a, rows_out = row_views(a, out, lo, hi)
        parts.append((lo, hi, _gemm(rows_a, b, bias, part, pads_rows(hi - lo, part), rows_out)[1]))
    return None if key is None else _gemm_plan.remember_row_split(key, parts, tuple(out.shape), k, a.dtype, a.device)


def _plan_key(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, cfg: MMConfig | None,
              pad_rows: bool) -> tuple:
    """Everything gemm's choices and Triton's specialization read, except values of A and B."""
    return (a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.get_device(), a.data_ptr() % 16, b.data_ptr() % 16,
            None if bias is None else (bias.dtype, bias.data_ptr() % 16), cfg, pad_rows,
            _ladder_switch())


def _check_pair(a: torch.Tensor, b: torch.Tensor, names: tuple[str, str]) -> None:
    for name, t in zip(names, (a, b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, bfloat16, float16")
        check_runnable(name, t)
    if a.dtype != b.dtype:
        raise TypeError(f"{names[0]} ({a.dtype}) and {names[1]} ({b.dtype}) must share one dtype")
    if a.device != b.device:
        raise ValueError(f"{names[0]} is on {a.device} but {names[1]} is on {b.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [*, C] -> [R, C] with R counted, not inferred: reshape(-1, 0) of an empty tensor is ambiguous."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def _records_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# The backward GEMMs of matmul / linear / bmm run cuBLAS: gradients must be deterministic, not
# batch-invariant (no contract compares a gradient across batch sizes), and cuBLAS gives the same
# bits for the same shapes, strides and alignment on one GPU model without copying a transposed
# operand. Every host of a gradient comparison issues the same calls (the same per-leaf shapes at
# every TP size), so they agree. The leaves' backward (linear_leaves, weight_leaves) is the
# exception: one Triton launch for all of a call's leaves, where cuBLAS took a launch (and a copy)
# per leaf, each leaf's bits independent of how many leaves the call holds.
class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a2, b):
        ctx.save_for_backward(a2, b)
        return gemm(a2[None], b[None])[0]

    @staticmethod
    def backward(ctx, grad):
        a2, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = torch.mm(grad, b.t()) if ctx.needs_input_grad[0] else None
        grad_b = torch.mm(a2.t(), grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias):
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return gemm(x2[None], weight.t()[None], bias)[0]

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch.mm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = torch.mm(grad.t(), x2) if ctx.needs_input_grad[1] else None
        grad_b = grad.float().sum(0).to(grad.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class _Bmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return gemm(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = torch.bmm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        grad_b = torch.bmm(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [*, K] x b [K, N] -> [*, N]."""
    _check_pair(a, b, ("a", "b"))
    if a.dim() < 1 or b.dim() != 2:
        raise ValueError(f"matmul takes a [*, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"b: K is {b.shape[0]} but a.shape[-1] is {a.shape[-1]}")
    a2 = _rows(a)
    out = _Matmul.apply(a2, b) if _records_grad(a, b) else gemm(a2[None], b[None])[0]
    return out.reshape(*a.shape[:-1], b.shape[1])


def _linear_key(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """Every property linear's argument checks and gemm's plan key read (device as an index)."""
    return (x.shape, x.stride(), weight.shape, weight.stride(), x.dtype, weight.dtype, x.get_device(),
            weight.get_device(), x.data_ptr() % 16, weight.data_ptr() % 16,
            None if bias is None else (bias.shape, bias.dtype, bias.get_device(), bias.data_ptr() % 16),
            _ladder_switch())


def _plannable(x: torch.Tensor, weight, bias) -> bool:
    """Whether a call may take a launch plan: tensor operands and nothing for autograd to record
    (written out: a generator over the operands costs ~0.5 us a call)."""
    if not isinstance(weight, torch.Tensor):
        return False
    if bias is not None and not isinstance(bias, torch.Tensor):
        return False
    return not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad
                                               or (bias is not None and bias.requires_grad))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [*, in], weight [out, in], bias [out] | None -> [*, out]; bias added after rounding.

    Without autograd, a 2-D x whose key (_linear_key) was seen before passed these checks then:
    it goes straight to that call's launch plan."""
    if x.dim() == 2 and _plannable(x, weight, bias):
        key = _linear_key(x, weight, bias)
        plan = _gemm_plan.PLANS.get(key)
        if plan is not None and plan.usable():
            return plan.run(x, weight, bias, plan.out_2d)
    _check_pair(x, weight, ("x", "weight"))
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [out, in={x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}")
    if bias is not None:
        _check_pair(x, bias, ("x", "bias"))
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    x2 = _rows(x) if x.dim() != 2 else x
    if _records_grad(x, weight, bias):
        out = _Linear.apply(x2, weight, bias)
    else:  # the Function's forward without autograd's bookkeeping (~5 us of host time a call)
        a, b = x2[None], weight.t()[None]
        out = gemm(a, b, bias)[0]
        if x.is_cuda and x.dim() == 2:
            _gemm_plan.alias(_linear_key(x, weight, bias), _plan_key(a, b, bias, None, False))
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.shape[0])


def _leaf_gemm(x2: torch.Tensor, weight: torch.Tensor, count: int) -> torch.Tensor:
    """x2 [M, K] @ weight [count * n, K]^T in one launch with the config a [n, K] leaf alone takes
    (its fixed tile, or the ladder rung that the shape's self-check proved equal to it): a column's
    bits come from its own weight row in that config's K order, whichever tile holds the column."""
    (m, k), n = x2.shape, weight.shape[0] // count
    a, b = x2[None], weight.t()[None]
    if m == 0 or k == 0 or n == 0:  # no product to order
        return gemm(a, b)[0]
    cfg, pad = _select(m, n, k, x2.dtype, x2.device, b_layout(b), b[:, :, :n])
    return gemm(a, b, cfg=cfg, pad_rows=pad)[0]


class _LinearLeaves(torch.autograd.Function):
    """The forward in one launch; the backward in one launch per gradient (see _leaf_grad_xs and
    _rows_grad), each leaf's gradient with bits that do not depend on how many leaves the call
    holds: a TP rank holding some leaves gets the bits of the whole model's call."""

    @staticmethod
    def forward(ctx, weight, *xs):
        x2 = xs[0]
        ctx.save_for_backward(x2, weight)
        return _leaf_gemm(x2, weight, len(xs))

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        count = len(ctx.needs_input_grad) - 1
        grad = grad.reshape(x2.shape[0], weight.shape[0])
        grad_xs = [None] * count
        if any(ctx.needs_input_grad[1:]):
            gx = _leaf_grad_xs(grad, weight, count)
            grad_xs = [gx[g] if need else None for g, need in enumerate(ctx.needs_input_grad[1:])]
        grad_w = _rows_grad(grad, x2, weight.shape[0] // count) if ctx.needs_input_grad[0] else None
        return (grad_w, *grad_xs)


def _leaf_grad_xs(grad: torch.Tensor, weight: torch.Tensor, count: int) -> torch.Tensor:
    """grad [M, count * n], weight [count * n, K] -> [count, M, K]: leaf g's grad[:, g] @ weight_g,
    one batched launch whose config comes from the leaf's (n, K) alone (a batch entry's tiles never
    see another entry), so a leaf's bits do not depend on how many leaves there are."""
    (m, total), k = grad.shape, weight.shape[1]
    n = total // count
    return gemm(grad.view(m, count, n).transpose(0, 1), weight.view(count, n, k), cfg=config_for(k, n, grad.dtype))


def _rows_grad(grad: torch.Tensor, x2: torch.Tensor, n: int) -> torch.Tensor:
    """The weight gradient grad^T @ x2 ([N, M] @ [M, K] -> [N, K]) as (x2^T @ grad)^T, one launch with
    the config of an n-column leaf: output column j (weight row j) sums over the M rows in that
    config's K order from grad's column j alone, whichever tile holds it, so each leaf of n weight
    rows has bits that do not depend on how many leaves the call holds."""
    g = grad if grad.stride(1) == 1 else grad.contiguous()
    return gemm(x2.t()[None], g[None], cfg=config_for(n, x2.shape[0], grad.dtype))[0].t()


def linear_leaves(xs: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """xs: one alias of x [*, in] per output leaf (collectives.fan_out's), weight [leaves * n, in]
    -> [*, leaves * n] with the bits of torch.cat([linear(xs[g], weight.chunk(leaves)[g])], -1) from
    one GEMM launch instead of one per leaf; the backward as _LinearLeaves says."""
    x = xs[0]
    _check_pair(x, weight, ("x", "weight"))
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or weight.shape[0] % len(xs):
        raise ValueError(f"weight must be [leaves={len(xs)} x out, in={x.shape[-1] if x.dim() else '?'}], "
                         f"got {tuple(weight.shape)}")
    x2s = [_rows(xc) for xc in xs]
    if _records_grad(weight, *xs):
        out = _LinearLeaves.apply(weight, *x2s)
    else:
        out = _leaf_gemm(x2s[0], weight, len(xs))
    return out.reshape(*x.shape[:-1], weight.shape[0])


class _WeightLeaves(torch.autograd.Function):
    """x's leaves along one dimension, each times its own alias of one weight (fan_out's): the
    forward in one launch (a row's result never depends on the other rows); the backward in one
    launch for x's gradient (every leaf's rows in one GEMM: rows are batch-invariant) and one for
    every alias's weight gradient (a batched GEMM over the leaves, its config from one leaf's
    shape), so each leaf's gradients have bits that do not depend on how many leaves there are."""

    @staticmethod
    def forward(ctx, dim, transposed, x, *weights):
        w = weights[0]
        ctx.dim, ctx.transposed = dim, transposed
        ctx.save_for_backward(x, w)
        b = w.t() if transposed else w  # [K, N]
        out = gemm(_rows(x)[None], b[None])[0]
        return out.reshape(*x.shape[:-1], b.shape[1])

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        count = len(ctx.needs_input_grad) - 3
        need_x, need_w = ctx.needs_input_grad[2], any(ctx.needs_input_grad[3:])
        b = w.t() if ctx.transposed else w  # the forward's [K, N]
        k, n = b.shape
        grad_x = grad_ws = None
        if need_x:
            g2 = _rows(grad)
            grad_x = gemm(g2[None], b.t()[None], cfg=config_for(k, n, grad.dtype))[0].reshape(x.shape)
        if need_w:
            xs, gs = _by_leaf(x, count, ctx.dim), _by_leaf(grad, count, ctx.dim)  # [count, R, K], [count, R, N]
            rows = xs.shape[1]
            if ctx.transposed:  # linear: w [N, K]: g^T @ x per leaf
                grad_ws = gemm(gs.transpose(1, 2), xs, cfg=config_for(k, rows, grad.dtype))
            else:  # matmul: w [K, N]: x^T @ g per leaf
                grad_ws = gemm(xs.transpose(1, 2), gs, cfg=config_for(n, rows, grad.dtype))
        return (None, None, grad_x,
                *(grad_ws[g] if need else None for g, need in enumerate(ctx.needs_input_grad[3:])))


def _by_leaf(t: torch.Tensor, count: int, dim: int) -> torch.Tensor:
    """t [..., C] cut along `dim` into `count` leaves -> [count, R, C], each leaf's rows in the order
    leaf.reshape(-1, C) reads them (a view where t's layout allows, else one copy)."""
    shape = t.shape
    split = (*shape[:dim], count, shape[dim] // count, *shape[dim + 1:])
    return t.reshape(split).movedim(dim, 0).reshape(count, -1, shape[-1])


def weight_leaves(x: torch.Tensor, weights: list[torch.Tensor], dim: int, transposed: bool) -> torch.Tensor:
    """x [..., K] cut along `dim` into len(weights) equal leaves, leaf g times weights[g] (aliases
    of one [K, N] weight, or [N, K] when `transposed`) -> [..., N]: the bits of the per-leaf
    matmul / linear calls concatenated along `dim` in one forward launch; the backward as
    _WeightLeaves says."""
    w = weights[0]
    _check_pair(x, w, ("x", "weight"))
    k = w.shape[1] if transposed else w.shape[0]
    if w.dim() != 2 or x.dim() < 2 or x.shape[-1] != k or x.shape[dim] % len(weights):
        raise ValueError(f"weight_leaves: x {tuple(x.shape)} (dim {dim} in {len(weights)} leaves) does not fit "
                         f"weight {tuple(w.shape)}{' (transposed)' if transposed else ''}")
    if _records_grad(x, *weights):
        return _WeightLeaves.apply(dim, transposed, x, *weights)
    b = w.t() if transposed else w
    return gemm(_rows(x)[None], b[None])[0].reshape(*x.shape[:-1], b.shape[1])


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] x b [B, K, N] -> [B, M, N]."""
    _check_pair(a, b, ("a", "b"))
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"bmm takes a [B, M, K] and b [B, K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    return _Bmm.apply(a, b) if _records_grad(a, b) else gemm(a, b)
