"""Sparse MLA in the absorbed (MQA) form, one kernel for prefill, decode and training.

Each query row t attends, for every head h, over the cached tokens listed in indices[t]
(valid ones ascending, -1 padding at the end):

    logit[t, h, j] = (q_latent[t, h] . kv_latent[s_j] + q_rope[t, h] . k_rope[s_j]) * scale

The list is consumed in chunks of a fixed *size* (never a fixed number of chunks) with an
online softmax whose running max, sum and accumulator are fp32, so a row's arithmetic is
the same whether it arrives with 4,000 other rows (prefill, trainer) or alone (decode).
Returns the latent-space output [T, H, C] (the caller applies W_UV) and the LSE [T, H].
NoPE (no rope part) is q_rope = k_rope = None. `sparse_mla_leaves` is the same op with the heads
cut into canonical head leaves, each leaf reading its own alias of the keys (its gradient formed
per leaf): the form the model calls.
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant._checks import (
    check_dim,
    check_float,
    check_index,
    check_same_device,
    check_same_dtype,
    check_size,
    defers_checks,
    fail_if,
)
from zmrl.batch_invariant._paths import path_for, records_graph, torch_ops, triton_ops
from zmrl.batch_invariant.gather import scatter_add_rows
from zmrl.batch_invariant.rowwise import tree_sum

DEFAULT_CHUNK = 64


def sparse_mla_reference(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale):
    """Plain softmax over the gathered tokens, in float64 -> (out, lse). Differentiable."""
    safe = indices.clamp(min=0)
    rope_rows = None if q_rope is None else k_rope.double()[safe]
    return _reference_over_rows(q_latent, q_rope, kv_latent.double()[safe], rope_rows, indices >= 0, softmax_scale)


def _reference_over_rows(q_latent, q_rope, g, rope_rows, valid, softmax_scale):
    """sparse_mla_reference from the gathered float64 rows: g [T, k, C] latents, rope_rows [T, k, R]
    (None: NoPE), valid [T, k] the slots holding a token."""
    logits = torch.einsum("thc,tkc->thk", q_latent.double(), g)
    if q_rope is not None:
        logits = logits + torch.einsum("thr,tkr->thk", q_rope.double(), rope_rows)
    logits = (logits * softmax_scale).masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    p = torch.exp(logits - lse[..., None].clamp(min=-1e300)).nan_to_num(0.0)
    out = torch.einsum("thk,tkc->thc", p, g)
    return out.to(q_latent.dtype), lse.float()


# Buffers whose per-leaf slices feed a BLAS call start where a buffer of their own would: on a
# 64-byte boundary (the CPU allocator's alignment), so no leaf's GEMM sees another alignment than
# a call over that leaf alone. (A BLAS may peel loops by alignment: Intel documents that MKL's
# results can depend on it.)
_ALIGN_BYTES = 64


class _Leaves:
    """The online softmax of L head leaves over the chunks, stacked: running max, sum and
    accumulator [L, T, h(, C)] in fp32, and the buffers each leaf's fixed-shape bmms write into
    (leaf l's bmm reads and writes slice l, a contiguous [T, h, *] block). Every elementwise step
    runs once over all leaves: its ops are position-independent (IEEE +, *, /, max, and exp/log,
    whose vector lanes and scalar tails agree: lanes.py, which `zmrl doctor` runs), so each
    leaf gets the bits of a call over that leaf alone."""

    def __init__(self, q_latents, q_ropes, chunk_size):
        t, h, c = q_latents[0].shape
        count = len(q_latents)
        self.ql = [q.float() for q in q_latents]
        self.qr = None if q_ropes[0] is None else [q.float() for q in q_ropes]
        like = self.ql[0]
        self.m = like.new_full((count, t, h), float("-inf"))
        self.denom = like.new_zeros(count, t, h)
        self.acc = like.new_zeros(count, t, h, c)
        self.logits = like.new_empty(count, t, h, chunk_size)
        self.rope_logits = like.new_empty(count, t, h, chunk_size)
        self.update = like.new_empty(count, t, h, c)

    @staticmethod
    def aligned(t: int, h: int, c: int, chunk_size: int) -> bool:
        """Whether every leaf's slice of the [L, T, h, chunk] and [L, T, h, C] fp32 buffers starts on
        an alignment boundary (true for any T and h when chunk and C are multiples of 16)."""
        return all((t * h * n * 4) % _ALIGN_BYTES == 0 for n in (chunk_size, c))

    def add_chunk(self, g_t, g, rope_t, invalid, softmax_scale):
        """g [T, chunk, C] the chunk's latent rows (g_t its [T, C, chunk] transpose), rope_t the rope
        keys' [T, R, chunk] (None: NoPE), invalid [T, 1, chunk] the padding slots."""
        # per query: a [h, C] x [C, chunk] GEMM of one fixed shape (batched over T), per leaf
        for q, out in zip(self.ql, self.logits):
            torch.bmm(q, g_t, out=out)
        if self.qr is not None:
            for q, out in zip(self.qr, self.rope_logits):
                torch.bmm(q, rope_t, out=out)
            scaled = (self.logits + self.rope_logits) * softmax_scale
        else:
            scaled = self.logits * softmax_scale
        scaled = scaled.masked_fill(invalid, float("-inf"))
        m_new = torch.maximum(self.m, scaled.amax(-1))
        # rows that have seen no valid token keep m = -inf; shift by 0 so exp gives 0, not NaN
        shift = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp(self.m - shift)
        p = torch.exp(scaled - shift[..., None])
        self.denom = self.denom * alpha + tree_sum(p)[..., 0]
        for p_leaf, out in zip(p, self.update):
            torch.bmm(p_leaf, g, out=out)
        self.acc = self.acc * alpha[..., None] + self.update
        self.m = m_new

    def result(self, dtype):
        """-> (out [L, T, h, C] in dtype, lse [L, T, h] fp32)."""
        empty = self.denom == 0
        out = torch.where(empty[..., None], 0.0, self.acc / torch.where(empty, 1.0, self.denom)[..., None])
        lse = torch.where(empty, float("-inf"), self.m + torch.log(torch.where(empty, 1.0, self.denom)))
        return out.to(dtype), lse


def _sparse_mla_chunked_leaves(q_latents, q_ropes, kv_latent, k_rope, indices, softmax_scale, chunk_size):
    """The chunked kernel for L head leaves over one key set and one selection -> (out [T, L h, C],
    lse [T, L h]), each leaf with the bits of a call over that leaf alone: its own bmms, and the
    elementwise steps of the online softmax once over all leaves (`_Leaves`). What does not depend
    on the leaf (the chunk's padding mask, its gathered latent and rope rows) is made once per chunk."""
    t, h, c = q_latents[0].shape
    if len(q_latents) > 1 and not _Leaves.aligned(t, h, c, chunk_size):
        parts = [_sparse_mla_chunked_leaves([q], [qr], kv_latent, k_rope, indices, softmax_scale, chunk_size)
                 for q, qr in zip(q_latents, q_ropes)]
        return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 1)
    leaves = _Leaves(q_latents, q_ropes, chunk_size)
    width = indices.shape[1]
    for start in range(0, width, chunk_size):
        idx = indices[:, start:start + chunk_size]
        if idx.shape[1] < chunk_size:  # the last partial chunk behaves as if padded with -1
            idx = torch.cat([idx, idx.new_full((t, chunk_size - idx.shape[1]), -1)], 1)
        valid = idx >= 0
        if not bool(valid.any()):
            break  # valid entries precede the padding, so nothing follows
        safe = idx.clamp(min=0).reshape(-1)
        # [T, chunk, C], contiguous: the rows kv_latent[safe] holds (index_select copies the same
        # values, several times faster than advanced indexing at these sizes)
        g = kv_latent.index_select(0, safe).view(t, chunk_size, kv_latent.shape[1]).float()
        rope_t = None
        if q_ropes[0] is not None:
            rope_t = k_rope.index_select(0, safe).view(t, chunk_size, k_rope.shape[1]).float().transpose(1, 2)
        leaves.add_chunk(g.transpose(1, 2), g, rope_t, ~valid[:, None, :], softmax_scale)
    out, lse = leaves.result(q_latents[0].dtype)
    if len(q_latents) == 1:
        return out[0], lse[0]
    # leaf-major -> heads in leaf order, as torch.cat of the leaves along the head dim
    return out.transpose(0, 1).reshape(t, -1, c), lse.transpose(0, 1).reshape(t, -1)


