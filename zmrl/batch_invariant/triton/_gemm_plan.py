"""Launch plans for the GEMM: repeat a call seen before with only the addresses changed.

An eager GEMM call used to spend ~80 us of host time before its kernel started (config
selection, argument preparation, three TensorDescriptor objects, Triton's JIT binding, a
CUtensorMap per descriptor). The first call of a kind (shapes, strides, dtype, device, 16-byte
alignment of each operand, bias dtype, explicit config, ladder switch: matmul.gemm's key) runs
the full path; that path records what it launched (`Launched`: the tile config it selected, the
descriptors' shapes and strides, the integer and constexpr arguments, the compiled kernels).
Every later call with the same key launches exactly that again through _launch.DirectKernel,
with the new operands' addresses. The key holds every input of the selection and of Triton's
specialization, so the plan launches the same compiled kernel with the same arguments as the
full path would: the tile config and the K order, hence the bits, are the same.

An operand the first call had to copy (a transposed view, unaligned columns, K padded between
batch entries) is copied again by the plan with the same function before the launch.

Not planned (these calls keep the full path): the interpreter, rows padded to a tile with an
operand that needed a copy, an output whose rows are not 16-byte multiples, calls made while a
CUDA graph is being captured with the ladder still undecided, Triton launch hooks (profilers), a
Triton whose launcher this does not know.

A new row count M reuses a plan too. A trainer's minibatches and a rollout's prefills rarely
repeat a token count, so plans keyed by the exact M alone would almost never be hit outside a
benchmark that repeats one batch. M is not a specialization of the compiled kernel (its
`do_not_specialize`), so a plan made at one M serves every M at which the call would select the
same tile config and the same persistence (the NUM_PROGS constexpr), for a single-batch GEMM
whose rows are read in place, unpadded and without split-K workspace: `Plan.at_rows` derives
what the full path computes from M (the M argument, the output's batch stride, the descriptors'
row counts, the grid). A row family's key is the exact key without M plus that config and
persistence (`family_key`); the derived plan is then remembered under the exact key as well.

A row-split call (two launches over one output, _gemm_config.row_parts) is planned per part, each
part a call of its own rows with an explicit config (so a new M reaches each part's row family);
its exact key then holds a RowSplitPlan that runs the parts' plans.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from zmrl.batch_invariant.triton import _workspace
from zmrl.batch_invariant.triton._common import cdiv
from zmrl.batch_invariant.triton._launch import DirectKernel, current_stream, hooks_installed
from zmrl.batch_invariant.triton._splitk import SUM_BLOCK

ONE_PASS = 1 << 30  # NUM_PROGS when every program computes one tile (_gemm_kernel's loop stride)

PLANS: dict[tuple, Plan | None] = {}
FAMILIES: dict[tuple, Plan] = {}  # family_key -> a plan of that row family (any M)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_PLANS_MAX = 16384  # distinct call shapes kept (a new M is a new key); cleared when full


@dataclasses.dataclass
class Launched:
    """What _gemm_kernel.launch_config launched, minus the tensors' addresses."""
    direct: bool  # the operands were used in place (a plan can repeat this)
    main: object  # the compiled _mm_kernel
    total: object | None  # the compiled _splitk_sum (split-K only)
    device_index: int
    splits: int  # K ranges reduced by separate programs (1: no workspace, no sum kernel)
    progs: int
    ints: tuple  # M, N, K, k_chunk, b_batch_rows, num_batches, stride_cb, stride_cm
    consts: tuple  # the constexpr arguments, in the kernel's order
    pad_to: int  # rows A is zero-padded to (0: none)
    a_desc: tuple  # (shape, strides) of each descriptor's tensor
    b_desc: tuple
    c_desc: tuple
    out_shape: tuple
    prep_a: Callable | None = None  # a -> the copy of A the call made (None: A used in place)
    prep_b: Callable | None = None  # b [B, K, N] -> the copy of B the call made (None: B used in place)


