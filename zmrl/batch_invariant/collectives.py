"""Reductions across tensor-parallel ranks whose bits do not depend on the number of ranks.

A sum that crosses ranks (a row-parallel GEMM's partial sums, the input gradient of a column-
parallel GEMM, the gradient of a tensor every head or expert reads) is written here as a sum over
a *canonical split* of the reduced dimension into `num_leaves(size)` leaves (8, the largest TP
supported, when the size allows), added by one fixed balanced tree:

    sum(leaves[0:8]) = ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))

Rank r of a TP group of size tp holds the contiguous leaves [r * 8/tp, (r + 1) * 8/tp): a whole
subtree. It adds its subtree, the ranks all-gather those partials (a tensor all-gather, whose
result is the same on every rank, in rank order), and every rank adds the gathered partials by the
top of the same tree. One process holding all eight leaves runs the identical additions, so TP = 1,
2, 4 and 8 give the same bits. A ring all-reduce, whose summation order follows the world size,
never runs here (except under `ordinary_all_reduce()`, the negative control and the benchmark
baseline: one local GEMM or sum per rank, then torch.distributed.all_reduce).

Leaves are summed in fp32 and cast once to the partials' dtype (on the Triton path a rank's
subtree is one launch of triton/leaf_tree.py, with the same additions).

`Shards` says which leaves this process holds (`LOCAL`: all of them, no process group). The
autograd functions:
    fan_out(x, leaves, shards)       -> this rank's copies of x, one per leaf; backward: the tree
                                        over every leaf's gradient (the gradient of a tensor that
                                        many heads, experts or output columns read)
    reduce_leaves(parts, shards)     -> the tree over every rank's parts; backward: identity
    column_linear / row_linear       -> zmrl.batch_invariant.linear over the canonical leaves of
                                        the output / input dimension
    all_gather / all_reduce_sum      -> the tensor collectives every zmrl cross-rank step uses; on
                                        a gloo group CUDA tensors go through host memory, so
                                        several ranks can share one GPU (NCCL refuses that)
    gather_last(x, shards)           -> every rank's x concatenated along the last dimension in rank
                                        order (a copy: exact); backward: this rank's slice
Imports torch, zmrl's linear and the path switch (torch.distributed at run time).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from zmrl.batch_invariant import cpu_grouped
from zmrl.batch_invariant._paths import path_for, triton_ops
from zmrl.batch_invariant.elementwise import add_scaled
from zmrl.batch_invariant.matmul import linear, linear_leaves

MAX_TP = 8
"""The largest tensor-parallel size: the canonical split has this many leaves where it can."""

_ordinary = False


def num_leaves(size: int) -> int:
    """Leaves of a dimension of `size`: gcd(MAX_TP, size), a power of two (8 for any multiple of 8).
    Every TP size that divides the dimension and MAX_TP divides this."""
    return math.gcd(MAX_TP, size)


@dataclass(frozen=True)
class Shards:
    """This process's place in a tensor-parallel group (a torch.distributed group or None)."""
    size: int = 1
    rank: int = 0
    group: object = None

    def local(self, leaves: int) -> range:
        """The leaves this rank holds (contiguous: a subtree of the canonical tree)."""
        if leaves % self.size:
            raise ValueError(f"{leaves} canonical leaves cannot be split over {self.size} ranks "
                             f"(the TP size must divide {MAX_TP} and every split dimension)")
        per = leaves // self.size
        return range(self.rank * per, (self.rank + 1) * per)


LOCAL = Shards()


@contextlib.contextmanager
def ordinary_all_reduce(on: bool = True):
    """Inside the block, cross-rank sums (over a group of more than one rank) are one local GEMM or
    sequential sum per rank, then torch.distributed.all_reduce: what Megatron does, and what makes
    TP = 2 differ from TP = 1. A group of one rank keeps the canonical form, so in a run whose TP
    group is one rank and whose EP group is several, only the expert-parallel sums change."""
    global _ordinary
    before, _ordinary = _ordinary, on
    try:
        yield
    finally:
        _ordinary = before


def set_ordinary_all_reduce(on: bool) -> None:
    """The switch of `ordinary_all_reduce` for a process driven from outside (a serving engine's
    worker, told by a call), which has no block to scope it: on until switched off."""
    global _ordinary
    _ordinary = bool(on)


