"""DSA lightning-indexer scores (DeepSeek-V3.2), batch-invariant in queries and in keys.

score[t, s] = sum over index heads h, in ascending h, of w[t, h] * relu(q[t, h] . k[s]),
in fp32, and -inf where key s lies after query t (k_pos[s] > q_pos[t]).

Invariance has two sides here: a query's scores must not depend on the other queries in
the call (prefill vs decode) nor on how many keys the call holds (a decode step sees t + 1
keys, the trainer sees the whole sequence). The CPU path therefore computes every q . k
dot product in a GEMM of one fixed shape, [ROW_TILE query-head rows, D] x [D, ROW_TILE keys].

`indexer_scores_varlen` scores packed sequences in one call (cu_seqlens-style offsets, or a
`Packing` that already holds them on the host and the device): each query against its own
sequence's keys only, column j = that sequence's key j. Every path runs
the very tiles a call per sequence would (a sequence's query-head rows and keys tiled from its
own first row), so each score has the bits of `indexer_scores` over that sequence alone.
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant._checks import check_dim, check_float, check_index, check_same_device, check_size
from zmrl.batch_invariant.packing import Packing, longest_run
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


def varlen_rows(cu_seqlens: torch.Tensor | Packing, total: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens [B + 1] -> (sequence of each row [total], row within its sequence [total])."""
    if isinstance(cu_seqlens, Packing):
        return cu_seqlens.seq, cu_seqlens.local
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)
    return seq, torch.arange(total, device=device) - cu[:-1][seq]


def pad_sequences(x: torch.Tensor, seq: torch.Tensor, local: torch.Tensor, num_seqs: int, max_len: int,
                  fill=0) -> torch.Tensor:
    """Packed rows [T, ...] -> [B, max_len, ...], row t at (seq[t], local[t]); the rest `fill`."""
    out = x.new_full((num_seqs, max_len, *x.shape[1:]), fill)
    out[seq, local] = x
    return out


def _varlen_dots_tiled(q, k, q_rows, k_rows, num_seqs, max_q, max_k) -> torch.Tensor:
    """q [T, H, D], k [S, D] packed -> [T, H, max_k] fp32: each query against its sequence's keys,
    every dot in the [ROW_TILE, D] x [D, ROW_TILE] GEMM a per-sequence `_dots_tiled` would run
    (the sequence's query-head rows and keys tiled from its own first row)."""
    t, h, d = q.shape
    qp = pad_sequences(q.float(), *q_rows, num_seqs, max_q).reshape(num_seqs, max_q * h, d)
    q_tiles = num_tiles(max_q * h)
    qp = torch.nn.functional.pad(qp, (0, 0, 0, q_tiles * ROW_TILE - max_q * h))
    k_tiles = num_tiles(max_k)
    kp = pad_sequences(k.float(), *k_rows, num_seqs, k_tiles * ROW_TILE)
    keys = kp.view(num_seqs * k_tiles, ROW_TILE, d).transpose(1, 2)  # [B * nk, D, ROW_TILE]
    out = qp.new_empty(num_seqs, q_tiles * ROW_TILE, k_tiles * ROW_TILE)
    tile_out = qp.new_empty(num_seqs * k_tiles, ROW_TILE, ROW_TILE)
    for i in range(q_tiles):  # one bmm per query tile, over every sequence's key tiles at once
        rows = slice(i * ROW_TILE, (i + 1) * ROW_TILE)
        q_tile = qp[:, None, rows].expand(num_seqs, k_tiles, ROW_TILE, d).reshape(-1, ROW_TILE, d)
        torch.bmm(q_tile, keys, out=tile_out)
        out[:, rows] = tile_out.view(num_seqs, k_tiles, ROW_TILE, ROW_TILE).transpose(1, 2).reshape(
            num_seqs, ROW_TILE, -1)
    dots = out[:, : max_q * h, :max_k].reshape(num_seqs, max_q, h, max_k)
    return dots[q_rows[0], q_rows[1]]


def varlen_causal(scores: torch.Tensor, q_pos, k_pos, k_rows, num_seqs: int, max_k: int,
                  q_seq: torch.Tensor) -> torch.Tensor:
    """-inf where a key lies after the query, and in the columns past the sequence's keys."""
    never = torch.iinfo(torch.int64).max
    kp = pad_sequences(k_pos.long(), *k_rows, num_seqs, max_k, fill=never)[q_seq]  # [T, max_k]
    return scores.masked_fill(kp > q_pos.long()[:, None], float("-inf"))


