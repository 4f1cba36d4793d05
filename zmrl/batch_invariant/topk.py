"""Exact top-k with one total order (docs/design.md): value descending, then index ascending.

-0.0 counts as +0.0; -inf marks an invalid entry that is never selected; NaN is an error.
Each row keeps k_eff = min(k, number of valid entries) indices, emitted in ascending index
order and padded with -1. Selection involves no arithmetic, so any correct implementation
gives the same answer; the order and the -1 padding are part of the numerics because
sparse attention and the MoE combine accumulate in list order.
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant._checks import check_dim, check_float, fail_if
from zmrl.batch_invariant._paths import path_for, torch_ops, triton_ops


def _canonical(scores: torch.Tensor) -> torch.Tensor:
    s = scores.float()
    return s + 0.0  # -0.0 + 0.0 == +0.0 in round-to-nearest: one zero


def topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Sort by (value desc, index asc), keep the first k valid, re-sort by index."""
    s = _canonical(scores)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # ties keep index order
    out = torch.full((s.shape[0], k), -1, dtype=torch.int64, device=s.device)
    for r in range(s.shape[0]):
        chosen = [int(i) for i in order[r] if s[r, i] != float("-inf")][:k]
        out[r, : len(chosen)] = torch.tensor(sorted(chosen), dtype=torch.int64)
    return out


# Rows up to this wide take the sort (a dozen ops, the step's row counts are small); wider rows
# the threshold (torch.topk is linear in the row, a sort is not). Both are exact: the same indices.
SORT_MAX_COLS = 1024


def _topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """A stable descending sort ranks by (value desc, index asc) itself: keep its first k valid
    entries, then put them in ascending index order."""
    s = _canonical(scores)
    rows, cols = s.shape
    kk = min(k, cols)
    values, order = torch.sort(s, dim=-1, descending=True, stable=True)
    # -inf sorts last, so the first kk hold every valid entry that is kept; invalid ones sort past
    # every index, then become -1
    kept = torch.where(values[:, :kk] != float("-inf"), order[:, :kk], cols).sort(-1).values
    out = torch.where(kept == cols, -1, kept)
    return out if kk == k else torch.nn.functional.pad(out, (0, k - kk), value=-1)


def _topk_threshold(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Find the k-th value v*, keep everything above it and the lowest-index ties at it."""
    s = _canonical(scores)
    rows, cols = s.shape
    valid = s != float("-inf")
    k_eff = valid.sum(-1).clamp(max=k)  # [R]
    kth = torch.topk(s, min(k, cols), dim=-1).values  # exact values; ties do not matter here
    v_star = kth.gather(1, (k_eff - 1).clamp(min=0)[:, None])  # [R, 1]
    above = valid & (s > v_star)
    at = valid & (s == v_star)
    need = k_eff[:, None] - above.sum(-1, keepdim=True)
    chosen = above | (at & (at.cumsum(-1) <= need))
    chosen &= (k_eff > 0)[:, None]
    slot = chosen.cumsum(-1) - 1  # ascending index -> ascending slot
    out = torch.full((rows, k + 1), -1, dtype=torch.int64, device=s.device)
    cols_idx = torch.arange(cols, device=s.device).expand(rows, cols)
    out.scatter_(1, torch.where(chosen, slot, k), torch.where(chosen, cols_idx, -1))
    return out[:, :k]


def topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, N] -> indices [R, k] int64, ascending, -1 padded (see module docstring)."""
    _check_args(scores, k)
    if scores.numel():
        # deferred on a GPU (no host sync): a NaN entry only makes a selection wrong until it raises
        fail_if(torch.isnan(scores).any(), "scores contain NaN; top-k has no order for NaN",
                lambda: "first at row {}, column {}".format(*torch.isnan(scores).nonzero()[0].tolist()))
    return _select(scores, k)


def topk_of_checked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`topk` for scores its caller has already checked for NaN with `fail_if` (the router checks
    its biased scores once, with its own message): the same selection, without a second check."""
    _check_args(scores, k)
    return _select(scores, k)


def _check_args(scores: torch.Tensor, k: int) -> None:
    check_float("scores", scores, (torch.float32, torch.bfloat16, torch.float16))
    check_dim("scores", scores, 2, "[R, N]")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k <= 0:
        raise ValueError(f"k must be >= 1, got {k}")


def _select(scores: torch.Tensor, k: int) -> torch.Tensor:
    path = path_for(scores)
    if scores.shape[1] == 0:
        return torch.full((scores.shape[0], k), -1, dtype=torch.int64, device=scores.device)
    if path == "triton":
        return triton_ops().topk_launch(scores, k)  # the kernel alone: checked above
    if path == "torch":
        return torch_ops().topk(scores, k)
    if path == "reference":
        return topk_reference(scores, k)
    return _topk_sorted(scores, k) if scores.shape[1] <= SORT_MAX_COLS else _topk_threshold(scores, k)
