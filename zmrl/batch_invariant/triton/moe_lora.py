"""Routed experts with LoRA as grouped GEMMs: every expert in one launch per GEMM kind.

Per row (a token's slot routed to expert e), exactly the composed path's arithmetic
(zmrl.model.mlp / zmrl.lora: `linear(x, W_e) + linear(linear(x, A_e), B_e) * scale`):

    t1 = x A_gu[e]^T                  d1 = t1 B_gu[e]^T              (rows_forward, N = r, 2I)
    g  = x W_g[e]^T (+) d1[:I] * s    u  = x W_u[e]^T (+) d1[I:] * s  (one gated launch; each term
    h  = (silu(g) * u.float()).to(x.dtype)                            rounded as torch rounds it)
    t2 = h A_d[e]^T                   d2 = t2 B_d[e]^T
    y  = h W_d[e]^T (+) d2 * s

so the slot outputs equal the per-expert loop bit for bit, and with a zero adapter the fused
`moe_experts` kernel's. Without an adapter on one of the two weights its LoRA launches are skipped.

Backward (grouped, fixed order, no atomics; the base expert weights get a gradient, and its GEMM
runs, only when they require one):

    dt2 = s * dy B_d[e]               dh = dy W_d[e] + dt2 A_d[e]      (one accumulator)
    dg, du = silu's backward from the saved g, u                     (the same launch's epilogue)
    dt1 = s * [dg du] B_gu[e]         dx_row = [dg du] W_gu[e] + dt1 A_gu[e]   (fp32)
    dA, dB, dW: per expert, the sum over that expert's rows in ascending order (expert_wgrad)

A row's input gradient depends only on that row; each canonical expert leaf's alias of x gets the
sum of its token's rows in that leaf in slot order (fp32, one cast), and zmrl.batch_invariant.
collectives sums the leaves by the canonical tree, so EP sizes and batch compositions give the
same bits. Slots whose expert lies outside this host's leaves (expert parallel) are grouped under
a sentinel expert whose tiles never run, and their outputs are zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import INTERPRET, cdiv, check_runnable
from zmrl.batch_invariant.triton.grouped import expert_wgrad, rows_backward, rows_forward
from zmrl.batch_invariant.triton.matmul import config_for
from zmrl.batch_invariant.triton.moe import Groups


@triton.jit
def _leaf_sum_kernel(dx_ptr, pos_ptr, ids_ptr, out_ptr, T, D, TOPK, first_leaf, per_leaf, stride_dx,
                     BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    leaf_i = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    leaf = first_leaf + leaf_i
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(TOPK):  # slot order
        e = tl.load(ids_ptr + t * TOPK + j)
        inside = (e // per_leaf) == leaf
        p = tl.load(pos_ptr + t * TOPK + j)
        acc = acc + tl.load(dx_ptr + p * stride_dx + offs, mask=ok & inside, other=0.0)
    tl.store(out_ptr + (leaf_i * T + t) * D + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _leaf_sums(dxs, groups, ids, first_leaf, n_leaves, per_leaf, dtype):
    n, k = ids.shape
    d = dxs.shape[1]
    out = torch.empty(n_leaves, n, d, dtype=dtype, device=dxs.device)
    if out.numel() == 0:
        return out
    block_d = 128 if INTERPRET else 1024
    _leaf_sum_kernel[(n, n_leaves, cdiv(d, block_d))](
        dxs, groups.pos.contiguous(), ids.contiguous(), out, n, d, k, first_leaf, per_leaf, dxs.stride(0),
        BLOCK_D=block_d, num_warps=4,
    )
    return out


def _forward_rows(xs, gate_up, down, lora_gu, lora_d, scale, groups, keep):
    """-> (y [rows, D], (t1, gu, h, t2) for the backward, or None when not `keep`)."""
    inter = down.shape[2]
    wg, wu = gate_up[:, :inter], gate_up[:, inter:]
    t1 = t2 = None
    if lora_gu is not None:
        t1 = rows_forward(xs, lora_gu[0], groups)
        d1 = rows_forward(t1, lora_gu[1], groups)
        h = rows_forward(xs, wg, groups, w2=wu, delta=d1[:, :inter], delta2=d1[:, inter:], scale=scale,
                         store_gu=keep)
    else:
        h = rows_forward(xs, wg, groups, w2=wu, store_gu=keep)
    h, gu = h if keep else (h, None)
    if lora_d is not None:
        t2 = rows_forward(h, lora_d[0], groups)
        y = rows_forward(h, down, groups, delta=rows_forward(t2, lora_d[1], groups), scale=scale)
    else:
        y = rows_forward(h, down, groups)
    return y, (t1, gu, h, t2) if keep else None


class _GroupedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, ids, gate_up, down, a_gu, b_gu, a_d, b_d, *x_leaves):
        scale, first_leaf, per_leaf, first_expert, keep, all_local = spec
        x = x_leaves[0]
        n, k = ids.shape
        num_experts, _, d = gate_up.shape
        lo, hi = first_leaf * per_leaf, (first_leaf + len(x_leaves)) * per_leaf
        local = (ids >= lo) & (ids < hi)
        block_m = config_for(down.shape[2], d, x.dtype).block_m
        groups = Groups(torch.where(local, ids - first_expert, num_experts), num_experts + 1, block_m,
                        real_experts=num_experts)
        xs = x[groups.src_rows]
        lora_gu = (a_gu, b_gu) if a_gu is not None else None
        lora_d = (a_d, b_d) if a_d is not None else None
        y, saved = _forward_rows(xs, gate_up, down, lora_gu, lora_d, scale, groups, keep)
        slot_out = y[groups.pos].view(n, k, d).float()
        # another host's slots were grouped last and no tile wrote their rows: zeros, never the
        # uninitialized rows (whether there are any comes from the model's leaf count: a rank's
        # stacked weights alone cannot tell experts 0 ... E - 1 of more than E from all of them)
        if not all_local:
            slot_out = torch.where(local[..., None], slot_out, 0.0)
        if keep:
            ctx.save_for_backward(ids, x, gate_up, down, a_gu, b_gu, a_d, b_d, *saved)
        ctx.groups, ctx.spec, ctx.leaves = groups, spec, len(x_leaves)
        return slot_out

    @staticmethod
    def backward(ctx, d_slot):
        ids, x, gate_up, down, a_gu, b_gu, a_d, b_d, t1, gu, h, t2 = ctx.saved_tensors
        groups, (scale, first_leaf, per_leaf, _, _, _) = ctx.groups, ctx.spec
        needs = ctx.needs_input_grad
        n, k = ids.shape
        num_experts = gate_up.shape[0]
        dtype = x.dtype
        dy = d_slot.reshape(n * k, -1)[groups.order].to(dtype).contiguous()
        xs = x[groups.src_rows]
        dt2 = rows_backward(dy, b_d, groups, alpha=scale) if a_d is not None else None
        dgu = rows_backward(dy, down, groups, a2=dt2, w2=a_d, gu=gu)
        dt1 = rows_backward(dgu, b_gu, groups, alpha=scale) if a_gu is not None else None
        wgrad = lambda p, q, alpha=1.0: expert_wgrad(p, q, groups, num_experts, alpha)  # noqa: E731
        grads = [
            wgrad(dgu, xs) if needs[2] else None,
            wgrad(dy, h) if needs[3] else None,
            wgrad(dt1, xs) if a_gu is not None and needs[4] else None,
            wgrad(dgu, t1, scale) if a_gu is not None and needs[5] else None,
            wgrad(dt2, h) if a_d is not None and needs[6] else None,
            wgrad(dy, t2, scale) if a_d is not None and needs[7] else None,
        ]
        leaf_grads = [None] * ctx.leaves
        if any(needs[8:]):
            dxs = rows_backward(dgu, gate_up, groups, a2=dt1, w2=a_gu, out_dtype=torch.float32)
            leaf_grads = list(_leaf_sums(dxs, groups, ids, first_leaf, ctx.leaves, per_leaf, dtype).unbind(0))
        return (None, None, *grads, *leaf_grads)


def moe_expert_slots(x_leaves: list[torch.Tensor], expert_ids: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, lora_gate_up: tuple[torch.Tensor, torch.Tensor] | None,
                     lora_down: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
                     first_leaf: int, per_leaf: int, first_expert: int = 0, *, total_leaves: int) -> torch.Tensor:
    """The routed experts' per-slot outputs [T, k, D] fp32 (zeros for slots outside this host's
    leaves; total_leaves: the model's canonical expert leaves).
    x_leaves: one alias of x [T, D] per leaf this host holds (leaves first_leaf, ...; each
    leaf is `per_leaf` consecutive experts); expert_ids [T, k] ascending per token; gate_up
    [E, 2I, D] (gate rows first), down [E, D, I] hold experts first_expert ... first_expert + E - 1
    (which must cover this host's leaves); lora_gate_up (A [E, r, D], B [E, 2I, r]),
    lora_down (A [E, r, I], B [E, D, r]) or None; the delta is scaled by `scale`."""
    x = x_leaves[0]
    for name, t in (("x", x), ("expert_ids", expert_ids), ("gate_up", gate_up), ("down", down)):
        check_runnable(name, t)
    e, i2, d = gate_up.shape
    if x.dim() != 2 or d != x.shape[1] or i2 % 2 or down.shape != (e, d, i2 // 2):
        raise ValueError(f"need x [T, D], gate_up [E, 2I, D], down [E, D, I]; got {tuple(x.shape)}, "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise TypeError(f"expert weights must have x's dtype {x.dtype}")
    for name, pair, (n_in, n_out) in (("lora_gate_up", lora_gate_up, (d, i2)), ("lora_down", lora_down, (i2 // 2, d))):
        if pair is None:
            continue
        a, b = pair
        if a.dim() != 3 or a.shape[0] != e or a.shape[2] != n_in or b.shape != (e, n_out, a.shape[1]):
            raise ValueError(f"{name} must be (A [E, r, {n_in}], B [E, {n_out}, r]) with E = {e}, got "
                             f"{tuple(a.shape)}, {tuple(b.shape)}")
        if a.dtype != x.dtype or b.dtype != x.dtype:
            raise TypeError(f"{name} factors must have x's dtype {x.dtype}")
    a_gu, b_gu = lora_gate_up if lora_gate_up is not None else (None, None)
    a_d, b_d = lora_down if lora_down is not None else (None, None)
    if first_expert > first_leaf * per_leaf or first_expert + e < (first_leaf + len(x_leaves)) * per_leaf:
        raise ValueError(f"the expert weights hold experts [{first_expert}, {first_expert + e}), which must cover "
                         f"leaves {first_leaf} ... {first_leaf + len(x_leaves) - 1} of {per_leaf} experts each")
    ids = expert_ids.long()
    factors = [t for pair in (lora_gate_up, lora_down) if pair is not None for t in pair]
    # what the backward needs (g, u, h, t1, t2) is kept only where a backward can follow
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in [gate_up, down, *factors, *x_leaves])
    if first_leaf < 0 or first_leaf + len(x_leaves) > total_leaves:
        raise ValueError(f"leaves {first_leaf} ... {first_leaf + len(x_leaves) - 1} do not lie in the model's "
                         f"{total_leaves} expert leaves")
    all_local = first_leaf == 0 and len(x_leaves) == total_leaves
    spec = (float(scale), first_leaf, per_leaf, first_expert, keep, all_local)
    return _GroupedExperts.apply(spec, ids, gate_up, down, a_gu, b_gu, a_d, b_d, *x_leaves)
