"""The router's expert selection in one launch: the ids of `zmrl.batch_invariant.moe.route_select_composed`.

Per row of the biased scores [N, E] fp32 (already checked for NaN by the router), with the
DeepSeek group limit when n_group > 1:
    group score g = top1 + top2 of the group's scores (`torch.topk(group, 2).values` summed, one
                    fp32 add; a group of one expert: top1 alone),
    kept groups   = the canonical top-`topk_group` of the group scores,
    ids           = the canonical top-k of the scores, experts of other groups invalid (-inf),
the canonical top-k being zmrl's one order (docs/design.md, "Top-k"): value descending, then index
ascending, -0.0 as +0.0, -inf never selected, ids ascending, -1 padded. Selection is comparisons
only; the one add rounds as torch's does, and a group score's only use is to be compared, where a
zero's sign never counts: so the ids are the composed path's. Where the composed path would fail
(a group score NaN from +inf and -inf scores, fewer finite group scores than `topk_group`), this
kernel treats such groups as invalid instead.

One program per row holds the row's scores in registers and ranks every expert against every
other ([E, E] comparisons): the composed path's `torch.topk`, two canonical top-k launches, a
scatter and a masked fill (nine launches) become one. For routers of up to `MAX_EXPERTS` experts;
wider rows take the composed path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import check_runnable, next_power_of_2
from zmrl.batch_invariant.triton._launch import keyed
from zmrl.batch_invariant.triton.topk import order_keys

MAX_EXPERTS = 256


@triton.jit
def _kept_by_rank(key, idx, count):
    """Whether each valid entry (key != 0) ranks among the first `count` in the canonical order."""
    beats = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (idx[None, :] < idx[:, None]))
    rank = tl.sum((beats & (key[None, :] != 0)).to(tl.int32), axis=1)
    return (key != 0) & (rank < count)


@triton.jit
def _route_select_kernel(x_ptr, out_ptr, E, K, TOPK_GROUP, stride_x, stride_o,
                         BLOCK_E: tl.constexpr, N_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                         GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    real = e < E
    v = tl.load(x_ptr + row * stride_x + e, mask=real, other=float("-inf"))
    key = order_keys(v)
    if N_GROUP > 1:
        g = tl.arange(0, BLOCK_G)
        member = ((e[None, :] // GROUP) == g[:, None]) & real[None, :]  # [G, E]
        vals = tl.where(member, v[None, :], float("-inf"))
        top1 = tl.max(vals, axis=1)
        if GROUP > 1:  # the second largest value, the largest again where it occurs twice
            twice = tl.sum((member & (vals == top1[:, None])).to(tl.int32), axis=1) >= 2
            below = tl.max(tl.where(vals < top1[:, None], vals, float("-inf")), axis=1)
            score = top1 + tl.where(twice, top1, below)
        else:
            score = top1
        gkey = order_keys(score)
        gkey = tl.where(g < N_GROUP, gkey, tl.zeros_like(gkey))
        kept = _kept_by_rank(gkey, g, TOPK_GROUP)
        in_kept = tl.sum((member & kept[:, None]).to(tl.int32), axis=0) > 0
        key = tl.where(in_kept, key, tl.zeros_like(key))
    chosen = _kept_by_rank(key, e, K)
    sel = chosen.to(tl.int32)
    slot = tl.cumsum(sel, axis=0) - sel  # ascending expert id -> ascending slot
    o_row = out_ptr + row * stride_o
    tl.store(o_row + slot, e.to(tl.int64), mask=chosen)
    count = tl.sum(sel, axis=0)
    tl.store(o_row + e, tl.full((BLOCK_E,), -1, dtype=tl.int64), mask=(e >= count) & (e < K))


def route_select(biased: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """biased [N, E] fp32 (NaN-checked by the caller), E <= MAX_EXPERTS -> ids [N, top_k] int64,
    ascending, -1 padded. n_group divides E; arguments as `moe_route` validated them."""
    check_runnable("biased", biased)
    n, e = biased.shape
    if biased.dtype != torch.float32 or e > MAX_EXPERTS or e % n_group or not 1 <= top_k <= e:
        raise ValueError(f"route_select takes fp32 scores [N, E <= {MAX_EXPERTS}] with n_group dividing E and "
                         f"1 <= top_k <= E, got {biased.dtype} {tuple(biased.shape)}, top_k={top_k}, n_group={n_group}")
    out = torch.empty(n, top_k, dtype=torch.int64, device=biased.device)
    if n:
        x = biased if biased.stride(1) == 1 else biased.contiguous()
        block_e = next_power_of_2(e)
        keyed(_route_select_kernel, "route_select", num_warps=4 if block_e >= 128 else 2)(
            (n,), (x, out, e, top_k, topk_group, x.stride(0), out.stride(0)),
            dict(BLOCK_E=block_e, N_GROUP=n_group, BLOCK_G=next_power_of_2(n_group), GROUP=e // n_group))
    return out
