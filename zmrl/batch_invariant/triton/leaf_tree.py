"""The canonical leaf tree of zmrl.batch_invariant.collectives in one launch.

`leaf_tree(parts, out_dtype)` adds 2, 4 or 8 same-shape tensors in fp32 by the balanced tree

    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))

and rounds once to `out_dtype`: the additions of collectives' torch expression (cast every leaf to
fp32, add rows 2i and 2i + 1 level by level, cast), the same pairs in the same order, so the same
bits. That expression costs a stacking copy in fp32, one launch per level and a cast, and moves
about three times the bytes; here each program reads its elements of every leaf once, adds them
in registers and writes the result. Only additions: no product to contract into an FMA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import INTERPRET, cdiv
from zmrl.batch_invariant.triton._launch import keyed
from zmrl.batch_invariant.triton.elementwise import round_as_torch

_BLOCK = 1024
MAX_LEAVES = 8


@triton.jit
def _leaf(p, offs, ok):
    return tl.load(p + offs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _leaf_tree_kernel(p0, p1, p2, p3, p4, p5, p6, p7, out_ptr, numel, LEAVES: tl.constexpr, BLOCK: tl.constexpr,
                      EMULATE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = _leaf(p0, offs, ok) + _leaf(p1, offs, ok)
    if LEAVES >= 4:
        acc = acc + (_leaf(p2, offs, ok) + _leaf(p3, offs, ok))
    if LEAVES == 8:
        right = (_leaf(p4, offs, ok) + _leaf(p5, offs, ok)) + (_leaf(p6, offs, ok) + _leaf(p7, offs, ok))
        acc = acc + right
    tl.store(out_ptr + offs, round_as_torch(acc, out_ptr.dtype.element_ty, EMULATE), mask=ok)


def leaf_tree(parts: list[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """parts: 2, 4 or 8 tensors of one shape, dtype and device -> their fp32 tree sum in out_dtype."""
    count = len(parts)
    if count not in (2, 4, MAX_LEAVES):
        raise ValueError(f"leaf_tree adds 2, 4 or {MAX_LEAVES} leaves, got {count}")
    first = parts[0]
    if any(p.shape != first.shape or p.dtype != first.dtype or p.device != first.device for p in parts):
        raise ValueError("leaf_tree: every leaf must have the first leaf's shape, dtype and device, got "
                         f"{[(tuple(p.shape), p.dtype, str(p.device)) for p in parts]}")
    flat = [p.contiguous() for p in parts]
    out = torch.empty(first.shape, dtype=out_dtype, device=first.device)
    numel = out.numel()
    if numel:
        ptrs = flat + [flat[0]] * (MAX_LEAVES - count)  # unread where LEAVES is smaller
        keyed(_leaf_tree_kernel, "leaf_tree", num_warps=4)(
            (cdiv(numel, _BLOCK),), (*ptrs, out, numel), dict(LEAVES=count, BLOCK=_BLOCK, EMULATE=INTERPRET))
    return out