def _sparse_mla_chunked(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size):
    return _sparse_mla_chunked_leaves([q_latent], [q_rope], kv_latent, k_rope, indices, softmax_scale, chunk_size)


class _SparseMla(torch.autograd.Function):
    """Forward by the chunked kernel; backward by the float64 reference's gradients
    (`_reference_backward`: autograd through the reference from gathered rows, the rows' gradients
    summed in a fixed order; deterministic on CPU). Not fp32: the trainers call it over different
    row sets (a packed minibatch, one sequence), and an fp32 batched GEMM's last bits follow the
    batch shape (tried: the Megatron and reference trainers' CPU gradients then differ), which
    float64 hides once rounded to fp32."""

    @staticmethod
    def forward(ctx, q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size):
        ctx.save_for_backward(q_latent, q_rope, kv_latent, k_rope, indices)
        ctx.softmax_scale = softmax_scale
        return _sparse_mla_chunked(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q_latent, q_rope, kv_latent, k_rope, indices = ctx.saved_tensors
        need = ctx.needs_input_grad
        dq, dqr, dkv, dkr = _reference_backward(q_latent, q_rope, kv_latent, k_rope, indices, ctx.softmax_scale,
                                                grad_out, grad_lse, 1, need[0], need[1], need[2],
                                                k_rope is not None and need[3])
        return dq, dqr, dkv[0], dkr[0], None, None, None


class _SparseMlaLeaves(torch.autograd.Function):
    """`_SparseMla` for L head leaves at once, on the CPU: the forward is the one-pass chunked kernel
    over every leaf (each leaf with the bits of its own call), and the backward is `_SparseMla`'s
    (`_reference_backward`) for all L leaves, so each leaf's gradients have the bits of its own
    `_SparseMla`, with the rows gathered once for every leaf instead of once per leaf. The key and
    rope gradients are formed per leaf, as the callers sum them over the leaves themselves.
    Arguments: q_latent [T, H, C], q_rope, indices, softmax_scale, chunk_size, L, then the L latent
    aliases and the L rope aliases (none: NoPE)."""

    @staticmethod
    def forward(ctx, q_latent, q_rope, indices, softmax_scale, chunk_size, count, *keys):
        kv_latents, k_ropes = keys[:count], keys[count:]
        ctx.save_for_backward(q_latent, q_rope, kv_latents[0], k_ropes[0] if k_ropes else None, indices)
        ctx.softmax_scale, ctx.count = softmax_scale, count
        return _sparse_mla_chunked_leaves(*_leaf_queries(q_latent, q_rope, count), kv_latents[0],
                                          k_ropes[0] if k_ropes else None, indices, softmax_scale, chunk_size)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q_latent, q_rope, kv_latent, k_rope, indices = ctx.saved_tensors
        count, need = ctx.count, ctx.needs_input_grad
        ropes = len(need) - 6 - count  # L rope aliases, or none (NoPE)
        dq, dqr, dkv, dkr = _reference_backward(q_latent, q_rope, kv_latent, k_rope, indices, ctx.softmax_scale,
                                                grad_out, grad_lse, count, need[0], need[1],
                                                any(need[6:6 + count]), ropes > 0 and any(need[6 + count:]))
        return (dq, dqr, None, None, None, None, *dkv, *(dkr if ropes else []))


def _leaf_queries(q_latent, q_rope, count):
    """-> ([q_latent of each head leaf], [q_rope of each leaf, or None]), each contiguous."""
    q_lats = [q.contiguous() for q in q_latent.chunk(count, 1)]
    return q_lats, [None] * count if q_rope is None else [q.contiguous() for q in q_rope.chunk(count, 1)]


def _reference_backward(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, grad_out, grad_lse, count,
                        need_q, need_qr, need_kv, need_kr):
    """The float64 reference's gradients for `count` head leaves -> (dq, dq_rope, [dkv per leaf],
    [dk_rope per leaf]). The latent and rope rows are gathered once, in float64, and each leaf's
    gradient is taken at them through `_reference_over_rows`; each leaf's row gradients are then
    summed into the rows they were read from in a fixed order (gather.scatter_add_rows) and cast to
    the keys' dtype. A leaf's arithmetic does not depend on how many leaves come with it."""
    safe = indices.clamp(min=0)
    valid = indices >= 0
    with torch.enable_grad():
        g = kv_latent.detach().double()[safe].requires_grad_(need_kv)
        rope_rows = None if k_rope is None else k_rope.detach().double()[safe].requires_grad_(need_kr)
        q_leaves = [q.detach().requires_grad_(need_q) for q in q_latent.chunk(count, 1)]
        qr_leaves = ([None] * count if q_rope is None
                     else [q.detach().requires_grad_(need_qr) for q in q_rope.chunk(count, 1)])
        per_leaf = []
        for q, qr, go, gl in zip(q_leaves, qr_leaves, grad_out.chunk(count, 1), grad_lse.float().chunk(count, 1)):
            out, lse = _reference_over_rows(q, qr, g, rope_rows, valid, softmax_scale)
            finite_lse = torch.where(torch.isfinite(lse), lse, 0.0)
            inputs = [x for x in (q, qr, g, rope_rows) if x is not None and x.requires_grad]
            grads = iter(torch.autograd.grad([out, finite_lse], inputs, [go, gl], allow_unused=True))
            per_leaf.append([next(grads) if x is not None and x.requires_grad else None for x in (q, qr, g, rope_rows)])
    dq = torch.cat([leaf[0] for leaf in per_leaf], 1) if need_q else None
    dqr = torch.cat([leaf[1] for leaf in per_leaf], 1) if need_qr else None
    dkv = [_scatter_rows(leaf[2], safe, kv_latent) if need_kv else None for leaf in per_leaf]
    dkr = [_scatter_rows(leaf[3], safe, k_rope) if need_kr else None for leaf in per_leaf]
    return dq, dqr, dkv, dkr


def _scatter_rows(grad_rows, safe, like):
    """grad_rows [T, k, D] float64 (None: unused) summed into the rows of `like` they were read from,
    in a fixed order, then cast to like's dtype."""
    if grad_rows is None:
        return torch.zeros_like(like)
    return scatter_add_rows(grad_rows, safe, like.shape[0]).to(like.dtype)


def _checked_indices(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size,
                     vouched: bool = False) -> torch.Tensor:
    """Validates the arguments of `sparse_mla` -> indices as int64, bad entries made empty slots
    where the checks are deferred. vouched: a packing vouches for the indices (Packing.vouch), whose
    entries then lie in [-1, S) by construction: their value checks are skipped."""
    check_float("q_latent", q_latent)
    check_float("kv_latent", kv_latent)
    check_same_dtype(q_latent=q_latent, kv_latent=kv_latent, q_rope=q_rope, k_rope=k_rope)
    check_dim("q_latent", q_latent, 3, "[T, H, C]")
    check_dim("kv_latent", kv_latent, 2, "[S, C]")
    check_size("kv_latent", kv_latent.shape[1], q_latent.shape[2], "latent dim C vs q_latent")
    if (q_rope is None) != (k_rope is None):
        raise ValueError("q_rope and k_rope must both be given or both be None (NoPE)")
    if q_rope is not None:
        check_dim("q_rope", q_rope, 3, "[T, H, R]")
        check_dim("k_rope", k_rope, 2, "[S, R]")
        check_size("q_rope", tuple(q_rope.shape[:2]), tuple(q_latent.shape[:2]), "[T, H] vs q_latent")
        check_size("k_rope", k_rope.shape[0], kv_latent.shape[0], "S vs kv_latent")
        check_size("k_rope", k_rope.shape[1], q_rope.shape[2], "rope dim R vs q_rope")
    check_index("indices", indices)
    check_dim("indices", indices, 2, "[T, k]")
    check_size("indices", indices.shape[0], q_latent.shape[0], "T vs q_latent")
    check_same_device(q_latent=q_latent, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope, indices=indices)
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0 and passed explicitly, got {softmax_scale}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    s = kv_latent.shape[0]
    if vouched:
        return indices.long()
    if indices.numel():
        fail_if((indices >= s).any(), f"indices must be < {s}: the cache holds {s} tokens",
                lambda: f"got {int(indices.max())}")
        fail_if((indices < -1).any(), "indices must be >= 0, or -1 for an empty slot")
    indices = indices.long()
    if indices.numel() and defers_checks(indices):
        # the checks raise later: a bad index becomes an empty slot, never a read past the cache
        indices = torch.where((indices >= -1) & (indices < s), indices, -1)
    return indices


def _run(path, q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size):
    if path in ("triton", "torch"):
        impl = triton_ops() if path == "triton" else torch_ops()
        return impl.sparse_mla(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size)
    if path == "reference":
        return sparse_mla_reference(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale)
    if not records_graph(q_latent, kv_latent, *([] if q_rope is None else [q_rope, k_rope])):
        # inference: the same forward without autograd.Function's per-call host cost
        return _sparse_mla_chunked(q_latent, q_rope, kv_latent, k_rope, indices, float(softmax_scale), chunk_size)
    return _SparseMla.apply(q_latent, q_rope, kv_latent, k_rope, indices, float(softmax_scale), chunk_size)


def sparse_mla(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor | None,
    kv_latent: torch.Tensor,
    k_rope: torch.Tensor | None,
    indices: torch.Tensor,
    softmax_scale: float,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent [T, H, C], q_rope [T, H, R] | None, kv_latent [S, C], k_rope [S, R] | None,
    indices [T, k] into the S cached tokens -> (out [T, H, C] in q's dtype, lse [T, H] fp32).

    Rows whose index list holds no valid token get out = 0 and lse = -inf.
    """
    indices = _checked_indices(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size)
    return _run(path_for(q_latent), q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size)


def sparse_mla_leaves(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor | None,
    kv_latents: list[torch.Tensor],
    k_ropes: list[torch.Tensor] | None,
    indices: torch.Tensor,
    softmax_scale: float,
    chunk_size: int = DEFAULT_CHUNK,
    packing: "Packing | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_mla` with the H heads cut into G = len(kv_latents) equal consecutive leaves: leaf g's
    heads read kv_latents[g] and k_ropes[g], aliases of one kv_latent [S, C] and one k_rope [S, R]
    (collectives.fan_out makes them), and each alias gets only its leaf's gradient, which the
    caller sums over the leaves. Each head's output is that of `sparse_mla` over its leaf alone.

    Triton runs one forward launch for every head (rows of an MMA tile are independent) and one
    backward per kernel kind; the torch path calls `sparse_mla` per leaf (the per-query bmm's head
    count is its M, which CPU BLAS may block differently); the CPU path keeps those per-leaf bmms
    in one pass over the chunks that gathers each chunk's rows once for every leaf, and with
    autograd (`_SparseMlaLeaves`) a per-leaf float64 backward from rows gathered once.

    packing: the rows are fresh packed sequences, queries and keys alike (kv_latent has T rows), and
    each query's indices lie in its own sequence at or before it, strictly ascending (checked where
    used). Only the
    Triton backward uses it: the key gradients then run per sequence on tensor cores (sparse_mla_backward.py);
    the outputs and every other path are unchanged."""
    count = len(kv_latents)
    if count == 0 or (k_ropes is not None and len(k_ropes) != count):
        raise ValueError(f"kv_latents must hold one alias per head leaf (k_ropes as many), got {count} "
                         f"and {None if k_ropes is None else len(k_ropes)}")
    ropes = [None] * count if k_ropes is None else k_ropes
    for name, group in (("kv_latents", kv_latents), ("k_ropes", k_ropes or kv_latents)):
        if any(not isinstance(x, torch.Tensor) or x.data_ptr() != group[0].data_ptr() or x.shape != group[0].shape
               or x.stride() != group[0].stride() for x in group):
            raise ValueError(f"{name} must be aliases of one tensor, one per head leaf")
    vouched = packing is not None and packing.num_rows == kv_latents[0].shape[0] and packing.vouches_for(indices)
    indices = _checked_indices(q_latent, q_rope, kv_latents[0], ropes[0], indices, softmax_scale, chunk_size, vouched)
    if q_latent.shape[1] % count:
        raise ValueError(f"{q_latent.shape[1]} heads cannot be cut into {count} equal leaves")
    path = path_for(q_latent)
    if path == "triton":
        return triton_ops().sparse_mla_leaves(q_latent, q_rope, kv_latents, k_ropes, indices, softmax_scale,
                                              chunk_size, packing)
    if path == "cpu" and records_graph(q_latent, *kv_latents, *([] if q_rope is None else [q_rope, *ropes])):
        # training: every leaf in one pass over the chunks, each leaf's backward with its rows gathered once
        return _SparseMlaLeaves.apply(q_latent, q_rope, indices, float(softmax_scale), chunk_size, count,
                                      *kv_latents, *(k_ropes or []))
    q_lats, q_ropes = _leaf_queries(q_latent, q_rope, count)
    if path == "cpu":
        # inference: every leaf in one pass over the chunks, each with the bits of its own call
        return _sparse_mla_chunked_leaves(q_lats, q_ropes, kv_latents[0], ropes[0], indices, float(softmax_scale),
                                          chunk_size)
    parts = [_run(path, q, qr, kv, kr, indices, softmax_scale, chunk_size)
             for q, qr, kv, kr in zip(q_lats, q_ropes, kv_latents, ropes)]
    if count == 1:
        return parts[0]
    return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 1)