class Plan:
    __slots__ = ("main", "total", "dev", "splits", "progs", "tail", "pad", "a_desc", "b_desc", "c_desc",
                 "out_shape", "out_2d", "ws_numel", "sum_grid", "sum_tail", "dtype", "device", "prep_a", "prep_b",
                 "any_rows")

    def __init__(self, launched: Launched, main: DirectKernel, total: DirectKernel | None, dtype, device):
        self.main, self.total = main, total
        self.dev = launched.device_index
        self.splits, self.progs = launched.splits, launched.progs
        self.tail = [*launched.ints, *launched.consts]
        m = launched.out_shape[1]
        self.pad = (0, 0, 0, launched.pad_to - m) if launched.pad_to else None
        self.a_desc, self.b_desc, self.c_desc = launched.a_desc, launched.b_desc, launched.c_desc
        self.out_shape = launched.out_shape
        self.out_2d = launched.out_shape[1:]
        ws_shape = launched.c_desc[0]  # the workspace's descriptor: [splits * B, M, N], contiguous
        self.ws_numel = ws_shape[0] * ws_shape[1] * ws_shape[2]
        numel = launched.out_shape[0] * launched.out_shape[1] * launched.out_shape[2]
        self.sum_grid = cdiv(numel, SUM_BLOCK)
        self.sum_tail = (numel, launched.out_shape[2], launched.splits, SUM_BLOCK)
        self.dtype, self.device = dtype, device
        self.prep_a, self.prep_b = launched.prep_a, launched.prep_b
        self.any_rows = _serves_any_rows(launched)

    def at_rows(self, m: int) -> "Plan":
        """This plan for a call of m rows in the same row family (family_key: same config and
        persistence): the M-dependent arguments as launch_config computes them for m."""
        if not self.any_rows:
            raise ValueError("this plan's launch depends on its row count (padded rows, batches or split-K)")
        p = object.__new__(Plan)
        for name in Plan.__slots__:
            setattr(p, name, getattr(self, name))
        n, k = self.out_shape[2], self.a_desc[0][1]
        # the constexprs follow the 8 integers in the kernel's order: BM, BN, BK, GROUP_M, NUM_PROGS, ..., SUB_N last
        bm, cols, num_progs = self.tail[8], self.tail[9] * self.tail[-1], self.tail[12]
        p.progs = num_progs if num_progs != ONE_PASS else cdiv(m, bm) * cdiv(n, cols)
        p.tail = [m, *self.tail[1:6], m * n, *self.tail[7:]]  # M and the output's batch stride M * N
        p.a_desc = ((m, k), self.a_desc[1])
        p.c_desc = ((1, m, n), (m * n, n, 1))
        p.out_shape, p.out_2d, p.ws_numel = (1, m, n), (m, n), m * n
        return p

    def usable(self) -> bool:
        return _current_device() == self.dev and not hooks_installed()

    def run(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_shape: tuple,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Launch with a's and b's addresses (a [1, M, K] or [M, K] when the plan pads rows;
        b: any view that starts at the operand's first element); out_shape: out_shape or out_2d;
        out: contiguous rows to write instead of a new tensor of out_shape."""
        if out is None:
            out = torch.empty(*out_shape, dtype=self.dtype, device=self.device)  # ~0.5 us less than a tuple
        a_rows = a if self.prep_a is None else self.prep_a(a)  # a copy lives until the launch is queued
        if self.prep_b is not None:
            b = self.prep_b(b)
        if self.pad is not None:  # kept alive until the launch is queued; the allocator is stream-ordered
            a_rows = torch.constant_pad_nd(a.view(a.shape[-2], a.shape[-1]), self.pad)
        split = self.splits > 1
        stream = current_stream(self.dev)
        dest = _workspace.workspace(self.ws_numel, self.device, self.dev, stream) if split else out
        dest_ptr = dest.data_ptr()
        bias_ptr = bias.data_ptr() if bias is not None and not split else dest_ptr
        mk = self.main
        args = mk.tensor_map(0, a_rows.data_ptr(), *self.a_desc)
        args += mk.tensor_map(1, b.data_ptr(), *self.b_desc)
        args += mk.tensor_map(2, dest_ptr, *self.c_desc)
        args += (dest_ptr, bias_ptr, *self.tail)
        mk.launch(self.progs, stream, args)
        if split:
            out_ptr = out.data_ptr()
            self.total.launch(self.sum_grid, stream, [dest_ptr, out_ptr, bias.data_ptr() if bias is not None else out_ptr,
                                                      *self.sum_tail, bias is not None])
        return out


class RowSplitPlan:
    """A row-split call (_gemm_config.row_parts) repeated: each part's plan writes its rows of one
    output, with the operands' addresses of this call."""
    __slots__ = ("parts", "out_shape", "out_2d", "dtype", "device", "k", "n", "prep_b")

    def __init__(self, parts: list[tuple[int, int, Plan]], out_shape: tuple, k: int, dtype, device):
        self.parts, self.out_shape, self.out_2d = parts, out_shape, out_shape[1:]
        self.k, self.n = k, out_shape[2]
        self.dtype, self.device = dtype, device
        self.prep_b = None  # every part reads B in place (remember_row_split)

    def usable(self) -> bool:
        return all(plan.usable() for _, _, plan in self.parts)

    def run(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_shape: tuple,
            out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(*out_shape, dtype=self.dtype, device=self.device)
        rows_a, rows_out = a.view(-1, self.k), out.view(-1, self.n)
        for lo, hi, plan in self.parts:
            plan.run(rows_a[lo:hi], b, bias, None, rows_out[lo:hi])
        return out


def remember_row_split(key: tuple, parts: list[tuple[int, int, Plan | None]], out_shape: tuple, k: int,
                       dtype: torch.dtype, device: torch.device) -> RowSplitPlan | None:
    """Remember a row-split call's plan (and return it): its parts' plans, where every part has one
    that reads A and B in place (else None: the call keeps the full path, its parts their plans)."""
    if not all(isinstance(plan, Plan) and plan.prep_a is None and plan.prep_b is None for _, _, plan in parts):
        return None
    if len(PLANS) >= _PLANS_MAX:
        PLANS.clear()
    plan = PLANS[key] = RowSplitPlan(parts, out_shape, k, dtype, device)
    return plan


def _serves_any_rows(launched: Launched) -> bool:
    """Whether the launch depends on M only through the values at_rows recomputes: one batch, A's
    rows read in place and unpadded, no split-K workspace, the output [1, M, N] contiguous."""
    _, m, n = launched.out_shape
    return (launched.direct and launched.splits == 1 and launched.pad_to == 0 and launched.prep_a is None
            and launched.out_shape[0] == 1 and launched.ints[5] == 1 and launched.a_desc[0][0] == m
            and launched.c_desc == ((1, m, n), (m * n, n, 1)) and launched.ints[0] == m)


def family_key(key: tuple, cfg, persistent: bool) -> tuple:
    """The row family of an exact key (matmul._plan_key, whose a.shape and a.stride() come first):
    the key without M, plus the config selected at this M and whether the launch is persistent."""
    a_shape, a_stride, *rest = key
    return (a_shape[0], a_shape[2], a_stride[1:], *rest, cfg, persistent)


def for_rows(key: tuple, family: tuple, m: int) -> Plan | None:
    """The family's plan derived for m rows (remembered under the exact key), or None."""
    plan = FAMILIES.get(family)
    if plan is None:
        return None
    plan = plan.at_rows(m)
    if len(PLANS) >= _PLANS_MAX:
        PLANS.clear()
    PLANS[key] = plan
    return plan


def remember(key: tuple, launched: Launched, dtype: torch.dtype, device: torch.device,
             family: tuple | None = None) -> Plan | None:
    """Build the plan for one key from its first (full-path) launch (and return it), or remember that
    there is none; `family`: this call's row family (family_key), which the plan then serves if it can."""
    plan = None
    if launched.direct:
        main = DirectKernel.make(launched.main, "gemm")
        total = DirectKernel.make(launched.total, "splitk_sum") if launched.splits > 1 else None
        if main is not None and (launched.splits == 1 or total is not None):
            plan = Plan(launched, main, total, dtype, device)
    if len(PLANS) >= _PLANS_MAX:
        PLANS.clear()
    PLANS[key] = plan
    if plan is not None and plan.any_rows and family is not None:
        FAMILIES[family] = plan
    return plan


def alias(key: tuple, gemm_key: tuple) -> None:
    """Let a caller's own key (linear's, on 2-D operands: its weight [N, K] is not the [B, K, N]
    view a copy of B is made from) reach the plan of the gemm call it made."""
    plan = PLANS.get(gemm_key, False)
    if plan is not False and (plan is None or plan.prep_b is None):
        PLANS[key] = plan


def clear() -> None:
    PLANS.clear()
    FAMILIES.clear()
    _workspace.release()