def _varlen_reference(q, weights, k, q_pos, k_pos, bounds_q, bounds_k, max_k):
    out = torch.full((q.shape[0], max_k), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(bounds_q) - 1):  # readable: one sequence at a time
        (q0, q1), (k0, k1) = bounds_q[b:b + 2], bounds_k[b:b + 2]
        out[q0:q1, : k1 - k0] = indexer_scores_reference(q[q0:q1], weights[q0:q1], k[k0:k1], q_pos[q0:q1],
                                                         k_pos[k0:k1])
    return out


def _check_cu(name: str, cu: torch.Tensor | Packing, total: int) -> list[int]:
    """The offsets as host ints: a Packing's as held, a tensor's read back (free on the CPU)."""
    if isinstance(cu, Packing):
        bounds = list(cu.bounds)
    else:
        check_index(name, cu)
        check_dim(name, cu, 1, "[B + 1]")
        bounds = cu.tolist()
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name}={bounds} must rise from 0 to {total} (the packed rows)")
    return bounds


def _check_scores_args(q, weights, k, q_pos, k_pos) -> None:
    """One-line errors for the arguments both scoring entry points share."""
    for name, t in (("q", q), ("k", k), ("weights", weights)):
        check_float(name, t)
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


def indexer_scores_varlen(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    cu_seqlens_q: torch.Tensor | Packing,
    cu_seqlens_k: torch.Tensor | Packing,
) -> torch.Tensor:
    """Packed sequences in one call. q [T, H, D], weights [T, H], q_pos [T] hold every sequence's
    queries, sequence b in rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]; k [S, D], k_pos [S] its keys in
    rows cu_seqlens_k[b]:cu_seqlens_k[b + 1]. -> scores [T, max_k] fp32, max_k the longest key run
    (a Packing's `width` where it sets one):
    scores[t, j] = indexer_scores of t against key j of t's own sequence (same bits as a call over
    that sequence alone), -inf past that sequence's keys and where the key lies after the query.
    Offsets in a Packing on q's device cost no host sync and no copy; a tensor's are read on the
    host (a GPU tensor: one sync)."""
    _check_scores_args(q, weights, k, q_pos, k_pos)
    bounds_q = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    bounds_k = _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    check_size("cu_seqlens_k", len(bounds_k), len(bounds_q), "number of sequences + 1 vs cu_seqlens_q")
    num_seqs = len(bounds_q) - 1
    # what the call plans for: a Packing's own (its width where it sets one), else the longest run
    max_q, max_k = (c.max_len if isinstance(c, Packing) else longest_run(bounds)
                    for c, bounds in ((cu_seqlens_q, bounds_q), (cu_seqlens_k, bounds_k)))
    if q.shape[0] == 0 or max_k == 0:
        return torch.full((q.shape[0], max_k), float("-inf"), dtype=torch.float32, device=q.device)
    path = path_for(q)
    if path == "reference":
        return _varlen_reference(q, weights, k, q_pos, k_pos, bounds_q, bounds_k, max_k)
    if path in ("triton", "torch"):
        impl = triton_ops() if path == "triton" else torch_ops()
        cu_q, cu_k = (c.cu_seqlens if isinstance(c, Packing) else c for c in (cu_seqlens_q, cu_seqlens_k))
        return impl.indexer_scores_varlen(q, weights, k, q_pos, k_pos, cu_q, cu_k, max_q, max_k)
    q_rows = varlen_rows(cu_seqlens_q, q.shape[0], q.device)
    k_rows = varlen_rows(cu_seqlens_k, k.shape[0], q.device)
    dots = _varlen_dots_tiled(q.detach(), k.detach(), q_rows, k_rows, num_seqs, max_q, max_k)
    return varlen_causal(_combine_heads(dots, weights.detach()), q_pos, k_pos, k_rows, num_seqs, max_k, q_rows[0])


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, D] index queries, weights [T, H] head weights, k [S, D] index keys (one per
    token, shared by the heads), q_pos [T] and k_pos [S] token positions -> scores [T, S] fp32."""
    _check_scores_args(q, weights, k, q_pos, k_pos)
    path = path_for(q)
    if path in ("triton", "torch"):
        return (triton_ops() if path == "triton" else torch_ops()).indexer_scores(q, weights, k, q_pos, k_pos)
    if path == "reference":
        return indexer_scores_reference(q, weights, k, q_pos, k_pos)
    return _TiledScores.apply(q, weights, k, q_pos, k_pos)
