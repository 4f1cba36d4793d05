"""Sparse MLA, absorbed (MQA) form: one kernel for prefill, decode and the trainer's forward.

A program owns one query row t, a block of BLOCK_H heads (the MQA tile's M dimension is
heads, never tokens) and a block of output columns, and walks that row's index list in chunks of `chunk_size` entries in
list order: logits = (q_latent . kv + q_rope . k_rope) * scale as one fp32 accumulator,
online softmax with fp32 running max, sum and output accumulator. Nothing in that sequence
depends on how many other rows the call holds, so prefill == decode bit for bit. Chunks
past the last valid index are skipped; they would add exact zeros.

Rows of an MMA tile are independent (each output element from its own row, in the same K
order), so a head's bits do not depend on which other heads share its tile: `sparse_mla_leaves`
runs every head this host holds in one launch, and each head gets the bits of a call over its
canonical head leaf alone. The backward (sparse_mla_backward.py) is two Triton kernels, query-major
for the query gradients and key-major (or, given the call's packing, sequence-tiled on tensor cores)
for the per-leaf key gradients: deterministic, no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant._checks import fail_if
from zmrl.batch_invariant.triton._common import INTERPRET, cdiv, check_runnable, next_power_of_2
from zmrl.batch_invariant.triton.sparse_mla_backward import sparse_mla_backward


def _config(heads: int, c: int, dtype: torch.dtype) -> dict:
    """Tiles from the latent width and dtype only: never from T, the index list or the head count.

    The tile height is a constant, not the head count of the call, because a tensor-parallel rank
    holds 1/TP of the heads, and a 64-row bf16 tile (Hopper's wgmma) and a 16-row one (mma) gave
    other bits for the same inputs on an H200: a height chosen from the heads present would give
    TP = 1 and TP = 8 other bits. 16 rows, because MLA hosts hold few heads (2-16 per rank): a 64-row tile
    then computes mostly masked rows. Measured on an H200 (bf16, 2026-12-02, packed prefill): the
    small preset's 16 heads (C = 256 + 32, 256 keys, 14,720 rows) 3.50 -> 0.91 ms, 8 heads (its TP 2)
    3.43 -> 0.89 ms; K3.1's 12 heads of TP 8 (C = 512, 2,048 keys) 15.0 -> 4.0 ms, and its 96 heads
    of TP 1 29.5 -> 23.8 ms (a 64-row tile would take 17.3 ms there, but only TP = 1 holds that
    many heads)."""
    if INTERPRET:
        return dict(BLOCK_H=16, BLOCK_CV=32, BLOCK_CK=32, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_H=16, BLOCK_CV=32, BLOCK_CK=32, num_warps=8, num_stages=1)
    return dict(BLOCK_H=16, BLOCK_CV=min(256, max(32, next_power_of_2(c))), BLOCK_CK=64,
                num_warps=4, num_stages=2)


@triton.jit
def _sparse_mla_kernel(ql_ptr, qr_ptr, kv_ptr, kr_ptr, idx_ptr, out_ptr, lse_ptr,
                       H, C, R, W, scale,
                       stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_kv, stride_kr,
                       stride_it, stride_ot, stride_oh, stride_lt,
                       CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_CV: tl.constexpr,
                       BLOCK_CK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                       HAS_ROPE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Program (t, head block, output-column block). The logits use all of C, reduced in
    BLOCK_CK slices in ascending order; each program then accumulates only its BLOCK_CV
    output columns, so the fp32 accumulator fits in registers. Every column-block program
    computes the identical logits, so all of a row's columns see one softmax."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_cv = tl.program_id(2) * BLOCK_CV + tl.arange(0, BLOCK_CV)
    offs_ck = tl.arange(0, BLOCK_CK)
    h_ok = offs_h < H
    cv_ok = offs_cv < C
    q_rows = ql_ptr + t * stride_qlt + offs_h[:, None] * stride_qlh
    if HAS_ROPE:
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        qr = tl.load(qr_ptr + t * stride_qrt + offs_h[:, None] * stride_qrh + offs_r[None, :],
                     mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns as integers
            qr = qr.to(tl.float32)
    idx_row = idx_ptr + t * stride_it

    # chunks up to the last valid entry; the rest of the list is padding
    offs_w = tl.arange(0, BLOCK_W)
    last = tl.max(tl.where(tl.load(idx_row + offs_w, mask=offs_w < W, other=-1) >= 0, offs_w, -1), axis=0)
    num_chunks = tl.cdiv(last + 1, CHUNK)

    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_CV), dtype=tl.float32)
    offs_j = tl.arange(0, CHUNK)
    for ci in range(num_chunks):
        pos = ci * CHUNK + offs_j
        idx = tl.load(idx_row + pos, mask=pos < W, other=-1)
        valid = idx >= 0
        kv_rows = kv_ptr + idx[:, None] * stride_kv
        s = tl.zeros((BLOCK_H, CHUNK), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_CK):
            ck_ok = c0 + offs_ck < C
            q = tl.load(q_rows + c0 + offs_ck[None, :], mask=h_ok[:, None] & ck_ok[None, :], other=0.0)
            kc = tl.load(kv_rows + c0 + offs_ck[None, :], mask=valid[:, None] & ck_ok[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                kc = kc.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(kc), s, input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(kc), s)
        if HAS_ROPE:
            kr = tl.load(kr_ptr + idx[:, None] * stride_kr + offs_r[None, :],
                         mask=valid[:, None] & r_ok[None, :], other=0.0)
            if UPCAST:
                kr = kr.to(tl.float32)
            if IEEE:
                s = tl.dot(qr, tl.trans(kr), s, input_precision="ieee")
            else:
                s = tl.dot(qr, tl.trans(kr), s)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no token yet: exp(-inf) = 0, not NaN
        alpha = tl.exp(m_i - shift)
        p = tl.exp(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_rows + offs_cv[None, :], mask=valid[:, None] & cv_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    empty = l_i == 0.0
    out = tl.where(empty[:, None], 0.0, tl.div_rn(acc, tl.where(empty, 1.0, l_i)[:, None]))
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_cv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & cv_ok[None, :])
    if tl.program_id(2) == 0:
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptr + t * stride_lt + offs_h, lse, mask=h_ok)


def sparse_mla_forward(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size, cfg=None):
    t_len, heads, c = q_latent.shape
    out = torch.empty_like(q_latent)
    lse = torch.empty(t_len, heads, dtype=torch.float32, device=q_latent.device)
    if t_len == 0 or heads == 0:
        return out, lse
    width = indices.shape[1]
    if width == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    has_rope = q_rope is not None and q_rope.shape[-1] > 0
    ql = q_latent if q_latent.stride(2) == 1 else q_latent.contiguous()
    kv = kv_latent if kv_latent.stride(1) == 1 else kv_latent.contiguous()
    qr = (q_rope if q_rope.stride(2) == 1 else q_rope.contiguous()) if has_rope else ql
    kr = (k_rope if k_rope.stride(1) == 1 else k_rope.contiguous()) if has_rope else kv
    idx = indices if indices.stride(1) == 1 else indices.contiguous()
    cfg = cfg or _config(heads, c, q_latent.dtype)  # an explicit cfg is for the benchmark's sweep
    rope_dim = q_rope.shape[-1] if has_rope else 0
    grid = (t_len, cdiv(heads, cfg["BLOCK_H"]), cdiv(c, cfg["BLOCK_CV"]))
    _sparse_mla_kernel[grid](
        ql, qr, kv, kr, idx, out, lse, heads, c, rope_dim, width, float(softmax_scale),
        ql.stride(0), ql.stride(1), qr.stride(0), qr.stride(1), kv.stride(0), kr.stride(0),
        idx.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        CHUNK=chunk_size, BLOCK_R=max(16, next_power_of_2(max(rope_dim, 1))),
        BLOCK_W=next_power_of_2(width), HAS_ROPE=has_rope, IEEE=q_latent.dtype == torch.float32,
        UPCAST=INTERPRET, **cfg,
    )
    return out, lse


class _SparseMla(torch.autograd.Function):
    """One forward launch for every head; the backward by the kernels of sparse_mla_backward.py.
    `keys` holds one alias of kv_latent per head leaf, then one of k_rope per leaf (with rope): leaf
    g's heads read its aliases, and each alias gets its leaf's gradient."""

    @staticmethod
    def forward(ctx, q_latent, q_rope, indices, softmax_scale, chunk_size, num_leaves, packing, *keys):
        kv_latent, k_rope = keys[0], keys[num_leaves] if q_rope is not None else None
        out, lse = sparse_mla_forward(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size)
        ctx.save_for_backward(q_latent, q_rope, kv_latent, k_rope, indices, out, lse)
        ctx.scale, ctx.num_leaves, ctx.packing = softmax_scale, num_leaves, packing
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, qr, kv, kr, idx, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        if d_lse is None:
            d_lse = torch.zeros_like(lse)
        key_grads = any(ctx.needs_input_grad[7:])
        dq, dqr, dkv, dkr = sparse_mla_backward(q, qr, kv, kr, idx, out, lse, d_out, d_lse, ctx.scale,
                                                ctx.num_leaves, key_grads, ctx.packing)
        key_grads = [None] * (len(ctx.needs_input_grad) - 7) if dkv is None else \
            [*dkv.unbind(0), *(dkr.unbind(0) if dkr is not None else ())]
        return (dq, dqr, None, None, None, None, None, *key_grads)


def _check_packed_indices(indices: torch.Tensor, packing, num_keys: int) -> None:
    """What the sequence-tiled backward relies on: the packing's rows are the queries and the keys,
    and every listed key lies in its query's own sequence at or before the query (causal), strictly
    ascending (deferred on a GPU; skipped for indices the packing vouches for, Packing.vouch)."""
    if packing.num_rows != indices.shape[0] or packing.num_rows != num_keys:
        raise ValueError(f"the packing holds {packing.num_rows} rows; the queries ({indices.shape[0]}) and "
                         f"the keys ({num_keys}) must be those rows")
    if packing.first_row.device != indices.device:
        raise ValueError(f"the packing lives on {packing.first_row.device}, the indices on {indices.device}")
    if not indices.numel() or packing.vouches_for(indices):  # a vouched selection holds these by construction
        return
    picked = indices >= 0
    rows = torch.arange(indices.shape[0], device=indices.device)[:, None]
    fail_if((picked & ((indices < packing.first_row[:, None]) | (indices > rows))).any(),
            "with a packing, every index must lie in its query's own sequence, at or before the query")
    fail_if((picked[:, 1:] & (indices[:, 1:] <= indices[:, :-1])).any(),
            "with a packing, each query's indices must be strictly ascending")


def sparse_mla(q_latent: torch.Tensor, q_rope: torch.Tensor | None, kv_latent: torch.Tensor,
               k_rope: torch.Tensor | None, indices: torch.Tensor, softmax_scale: float,
               chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent [T, H, C], q_rope [T, H, R] | None, kv_latent [S, C], k_rope [S, R] | None,
    indices [T, k] int64 (-1 = none, valid first) -> (out [T, H, C] q dtype, lse [T, H] fp32)."""
    return sparse_mla_leaves(q_latent, q_rope, [kv_latent], None if k_rope is None else [k_rope], indices,
                             softmax_scale, chunk_size)


def sparse_mla_leaves(q_latent: torch.Tensor, q_rope: torch.Tensor | None, kv_latents: list[torch.Tensor],
                      k_ropes: list[torch.Tensor] | None, indices: torch.Tensor, softmax_scale: float,
                      chunk_size: int = 64, packing=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_mla` with the H heads cut into G = len(kv_latents) equal consecutive leaves: one
    forward launch for all of them; leaf g's heads read kv_latents[g] and k_ropes[g], aliases of
    one kv_latent [S, C] and one k_rope [S, R], and each alias gets only its leaf's gradient.
    packing (zmrl.batch_invariant.Packing, rows = queries = keys, indices in each query's own
    sequence at or before it, strictly ascending): the key gradients by the sequence-tiled backward kernel."""
    if not kv_latents or (k_ropes is not None and len(k_ropes) != len(kv_latents)):
        raise ValueError(f"kv_latents must hold one alias per head leaf (k_ropes as many), got "
                         f"{len(kv_latents)} and {None if k_ropes is None else len(k_ropes)}")
    kv_latent, k_rope = kv_latents[0], None if k_ropes is None else k_ropes[0]
    for name, x in (("q_latent", q_latent), ("kv_latent", kv_latent), ("indices", indices),
                    ("q_rope", q_rope), ("k_rope", k_rope)):
        if x is None and name in ("q_rope", "k_rope"):
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        check_runnable(name, x)
    if (q_rope is None) != (k_rope is None):
        raise ValueError("q_rope and k_rope must both be given or both be None (NoPE)")
    if q_latent.dim() != 3 or kv_latent.dim() != 2 or kv_latent.shape[1] != q_latent.shape[2]:
        raise ValueError(f"q_latent must be [T, H, C] and kv_latent [S, C], got "
                         f"{tuple(q_latent.shape)} and {tuple(kv_latent.shape)}")
    dtypes = {x.dtype for x in (q_latent, q_rope, kv_latent, k_rope) if x is not None}
    if len(dtypes) != 1 or q_latent.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q_latent, q_rope, kv_latent, k_rope must share one float dtype, got {dtypes}")
    if q_rope is not None and (q_rope.shape[:2] != q_latent.shape[:2] or k_rope.dim() != 2
                               or k_rope.shape != (kv_latent.shape[0], q_rope.shape[2])):
        raise ValueError(f"q_rope must be [T, H, R] and k_rope [S, R], got {tuple(q_rope.shape)} "
                         f"and {tuple(k_rope.shape)}")
    if indices.dtype != torch.int64 or indices.dim() != 2 or indices.shape[0] != q_latent.shape[0]:
        raise ValueError(f"indices must be int64 [T={q_latent.shape[0]}, k], got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 16 \
            or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 (a tl.dot tile), got {chunk_size}")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    for name, group in (("kv_latents", kv_latents), ("k_ropes", k_ropes or kv_latents)):
        first = group[0]
        if any(x.data_ptr() != first.data_ptr() or x.shape != first.shape
               or x.stride() != first.stride() for x in group):
            raise ValueError(f"{name} must be aliases of one tensor (one per head leaf)")
    if q_latent.dim() == 3 and q_latent.shape[1] % len(kv_latents):
        raise ValueError(f"{q_latent.shape[1]} heads cannot be cut into {len(kv_latents)} equal leaves")
    if packing is not None:
        inputs = (q_latent, q_rope, *kv_latents, *(k_ropes or ()))
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
            _check_packed_indices(indices, packing, kv_latent.shape[0])
        else:  # only the backward reads it: an inference forward pays for no check
            packing = None
    return _SparseMla.apply(q_latent, q_rope, indices, float(softmax_scale), chunk_size, len(kv_latents), packing,
                            *kv_latents, *(k_ropes or ()))
