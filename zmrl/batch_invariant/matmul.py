"""Batch-invariant matmul, linear and bmm.

Contract (docs/design.md, "Matmul"): a row's result depends only on that row and the weight,
never on M, on the other rows, or on the row's position. fp32 accumulation; bf16 outputs
are rounded once from the fp32 accumulator (the GEMM's own epilogue).

CPU path (cpu_gemm.py picks per shape): rows cut into zero-padded [ROW_TILE, K] tiles, every
tile through a BLAS GEMM of exactly that shape (_tiles.py), where a self-check on first use shows
this machine's BLAS row-invariant at that shape; else the exact GEMM (exact_gemm.py), whose
result does not depend on the BLAS's reduction order at all. The backward's input gradient is a
row-invariant GEMM too and takes the same choice (for its own shape); the weight gradient only
needs to be deterministic. A call without autograd whose kind (shapes, strides, dtypes, mode,
threads) ran before skips straight to the GEMM its first call took (cpu_plans.py).
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant import cpu_gemm, cpu_grouped, cpu_plans
from zmrl.batch_invariant._checks import check_dim, check_float, check_same_device, check_same_dtype, check_size
from zmrl.batch_invariant._paths import path_for, records_graph, torch_ops, triton_ops


# ----------------------------------------------------------------------------- reference
def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] x [K, N]: each row alone, in fp32 (invariant by construction, slow)."""
    rows = [(row.float()[None, :] @ b.float()).to(a.dtype) for row in a]
    return torch.cat(rows) if rows else a.new_zeros(0, b.shape[1])


def bmm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack([matmul_reference(a[i], b[i]) for i in range(a.shape[0])])