def is_ordinary() -> bool:
    """Whether ordinary_all_reduce() is on (callers apply it to groups of more than one rank)."""
    return _ordinary


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The balanced tree over a power-of-two count of parts: sum(left half) + sum(right half)."""
    _check_pow2(len(parts))
    return parts[0] if len(parts) == 1 else _tree_rows(torch.stack(parts))


def _check_pow2(n: int) -> None:
    if n == 0 or n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two number of parts, got {n}")


def _tree_rows(stacked: torch.Tensor) -> torch.Tensor:
    """[n, ...] (n a power of two) -> [...]: each level adds rows 2i and 2i + 1, so one launch per
    level does what one add per pair did (elementwise adds of the same pairs: the same bits)."""
    while stacked.shape[0] > 1:
        stacked = stacked[0::2] + stacked[1::2]
    return stacked[0]


def _fp32_tree(parts: list[torch.Tensor]) -> torch.Tensor:
    """The tree over parts, each cast to fp32 (one stacking copy casts them all)."""
    _check_pow2(len(parts))
    if len(parts) == 1:
        return parts[0].float()
    out = parts[0].new_empty((len(parts), *parts[0].shape), dtype=torch.float32)
    return _tree_rows(torch.stack(parts, out=out))


def _via_host(t: torch.Tensor, group) -> bool:
    """Whether a collective on `t` goes through host memory: gloo on CUDA tensors (torch documents
    gloo's all-gather as CPU-only; ranks sharing one GPU rule out NCCL). The copies are exact."""
    import torch.distributed as dist

    return t.is_cuda and dist.get_backend(group) == "gloo"


def all_gather(t: torch.Tensor, group, size: int | None = None) -> list[torch.Tensor]:
    """Every rank's `t` (same shape and dtype on every rank), in rank order: a tensor all-gather."""
    import torch.distributed as dist

    size = dist.get_world_size(group) if size is None else size
    src = t.contiguous()
    if _via_host(src, group):
        out = [torch.empty_like(src, device="cpu") for _ in range(size)]
        dist.all_gather(out, src.cpu(), group=group)
        return [o.to(src.device) for o in out]
    out = [torch.empty_like(src) for _ in range(size)]
    dist.all_gather(out, src, group=group)
    return out


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """An ordinary all-reduce (sum) of a contiguous copy of `t`, returned (never in place on the
    caller's tensor): the order is the backend's, so only the negative control and Megatron's
    exact reductions (one nonzero term per element, e.g. the vocab-parallel embedding) use it."""
    import torch.distributed as dist

    if _via_host(t, group):
        out = t.cpu().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out.to(t.device)
    out = t.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _all_gather(t: torch.Tensor, shards: Shards) -> list[torch.Tensor]:
    return all_gather(t, shards.group, shards.size)


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shards):
        ctx.shards = shards
        return torch.cat(_all_gather(x, shards), -1)

    @staticmethod
    def backward(ctx, grad):
        # every rank computed the same downstream value from the gathered tensor: its gradient of
        # this rank's columns is already whole here
        return grad.chunk(ctx.shards.size, -1)[ctx.shards.rank], None


def gather_last(x: torch.Tensor, shards: Shards = LOCAL) -> torch.Tensor:
    """x [*, n] on every rank -> [*, n * size], the ranks' x side by side in rank order (a column-
    parallel output made whole, a row-parallel input gathered): copies, so the bits are exact."""
    if shards.size == 1:
        return x
    if not torch.is_grad_enabled() or not x.requires_grad:
        return torch.cat(_all_gather(x, shards), -1)
    return _GatherLast.apply(x, shards)


def reduce_across(local_parts: list[torch.Tensor], shards: Shards) -> torch.Tensor:
    """This rank's leaves (its subtree) -> the sum over every rank's leaves, in fp32, cast to the
    parts' dtype. Same bits on every rank and for every TP size (no autograd)."""
    dtype = local_parts[0].dtype
    if _ordinary and shards.size > 1:
        acc = local_parts[0].float()
        for p in local_parts[1:]:
            acc = acc + p.float()
        if shards.size > 1:
            acc = all_reduce_sum(acc, shards.group)  # never reduces into the caller's tensor
        return acc.to(dtype)
    if shards.size == 1:
        return _leaf_sum(local_parts, dtype)
    partial = _leaf_sum(local_parts, torch.float32)
    return tree_sum(_all_gather(partial, shards)).to(dtype)


