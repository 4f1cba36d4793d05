"""Planned CPU GEMM calls: a repeated call of one kind goes straight to the GEMM.

A decode step makes ~190 small GEMM calls of a few dozen kinds, and the Python around each one
(argument checks, the path and mode lookups, the self-check's decision, B's layout, the tile for
the row count) cost more than the GEMM itself. All of that depends only on the call's *kind*:
the operands' shapes, strides, dtypes and devices, the forced path and GEMM mode, and the thread
count. So the first call of a kind runs the full path, and where it ends in the CPU GEMM without
autograd it records a plan: the route the full path took (cpu_gemm.mm_route: exact, or tiles of
so many rows) and the reshapes around it. A later call of the same kind finds the plan by one
dict lookup and runs the same GEMM on the same operands (cpu_gemm.run_mm), so it has the full
path's bits by construction. No argument check is skipped that the call could fail: the checks
read nothing but the kind, which passed them on its first call.

Calls that autograd records, non-CPU paths and operands that are not tensors always take the
full path. Plans are forgotten with the self-check's decisions (cpu_gemm.reset_decisions), and
all at once when there are MAX_PLANS of them (the row count is part of a kind, and a serving
engine's prefill chunks come in many sizes).
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant import cpu_gemm
from zmrl.batch_invariant._paths import forced_path

MAX_PLANS = 4096

_PLANS: dict[tuple, object] = {}


def forget() -> None:
    """Drop every plan (the decisions they were made from changed)."""
    _PLANS.clear()


def count() -> int:
    return len(_PLANS)


def call_kind(op: str, a, b, bias=None) -> tuple | None:
    """What a CPU GEMM call's full path depends on besides the values, or None where the call
    must take the full path (another path, a recorded graph, an operand that is not a tensor)."""
    forced = forced_path()
    if forced not in (None, "cpu") or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    if forced is None and a.is_cuda:
        return None  # the Triton path, with launch plans of its own
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    try:
        mode = cpu_gemm.gemm_mode()
    except ValueError:
        return None  # a bad ZMRL_CPU_GEMM: the full path raises it where it applies
    if bias is None:
        bias_kind = None
    elif isinstance(bias, torch.Tensor):
        bias_kind = (bias.shape, bias.stride(), bias.dtype, bias.device)
    else:
        return None
    return (op, forced, mode, torch.get_num_threads(), a.shape, a.stride(), a.dtype, a.device,
            b.shape, b.stride(), b.dtype, b.device, bias_kind)


def lookup(kind: tuple | None):
    return None if kind is None else _PLANS.get(kind)


def record(kind: tuple | None, plan) -> None:
    if kind is None:
        return
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[kind] = plan


class MatmulPlan:
    """a [*, K] x b [K, N] (linear: b = weight.t(), then the bias) along a recorded route."""

    __slots__ = ("rows", "k", "out_shape", "route", "flat", "gemm")

    def __init__(self, a: torch.Tensor, n: int, route: cpu_gemm.Route):
        self.rows, self.k = a.shape[:-1].numel(), a.shape[-1]
        self.out_shape = (*a.shape[:-1], n)
        self.flat = a.dim() == 2  # [M, K] already: the full path's reshapes are no-ops
        self.route = route
        self.gemm = cpu_gemm.mm_for_rows(route, self.rows)  # run_mm(route, ., .) for these rows

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.flat:
            return self.gemm(a, b)
        return self.gemm(a.reshape(self.rows, self.k), b).reshape(self.out_shape)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.matmul(x, weight.t())
        return y if bias is None else y + bias


class BmmPlan:
    """a [B, M, K] x b [B, K, N] along a recorded route."""

    __slots__ = ("route",)

    def __init__(self, route: cpu_gemm.Route):
        self.route = route

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.run_bmm(self.route, a, b)