# ----------------------------------------------------------------------------- CPU path
class _CpuMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return cpu_gemm.mm(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = cpu_gemm.mm(grad, b.t()) if ctx.needs_input_grad[0] else None
        grad_b = cpu_gemm.mm(a.t(), grad, row_invariant=False) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class _CpuBmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return cpu_gemm.bmm(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = cpu_gemm.bmm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        grad_b = cpu_gemm.bmm(a.transpose(1, 2), grad, row_invariant=False) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


# ----------------------------------------------------------------------------- public
def _straight_to_triton(t) -> bool:
    """A CUDA tensor on the Triton path: its call goes there before the CPU path's plan probe and
    checks (~2 us of host time, against ~12-17 us for a whole planned GEMM call); the Triton path
    checks the arguments itself. A CPU tensor forced onto Triton (the interpreter) keeps them."""
    return isinstance(t, torch.Tensor) and t.is_cuda and path_for(t) == "triton"


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[*, K] x [K, N] -> [*, N], batch-invariant in every leading row."""
    if _straight_to_triton(a):
        return triton_ops().matmul(a, b)
    kind = cpu_plans.call_kind("matmul", a, b)
    plan = cpu_plans.lookup(kind)
    if plan is not None:
        return plan.matmul(a, b)
    check_float("a", a)
    check_float("b", b)
    check_same_dtype(a=a, b=b)
    check_same_device(a=a, b=b)
    if a.dim() < 1:
        raise ValueError(f"a must have at least 1 dimension [*, K], got shape {tuple(a.shape)}")
    check_dim("b", b, 2, "[K, N]")
    check_size("b", b.shape[0], a.shape[-1], "K (b.shape[0]) vs a.shape[-1]")
    lead = a.shape[:-1]
    a2 = a.reshape(lead.numel(), a.shape[-1])
    path = path_for(a)
    if path == "triton":
        out = triton_ops().matmul(a2, b)
    elif path == "torch":
        out = torch_ops().matmul(a2, b)
    elif path == "reference":
        out = matmul_reference(a2, b)
    elif records_graph(a2, b):
        out = _CpuMatmul.apply(a2, b)
    else:
        route = cpu_gemm.mm_route(a2, b)
        out = cpu_gemm.run_mm(route, a2, b)
        cpu_plans.record(kind, cpu_plans.MatmulPlan(a, b.shape[1], route))
    return out.reshape(*lead, b.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias), weight [out, in] as in torch. The bias is added after the GEMM,
    in the output dtype, at one fixed point (never fused into the accumulator)."""
    if _straight_to_triton(x):
        return triton_ops().linear(x, weight, bias)
    kind = cpu_plans.call_kind("linear", x, weight, bias)
    plan = cpu_plans.lookup(kind)
    if plan is not None:
        return plan.linear(x, weight, bias)
    check_float("x", x)
    check_float("weight", weight)
    check_dim("weight", weight, 2, "[out, in]")
    if bias is not None:
        check_float("bias", bias)
        check_dim("bias", bias, 1, "[out]")
        check_size("bias", bias.shape[0], weight.shape[0], "length vs weight.shape[0]")
    path = path_for(x)
    if path == "triton":
        return triton_ops().linear(x, weight, bias)
    if path == "torch":
        return torch_ops().linear(x, weight, bias)
    y = matmul(x, weight.t())
    if kind is not None:
        # the matmul just ran (and planned) the GEMM of this linear: its plan serves the linear too
        gemm_plan = cpu_plans.lookup(cpu_plans.call_kind("matmul", x, weight.t()))
        if gemm_plan is not None:
            cpu_plans.record(kind, gemm_plan)
    return y if bias is None else y + bias


def linear_leaves(xs: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """xs: one alias of x [*, in] per output leaf (collectives.fan_out makes them, so each leaf's
    input gradient reaches its own alias), weight [leaves * n, in] -> [*, leaves * n]: the bits of
    torch.cat([linear(xs[g], weight.chunk(leaves)[g]) for g], -1) in the forward. On CUDA one GEMM
    launch with the leaf's own tile config, and a launch per gradient whose leaf bits do not depend
    on how many leaves the call holds (not cuBLAS's per-leaf bits); elsewhere a call per leaf,
    forward and backward (a CPU BLAS call's bits may follow its N), or, for a decode step's few
    rows without autograd, one bmm over the leaves with each leaf call's bits (cpu_grouped.py)."""
    if not xs:
        raise ValueError("xs must hold one alias of x per leaf, got none")
    if path_for(xs[0]) == "triton":
        return triton_ops().linear_leaves(xs, weight)
    if weight.dim() != 2 or weight.shape[0] % len(xs):
        raise ValueError(f"weight must be [leaves={len(xs)} x out, in], got {tuple(weight.shape)}")
    chunks = weight.chunk(len(xs), 0)
    grouped = cpu_grouped.leaf_products(xs, chunks)  # a decode step's few rows: one bmm, the same bits
    if grouped is not None:  # [leaves, *, n] -> [*, leaves * n]
        return grouped.movedim(0, -2).reshape(*grouped.shape[1:-1], -1)
    parts = [linear(xc, wc) for xc, wc in zip(xs, chunks)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


def weight_leaves(x: torch.Tensor, weights: list[torch.Tensor], dim: int, transposed: bool = False) -> torch.Tensor:
    """x [..., K] cut along `dim` into len(weights) equal leaves, leaf g times weights[g]: one
    alias per leaf of one weight [K, N] (`matmul`), or [N, K] with `transposed` (`linear`), as
    collectives.fan_out makes them, so each leaf's weight gradient reaches its own alias -> [..., N]:
    the bits of torch.cat([matmul / linear(leaf g, weights[g])], dim) in the forward. On CUDA the
    forward is one GEMM launch and each gradient one launch, a leaf's gradient bits independent of
    how many leaves there are; elsewhere a call per leaf, forward and backward."""
    if not weights:
        raise ValueError("weights must hold one alias of the weight per leaf, got none")
    if x.dim() < 2 or x.shape[dim] % len(weights):
        raise ValueError(f"x {tuple(x.shape)}: dim {dim} does not split into {len(weights)} equal leaves")
    if path_for(x) == "triton":
        return triton_ops().weight_leaves(x, weights, dim, transposed)
    parts = [linear(xc, w) if transposed else matmul(xc, w) for xc, w in zip(x.chunk(len(weights), dim), weights)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B, M, K] x [B, K, N] -> [B, M, N], invariant in M and in B."""
    if _straight_to_triton(a):
        return triton_ops().bmm(a, b)
    kind = cpu_plans.call_kind("bmm", a, b)
    plan = cpu_plans.lookup(kind)
    if plan is not None:
        return plan.bmm(a, b)
    check_float("a", a)
    check_float("b", b)
    check_same_dtype(a=a, b=b)
    check_same_device(a=a, b=b)
    check_dim("a", a, 3, "[B, M, K]")
    check_dim("b", b, 3, "[B, K, N]")
    check_size("b", b.shape[0], a.shape[0], "batch size vs a")
    check_size("b", b.shape[1], a.shape[2], "K (b.shape[1]) vs a.shape[2]")
    path = path_for(a)
    if path in ("triton", "torch"):
        return (triton_ops() if path == "triton" else torch_ops()).bmm(a, b)
    if path == "reference":
        return bmm_reference(a, b)
    if records_graph(a, b):
        return _CpuBmm.apply(a, b)
    route = cpu_gemm.bmm_route(a, b)
    out = cpu_gemm.run_bmm(route, a, b)
    cpu_plans.record(kind, cpu_plans.BmmPlan(route))
    return out
