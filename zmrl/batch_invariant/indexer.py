"""DSA lightning-indexer scores (DeepSeek-V3.2), batch-invariant in queries and in keys.

score[t, s] = sum over index heads h, in ascending h, of w[t, h] * relu(q[t, h] . k[s]),
in fp32, and -inf where key s lies after query t (k_pos[s] > q_pos[t]).

Invariance has two sides here: a query's scores must not depend on the other queries in
the call (prefill vs decode) nor on how many keys the call holds (a decode step sees t + 1
keys, the trainer sees the whole sequence). The CPU path therefore computes every q . k
dot product in a GEMM of one fixed shape, [ROW_TILE query-head rows, D] x [D, ROW_TILE keys].
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant._checks import check_dim, check_float, check_index, check_same_device, check_size
from zmrl.batch_invariant._paths import path_for, torch_ops, triton_ops
from zmrl.batch_invariant._tiles import ROW_TILE, num_tiles, pad_rows


def _combine_heads(dots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """dots [T, H, S] fp32, weights [T, H] -> [T, S]; heads summed one at a time, ascending."""
    w = weights.float()
    acc = torch.relu(dots[:, 0]) * w[:, 0, None]
    for h in range(1, dots.shape[1]):
        acc = acc + torch.relu(dots[:, h]) * w[:, h, None]
    return acc


def _causal(scores: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


def indexer_scores_reference(q, weights, k, q_pos, k_pos) -> torch.Tensor:
    dots = torch.einsum("thd,sd->ths", q.double(), k.double()).float()
    return _causal(_combine_heads(dots, weights), q_pos, k_pos)


def _dots_tiled(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], k [S, D] -> [T, H, S] fp32, every dot product in a [ROW_TILE, D] x [D, ROW_TILE] GEMM."""
    t, h, d = q.shape
    s = k.shape[0]
    rows = pad_rows(q.float().reshape(t * h, d))
    key_tiles = num_tiles(s)
    keys = pad_rows(k.float()).view(key_tiles, ROW_TILE, d).transpose(1, 2)  # [nk, D, ROW_TILE]
    out = rows.new_empty(rows.shape[0], key_tiles * ROW_TILE)
    tile_out = rows.new_empty(key_tiles, ROW_TILE, ROW_TILE)
    for start in range(0, rows.shape[0], ROW_TILE):
        q_tile = rows[start:start + ROW_TILE].expand(key_tiles, ROW_TILE, d)
        torch.bmm(q_tile, keys, out=tile_out)
        out[start:start + ROW_TILE] = tile_out.transpose(0, 1).reshape(ROW_TILE, -1)
    return out[: t * h, :s].view(t, h, s)


class _TiledScores(torch.autograd.Function):
    """Forward by the fixed-shape tiles; backward by autograd through the float64 reference
    (the indexer is trained, if at all, by its own loss; the gradient need not be invariant)."""

    @staticmethod
    def forward(ctx, q, weights, k, q_pos, k_pos):
        ctx.save_for_backward(q, weights, k, q_pos, k_pos)
        return _causal(_combine_heads(_dots_tiled(q, k), weights), q_pos, k_pos)

    @staticmethod
    def backward(ctx, grad):
        q, weights, k, q_pos, k_pos = ctx.saved_tensors
        leaves = [t.detach().requires_grad_() for t in (q, weights, k)]
        with torch.enable_grad():
            out = indexer_scores_reference(*leaves, q_pos, k_pos)
            finite = torch.isfinite(out)
            grads = torch.autograd.grad(out, leaves, torch.where(finite, grad, 0.0))
        return (*grads, None, None)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, D] index queries, weights [T, H] head weights, k [S, D] index keys (one per
    token, shared by the heads), q_pos [T] and k_pos [S] token positions -> scores [T, S] fp32."""
    check_float("q", q)
    check_float("k", k)
    check_float("weights", weights)
    check_index("q_pos", q_pos)
    check_index("k_pos", k_pos)
    check_dim("q", q, 3, "[T, H, D]")
    check_dim("weights", weights, 2, "[T, H]")
    check_dim("k", k, 2, "[S, D]")
    check_size("weights", tuple(weights.shape), tuple(q.shape[:2]), "shape vs q's [T, H]")
    check_size("k", k.shape[1], q.shape[2], "head dim vs q")
    check_size("q_pos", q_pos.numel(), q.shape[0], "length vs T")
    check_size("k_pos", k_pos.numel(), k.shape[0], "length vs S")
    check_same_device(q=q, weights=weights, k=k, q_pos=q_pos, k_pos=k_pos)
    path = path_for(q)
    if path in ("triton", "torch"):
        return (triton_ops() if path == "triton" else torch_ops()).indexer_scores(q, weights, k, q_pos, k_pos)
    if path == "reference":
        return indexer_scores_reference(q, weights, k, q_pos, k_pos)
    return _TiledScores.apply(q, weights, k, q_pos, k_pos)