def _leaf_sum(parts: list[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """_fp32_tree(parts) in out_dtype; on the Triton path one launch with the same additions."""
    if len(parts) > 1 and path_for(parts[0]) == "triton":
        _check_pow2(len(parts))
        return triton_ops().leaf_tree(parts, out_dtype)
    return _fp32_tree(parts).to(out_dtype)


class _FanOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, count, shards):
        ctx.shards = shards
        return tuple(x.view_as(x) for _ in range(count))

    @staticmethod
    def backward(ctx, *grads):
        return reduce_across(list(grads), ctx.shards), None, None


class _ReduceLeaves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shards, *parts):
        ctx.count = len(parts)
        return reduce_across(list(parts), shards)

    @staticmethod
    def backward(ctx, grad):
        return (None, *([grad] * ctx.count))


def fan_out(x: torch.Tensor, leaves: int, shards: Shards = LOCAL) -> list[torch.Tensor]:
    """x (the same on every rank) -> one alias of x per leaf this rank holds. The backward sums
    every leaf's gradient by the canonical tree (whole, and the same, on every rank)."""
    count = len(shards.local(leaves))
    if not torch.is_grad_enabled() or not x.requires_grad:
        return [x] * count
    return list(_FanOut.apply(x, count, shards))


def _copy(x: torch.Tensor, shards: Shards) -> torch.Tensor:
    """One alias of x whose gradient is summed over the ranks (Megatron's copy-to-region)."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return x
    return _FanOut.apply(x, 1, shards)[0]


def reduce_leaves(parts: list[torch.Tensor], shards: Shards = LOCAL) -> torch.Tensor:
    """This rank's leaf values (its share of a sum) -> the whole sum on every rank."""
    if not torch.is_grad_enabled() or not any(p.requires_grad for p in parts):
        return reduce_across(parts, shards)
    return _ReduceLeaves.apply(shards, *parts)


def column_linear(x: torch.Tensor, weight: torch.Tensor, leaves: int, shards: Shards = LOCAL,
                  lora: tuple[torch.Tensor, torch.Tensor] | None = None, scale: float = 0.0) -> torch.Tensor:
    """x [*, in] (whole), weight [out_local, in] (this rank's leaves of the output rows) ->
    [*, out_local]: each column with the bits of one GEMM per canonical output leaf (on CUDA all of
    this rank's leaves in one launch with the leaf's tile config, see matmul.linear_leaves), so a
    column's bits never depend on how many columns this rank holds. lora = (A [r, in] whole,
    B [out_local, r]): the delta ((x A^T) B^T) * scale per leaf, added to that leaf's base output."""
    if _ordinary and shards.size > 1:
        x1 = _copy(x, shards)
        y = linear(x1, weight)
        if lora is not None:
            y = add_scaled(y, linear(_copy(linear(x, lora[0]), shards), lora[1]), scale)
        return y
    y = linear_leaves(fan_out(x, leaves, shards), weight)
    if lora is None:
        return y
    delta = linear_leaves(fan_out(linear(x, lora[0]), leaves, shards), lora[1])
    # scaled and added over every leaf at once: elementwise, so each column gets its leaf's bits
    return add_scaled(y, delta, scale)


def row_linear(x: torch.Tensor, weight: torch.Tensor, leaves: int, shards: Shards = LOCAL) -> torch.Tensor:
    """x [*, in_local] (this rank's leaves of the input), weight [out, in_local] -> [*, out], the
    whole sum over every rank: one GEMM per canonical input leaf (a decode step's few rows: one bmm
    over the leaves with each leaf GEMM's bits, cpu_grouped.py), added by the canonical tree."""
    count = len(shards.local(leaves))
    if _ordinary and shards.size > 1:
        return reduce_leaves([linear(x, weight)], shards)
    xs, ws = x.chunk(count, -1), weight.chunk(count, 1)
    grouped = cpu_grouped.leaf_products(xs, ws)  # a decode step's few rows: one bmm, the same bits
    parts = list(grouped.unbind(0)) if grouped is not None else [linear(xc, wc) for xc, wc in zip(xs, ws)]
    return reduce_leaves(parts, shards)
