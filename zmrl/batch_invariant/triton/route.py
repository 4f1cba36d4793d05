"""The MoE router's weights in one launch: the bits of `zmrl.batch_invariant.moe.route_weights_composed`
and of its autograd backward.

Forward, per row n, from the scores [N, E] fp32 and the chosen experts ids [N, k]:
    c_j = scores[n, ids[n, j]],  T = (((c_0 + c_1) + c_2) + ...) + c_{k-1},  w_j = (c_j / T) * scale
every add, the IEEE division (`tl.div_rn`) and the product rounded on its own in fp32 (hence
`NO_FP_FUSION`), the slots added one at a time in slot order: the same operations, in the same
order, as the gather, the k - 1 adds, the division and the multiply of the torch expression, so
the same bits. `scale` is a Python float that torch rounds to fp32 before multiplying; Triton
passes a float argument as fp32, rounded the same way.

Backward, what autograd computes through that expression, from the output's gradient g:
    g_q = g * scale                                       (MulBackward0: grad * other)
    g_T = sum_j g_q[n, j] * (-((c_j / T) / T))            (DivBackward0's `other` gradient,
                                                           -grad * ((self / other) / other), summed
                                                           to T's shape [N, 1] by torch's sum)
    g_c = g_q / T + g_T                                   (DivBackward0's `self` gradient, grad /
                                                           other, plus T's gradient reaching every
                                                           c_j through its select and the adds)
    grad_scores = zeros.scatter_add(1, ids, g_c)          (GatherBackward0)
The forward kernel stores -((c_j / T) / T) and T for it when a gradient is needed: negation is
exact and IEEE rounding is symmetric in sign, so g_q * (-r) has the bits of autograd's (-g_q) * r.
The row sum stays torch's `sum(1, keepdim=True)`, the reduction autograd runs for the broadcast,
so its order is torch's on every device. Autograd also adds the zeros the other selects scatter
into c_j's gradient; adding +0.0 changes nothing but the sign of a zero, and the final
scatter_add into zeros turns every -0.0 into +0.0 anyway. `ids` gets no gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant._paths import records_graph
from zmrl.batch_invariant.triton._common import cdiv, check_runnable, next_power_of_2
from zmrl.batch_invariant.triton._launch import keyed
from zmrl.batch_invariant.triton.elementwise import NO_FP_FUSION

_BLOCK_ROWS = 64


@triton.jit
def _chosen(s_row, e, ok, E, stride_se):
    """The scores of experts e in their rows; NaN where masked or where e is outside [0, E) (top-k's
    -1 padding), so a bad id shows as NaN weights instead of reading another row's memory."""
    return tl.load(s_row + e * stride_se, mask=ok & (e >= 0) & (e < E), other=float("nan"))


@triton.jit
def _route_weights_kernel(scores_ptr, ids_ptr, w_ptr, dq_ptr, total_ptr, N, E, TOPK, scale,
                          stride_sn, stride_se, stride_in, stride_ik,
                          BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SAVE: tl.constexpr):
    """w [N, TOPK] contiguous; SAVE: also dq = -((c / T) / T) [N, TOPK] and T [N]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < N
    s_row = scores_ptr + rows * stride_sn
    i_row = ids_ptr + rows * stride_in
    # T in slot order, one rounded add per slot: the composed loop's arithmetic
    total = _chosen(s_row, tl.load(i_row, mask=row_ok, other=0), row_ok, E, stride_se)
    for j in range(1, TOPK):
        e = tl.load(i_row + j * stride_ik, mask=row_ok, other=0)
        total = total + _chosen(s_row, e, row_ok, E, stride_se)
    slots = tl.arange(0, BLOCK_K)
    ok = row_ok[:, None] & (slots < TOPK)[None, :]
    e = tl.load(i_row[:, None] + slots[None, :] * stride_ik, mask=ok, other=0)
    c = _chosen(s_row[:, None], e, ok, E, stride_se)
    q = tl.div_rn(c, total[:, None])
    out = rows[:, None] * TOPK + slots[None, :]
    tl.store(w_ptr + out, q * scale, mask=ok)
    if SAVE:
        tl.store(dq_ptr + out, -tl.div_rn(q, total[:, None]), mask=ok)
        tl.store(total_ptr + rows, total, mask=row_ok)


def _launch(scores: torch.Tensor, ids: torch.Tensor, scale: float, save: bool):
    """-> (w [N, k], dq [N, k] | None, T [N] | None), all fp32 and contiguous."""
    n, k = ids.shape
    w = torch.empty(n, k, dtype=torch.float32, device=scores.device)
    dq = torch.empty_like(w) if save else None
    total = torch.empty(n, dtype=torch.float32, device=scores.device) if save else None
    if n == 0:
        return w, dq, total
    keyed(_route_weights_kernel, "moe_route_weights", num_warps=4, **NO_FP_FUSION)(
        (cdiv(n, _BLOCK_ROWS), 1),
        (scores, ids, w, w if dq is None else dq, w if total is None else total, n, scores.shape[1], k, scale,
         *scores.stride(), *ids.stride()),
        dict(BLOCK_ROWS=_BLOCK_ROWS, BLOCK_K=next_power_of_2(k), SAVE=save))
    return w, dq, total


class _RouteWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, ids, scale):
        w, dq, total = _launch(scores, ids, scale, save=True)
        ctx.save_for_backward(ids, dq, total)
        ctx.scale, ctx.num_experts = scale, scores.shape[1]
        return w

    @staticmethod
    def backward(ctx, grad):
        ids, dq, total = ctx.saved_tensors
        t = total[:, None]
        g_q = grad * ctx.scale  # the module docstring's formulas, op for op as autograd runs them
        g_c = g_q / t + (g_q * dq).sum(1, keepdim=True)
        grad_scores = torch.zeros(ids.shape[0], ctx.num_experts, dtype=torch.float32, device=ids.device)
        return grad_scores.scatter_add_(1, ids, g_c), None, None


def route_weights(scores: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """scores [N, E] fp32, ids [N, k] int64 (distinct per row, in [0, E)) -> weights [N, k] fp32:
    the chosen scores over their slot-order sum, times scale. Differentiable in scores."""
    check_runnable("scores", scores)
    n, e = scores.shape if scores.dim() == 2 else (-1, -1)
    if scores.dtype != torch.float32 or ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != n:
        raise ValueError(f"route_weights takes fp32 scores [N, E] and int64 ids [N, k], got "
                         f"{scores.dtype} {tuple(scores.shape)} and {ids.dtype} {tuple(ids.shape)}")
    if not 1 <= ids.shape[1] <= e:
        raise ValueError(f"ids must have 1 to {e} slots per row, got {ids.shape[1]}")
    scale = float(scale)
    if records_graph(scores):
        return _RouteWeights.apply(scores, ids, scale)
    return _launch(scores, ids, scale, save=False)[0]  # no graph: skip autograd.Function's host cost
