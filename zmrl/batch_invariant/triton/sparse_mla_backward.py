"""The backward pass of sparse MLA as Triton kernels: deterministic, batch-invariant, no floating-point
atomics, no host sync and no Python loop over query blocks or head leaves.

Shapes as in sparse_mla.py: q_latent [T, H, C], q_rope [T, H, R], kv_latent [S, C], k_rope [S, R],
indices [T, k]; the heads are cut into G equal consecutive leaves (the canonical head leaves of
zmrl.batch_invariant.collectives this host holds).

1. Query-major (`_query_kernel`), a program per (query row, block of BLOCK_H heads): recomputes a
   chunk's logits from q and the gathered rows, p = exp(logit - lse) from the saved lse,
   dp = dO . kv, ds = p (dp - delta + dlse) with delta = dO . out, and accumulates
   dq = scale * sum ds kv and dq_rope = scale * sum ds k_rope over the row's chunks in list order.
   A row's chunks start at its own list's first entry, and the rows of an MMA tile are
   independent, so a query's gradient does not depend on the other rows or heads of the call.
   It also stores delta [T, H] for kernel 2.
2. Key-major (`_key_kernel`), a program per (cache row s, head leaf g): the (query, slot) pairs are
   sorted by key row with a stable sort, so key s's pairs are contiguous and in ascending query
   order; the program walks them in blocks of BLOCK_P starting at its own first pair, recomputes
   p and ds per pair in fp32, and adds, head by head of its leaf in ascending order, each pair's
   scale * ds * q + p * dO  (and scale * ds * q_rope) to its lane of an fp32 [BLOCK_P, C]
   accumulator (lane i: the key's pairs i, i + BLOCK_P, ... in ascending order); the lanes are
   added by one fixed tree at the end.
   The order and the set of terms depend only on key s's own pairs (in a packed batch: queries of
   s's own sequence) and on the leaf's heads: not on the rest of the batch, nor on how many leaves
   this host holds. One gradient per leaf [G, S, C] is returned; the caller sums the leaves by the
   canonical tree (collectives.fan_out).

3. Sequence-tiled (`_key_tile_kernel`), in place of kernel 2 when the caller passes the call's packing
   (fresh packed sequences: the rows are the queries and the keys, each query's indices causal in its
   own sequence): a program per (tile of BLOCK_S keys of one sequence, head leaf) walks the leaf's
   heads, then the sequence's query tiles of BLOCK_T rows, recomputing [BLOCK_T, BLOCK_S] blocks of
   logits and dO . kv by MMA, masked by a per-query selection bitmap, and accumulates
   ds^T q + p^T dO by MMA. Tiles are cut from each sequence's first row, so the terms and their
   grouping depend on the key's own sequence and leaf only. Work grows with the sequence length
   squared, not with its selections; on tensor cores that is 7-10x faster than kernel 2 at the
   small and K3.1 dims (docs/benchmarks.md).

Memory: the fp32 temporaries are delta [T, H], the pair order [T * k] (or the bitmap [T, L / 64]) and
the per-leaf key gradients [G, S, C]; nothing of shape [T, k, C] is formed (logits are recomputed).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.graph_refs import hold_for_graph
from zmrl.batch_invariant.triton._common import INTERPRET, cdiv, next_power_of_2
from zmrl.batch_invariant.triton._launch import keyed


def _query_config(c: int) -> dict:
    """Tiles from the latent width only. BLOCK_H = 16: the smallest tl.dot tile; every head row of a
    tile gets its own bits, so a larger block would only add padded rows for small head counts."""
    if INTERPRET:
        return dict(BLOCK_H=16, CHUNK=16, num_warps=1, num_stages=1)
    return dict(BLOCK_H=16, CHUNK=32, num_warps=4 if c <= 256 else 8, num_stages=1)


def _key_config(c: int) -> dict:
    """BLOCK_P pairs per step: [BLOCK_P, C] fp32 tiles of q, dO and the accumulator in registers."""
    if INTERPRET:
        return dict(BLOCK_P=16, num_warps=1, num_stages=1)
    return dict(BLOCK_P=16, num_warps=4 if c <= 256 else 8, num_stages=1)


@triton.jit
def _query_kernel(ql_ptr, qr_ptr, kv_ptr, kr_ptr, idx_ptr, out_ptr, do_ptr, lse_ptr, dlse_ptr,
                  dq_ptr, dqr_ptr, delta_ptr, H, C, R, W, scale,
                  stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_kv, stride_kr, stride_it,
                  stride_ot, stride_oh, stride_dot, stride_doh, stride_lt, stride_dlt,
                  stride_dqt, stride_dqh, stride_dqrt, stride_dqrh, stride_delt,
                  CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_W: tl.constexpr, HAS_ROPE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    h_ok = offs_h < H
    hc_ok = h_ok[:, None] & (offs_c < C)[None, :]
    q = tl.load(ql_ptr + t * stride_qlt + offs_h[:, None] * stride_qlh + offs_c[None, :], mask=hc_ok, other=0.0)
    do = tl.load(do_ptr + t * stride_dot + offs_h[:, None] * stride_doh + offs_c[None, :], mask=hc_ok, other=0.0)
    o = tl.load(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :], mask=hc_ok, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    tl.store(delta_ptr + t * stride_delt + offs_h, delta, mask=h_ok)
    lse = tl.load(lse_ptr + t * stride_lt + offs_h, mask=h_ok, other=float("-inf"))
    finite = lse > float("-inf")  # an empty row (lse = -inf) has p = 0 everywhere
    lse = tl.where(finite, lse, 0.0)
    dterm = tl.load(dlse_ptr + t * stride_dlt + offs_h, mask=h_ok, other=0.0) - delta
    if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns as integers
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    if HAS_ROPE:
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        qr = tl.load(qr_ptr + t * stride_qrt + offs_h[:, None] * stride_qrh + offs_r[None, :],
                     mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        if UPCAST:
            qr = qr.to(tl.float32)
        acc_r = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    idx_row = idx_ptr + t * stride_it
    offs_w = tl.arange(0, BLOCK_W)
    last = tl.max(tl.where(tl.load(idx_row + offs_w, mask=offs_w < W, other=-1) >= 0, offs_w, -1), axis=0)
    acc = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
    offs_j = tl.arange(0, CHUNK)
    for ci in range(tl.cdiv(last + 1, CHUNK)):
        pos = ci * CHUNK + offs_j
        idx = tl.load(idx_row + pos, mask=pos < W, other=-1)
        valid = idx >= 0
        kv = tl.load(kv_ptr + idx[:, None] * stride_kv + offs_c[None, :], mask=valid[:, None] & (offs_c < C)[None, :],
                     other=0.0)
        if UPCAST:
            kv = kv.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(kv), input_precision="ieee")
            dp = tl.dot(do, tl.trans(kv), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kv))
            dp = tl.dot(do, tl.trans(kv))
        if HAS_ROPE:
            kr = tl.load(kr_ptr + idx[:, None] * stride_kr + offs_r[None, :], mask=valid[:, None] & r_ok[None, :],
                         other=0.0)
            if UPCAST:
                kr = kr.to(tl.float32)
            if IEEE:
                s = tl.dot(qr, tl.trans(kr), s, input_precision="ieee")
            else:
                s = tl.dot(qr, tl.trans(kr), s)
        p = tl.where(valid[None, :] & finite[:, None], tl.exp(s * scale - lse[:, None]), 0.0)
        ds = p * (dp + dterm[:, None])
        if IEEE:
            acc = tl.dot(ds, kv, acc, input_precision="ieee")
        else:  # ds rounded to the operand dtype for the MMA, as FlashAttention's dQ
            acc = tl.dot(ds.to(kv.dtype), kv, acc)
        if HAS_ROPE:
            if IEEE:
                acc_r = tl.dot(ds, kr, acc_r, input_precision="ieee")
            else:
                acc_r = tl.dot(ds.to(kr.dtype), kr, acc_r)
    tl.store(dq_ptr + t * stride_dqt + offs_h[:, None] * stride_dqh + offs_c[None, :],
             (acc * scale).to(dq_ptr.dtype.element_ty), mask=hc_ok)
    if HAS_ROPE:
        tl.store(dqr_ptr + t * stride_dqrt + offs_h[:, None] * stride_dqrh + offs_r[None, :],
                 (acc_r * scale).to(dqr_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])


@triton.jit
def _key_kernel(ql_ptr, qr_ptr, kv_ptr, kr_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, pair_t_ptr, bounds_ptr,
                dkv_ptr, dkr_ptr, C, R, heads_per_leaf, scale,
                stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_kv, stride_kr, stride_dot, stride_doh,
                stride_lt, stride_dlt, stride_delt, stride_dkvg, stride_dkvs, stride_dkrg, stride_dkrs,
                BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, HAS_ROPE: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    kv_s = tl.load(kv_ptr + s * stride_kv + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    # lane i of the [BLOCK_P, *] accumulators sums the pairs i, i + BLOCK_P, ... of this key; the lanes
    # are added by one fixed tree at the end (no cross-warp reduction per step)
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    if HAS_ROPE:
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        kr_s = tl.load(kr_ptr + s * stride_kr + offs_r, mask=r_ok, other=0.0).to(tl.float32)
        acc_r = tl.zeros((BLOCK_P, BLOCK_R), dtype=tl.float32)
    start = tl.load(bounds_ptr + s)
    end = tl.load(bounds_ptr + s + 1)
    offs_p = tl.arange(0, BLOCK_P)
    for p0 in range(start, end, BLOCK_P):
        ok = p0 + offs_p < end
        t = tl.load(pair_t_ptr + p0 + offs_p, mask=ok, other=0)
        pc_ok = ok[:, None] & c_ok[None, :]
        for hh in range(heads_per_leaf):  # the leaf's heads one after another, ascending
            h = g * heads_per_leaf + hh
            q = tl.load(ql_ptr + t[:, None] * stride_qlt + h * stride_qlh + offs_c[None, :], mask=pc_ok,
                        other=0.0).to(tl.float32)
            do = tl.load(do_ptr + t[:, None] * stride_dot + h * stride_doh + offs_c[None, :], mask=pc_ok,
                         other=0.0).to(tl.float32)
            logit = tl.sum(q * kv_s[None, :], axis=1)
            if HAS_ROPE:
                qr = tl.load(qr_ptr + t[:, None] * stride_qrt + h * stride_qrh + offs_r[None, :],
                             mask=ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                logit += tl.sum(qr * kr_s[None, :], axis=1)
            lse = tl.load(lse_ptr + t * stride_lt + h, mask=ok, other=0.0)
            dterm = (tl.load(dlse_ptr + t * stride_dlt + h, mask=ok, other=0.0)
                     - tl.load(delta_ptr + t * stride_delt + h, mask=ok, other=0.0))
            # a listed pair's row has a valid entry, so its lse is finite
            p = tl.where(ok, tl.exp(logit * scale - lse), 0.0)
            ds = p * (tl.sum(do * kv_s[None, :], axis=1) + dterm) * scale
            acc += ds[:, None] * q + p[:, None] * do
            if HAS_ROPE:
                acc_r += ds[:, None] * qr
    tl.store(dkv_ptr + g * stride_dkvg + s * stride_dkvs + offs_c, tl.sum(acc, axis=0).to(dkv_ptr.dtype.element_ty),
             mask=c_ok)
    if HAS_ROPE:
        tl.store(dkr_ptr + g * stride_dkrg + s * stride_dkrs + offs_r,
                 tl.sum(acc_r, axis=0).to(dkr_ptr.dtype.element_ty), mask=r_ok)


WORD = 64
"""Keys per word of the selection bitmap (one int64 per query and 64 keys of its sequence)."""


def _tile_config(c: int, dtype: torch.dtype) -> dict:
    """BLOCK_S keys per program (a divisor of WORD), BLOCK_T queries per step: the MMA's M and
    reduction widths for the key gradient. From the latent width and dtype only; the bf16 tiles
    measured fastest on an H200 (docs/benchmarks.md), 64 x 64 at C = 512 outgrows shared memory."""
    if INTERPRET:
        return dict(BLOCK_S=32, BLOCK_T=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_S=32, BLOCK_T=16, num_warps=8, num_stages=1)
    if c <= 256:
        return dict(BLOCK_S=64, BLOCK_T=64, num_warps=4, num_stages=1)
    return dict(BLOCK_S=32, BLOCK_T=64, num_warps=8, num_stages=2)


@triton.jit
def _key_tile_kernel(ql_ptr, qr_ptr, kv_ptr, kr_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, bits_ptr, tiles_ptr,
                     dkv_ptr, dkr_ptr, C, R, heads_per_leaf, scale,
                     stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_kv, stride_kr, stride_dot, stride_doh,
                     stride_lt, stride_dlt, stride_delt, stride_bits, stride_dkvg, stride_dkvs, stride_dkrg, stride_dkrs,
                     BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                     WORD_BITS: tl.constexpr, HAS_ROPE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    seq_start = tl.load(tiles_ptr + 3 * tile)
    key0 = tl.load(tiles_ptr + 3 * tile + 1)
    seq_end = tl.load(tiles_ptr + 3 * tile + 2)
    offs_s = key0 + tl.arange(0, BLOCK_S)
    s_ok = offs_s < seq_end
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    kv = tl.load(kv_ptr + offs_s[:, None] * stride_kv + offs_c[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns as integers
        kv = kv.to(tl.float32)
    acc = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    if HAS_ROPE:
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        kr = tl.load(kr_ptr + offs_s[:, None] * stride_kr + offs_r[None, :], mask=s_ok[:, None] & r_ok[None, :],
                     other=0.0)
        if UPCAST:
            kr = kr.to(tl.float32)
        acc_r = tl.zeros((BLOCK_S, BLOCK_R), dtype=tl.float32)
    rel = key0 - seq_start  # this tile's place in its sequence: its word and first bit in the bitmap
    word = rel // WORD_BITS
    shift = (rel % WORD_BITS + tl.arange(0, BLOCK_S)).to(tl.int64)
    # causal selections: no query before this tile's first key picks it; the walk starts at the query
    # tile holding that key, tiles counted from the sequence's first row, so the terms and their order
    # depend only on this sequence, never on where the batch placed it
    first = seq_start + (rel // BLOCK_T) * BLOCK_T
    for hh in range(heads_per_leaf):  # the leaf's heads one after another, ascending
        h = g * heads_per_leaf + hh
        for t0 in range(first, seq_end, BLOCK_T):  # then the query tiles, ascending
            offs_t = t0 + tl.arange(0, BLOCK_T)
            t_ok = offs_t < seq_end
            words = tl.load(bits_ptr + offs_t * stride_bits + word, mask=t_ok, other=0)
            picked = ((words[:, None] >> shift[None, :]) & 1) != 0  # [BLOCK_T, BLOCK_S]
            tc_ok = t_ok[:, None] & c_ok[None, :]
            q = tl.load(ql_ptr + offs_t[:, None] * stride_qlt + h * stride_qlh + offs_c[None, :], mask=tc_ok,
                        other=0.0)
            do = tl.load(do_ptr + offs_t[:, None] * stride_dot + h * stride_doh + offs_c[None, :], mask=tc_ok,
                         other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            if IEEE:
                logit = tl.dot(q, tl.trans(kv), input_precision="ieee")
                dp = tl.dot(do, tl.trans(kv), input_precision="ieee")
            else:
                logit = tl.dot(q, tl.trans(kv))
                dp = tl.dot(do, tl.trans(kv))
            if HAS_ROPE:
                qr = tl.load(qr_ptr + offs_t[:, None] * stride_qrt + h * stride_qrh + offs_r[None, :],
                             mask=t_ok[:, None] & r_ok[None, :], other=0.0)
                if UPCAST:
                    qr = qr.to(tl.float32)
                if IEEE:
                    logit = tl.dot(qr, tl.trans(kr), logit, input_precision="ieee")
                else:
                    logit = tl.dot(qr, tl.trans(kr), logit)
            lse = tl.load(lse_ptr + offs_t * stride_lt + h, mask=t_ok, other=0.0)
            dterm = (tl.load(dlse_ptr + offs_t * stride_dlt + h, mask=t_ok, other=0.0)
                     - tl.load(delta_ptr + offs_t * stride_delt + h, mask=t_ok, other=0.0))
            # a picked pair's row has a valid entry, so its lse is finite; unpicked pairs add exact zeros
            p = tl.where(picked, tl.exp(logit * scale - lse[:, None]), 0.0)
            ds = p * (dp + dterm[:, None]) * scale
            if IEEE:
                acc = tl.dot(tl.trans(ds), q, acc, input_precision="ieee")
                acc = tl.dot(tl.trans(p), do, acc, input_precision="ieee")
            else:  # p and ds rounded to the operand dtype for the MMA, as FlashAttention's dK and dV
                acc = tl.dot(tl.trans(ds).to(q.dtype), q, acc)
                acc = tl.dot(tl.trans(p).to(do.dtype), do, acc)
            if HAS_ROPE:
                if IEEE:
                    acc_r = tl.dot(tl.trans(ds), qr, acc_r, input_precision="ieee")
                else:
                    acc_r = tl.dot(tl.trans(ds).to(qr.dtype), qr, acc_r)
    tl.store(dkv_ptr + g * stride_dkvg + offs_s[:, None] * stride_dkvs + offs_c[None, :],
             acc.to(dkv_ptr.dtype.element_ty), mask=s_ok[:, None] & c_ok[None, :])
    if HAS_ROPE:
        tl.store(dkr_ptr + g * stride_dkrg + offs_s[:, None] * stride_dkrs + offs_r[None, :],
                 acc_r.to(dkr_ptr.dtype.element_ty), mask=s_ok[:, None] & r_ok[None, :])


@functools.lru_cache(maxsize=16)
def key_tiles(bounds: tuple[int, ...], device: torch.device, height: int) -> torch.Tensor:
    """[num_tiles, 3] int64 (sequence start, first key, sequence end): each packed sequence's keys cut
    into tiles of `height` rows from its own first row. Cached: every layer of a step reads the same."""
    rows = [(a, k, e) for a, e in zip(bounds, bounds[1:]) for k in range(a, e, height)]
    host = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
    if device.type == "cuda":  # pinned: the copy is asynchronous, no wait for the GPU queue
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def key_tiles_of(packing, device: torch.device, height: int) -> torch.Tensor:
    """The key tiles of `packing`: `key_tiles` of its host bounds, or, for a packing that plans for
    a width (one that may be refilled in place while a CUDA graph reads it; the Megatron trainer
    gives every packing one, so its eager steps take this path too, at the cost of a few small
    device ops per layer), the same tiles built on the device from its offsets
    (`refillable_key_tiles`)."""
    if packing.width is None:
        tiles = key_tiles(packing.bounds, device, height)
        hold_for_graph(tiles)  # cached: a graph that reads it must keep it
        return tiles
    return refillable_key_tiles(packing.cu_seqlens, packing.num_rows, height)


def refillable_key_tiles(cu_seqlens: torch.Tensor, num_rows: int, height: int) -> torch.Tensor:
    """[cdiv(T, height) + B, 3] int64: `key_tiles` of the offsets cu_seqlens [B + 1] (on the device,
    rising to T = num_rows), made by device ops alone, so that a CUDA graph rebuilds them from the
    offsets it is given; the tiles past the last real one are empty, (0, 0, 0), and their programs
    do nothing. B sequences of T rows hold at most cdiv(T, height) + B tiles, so the count is fixed
    by the shape. A tile's terms depend on its own row alone, so the empty ones change no bits."""
    b = cu_seqlens.numel() - 1
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    counts = (ends - starts + height - 1) // height
    past = counts.cumsum(0)  # tiles up to and including each sequence's
    tile = torch.arange(cdiv(num_rows, height) + b, device=cu_seqlens.device)
    seq = torch.searchsorted(past, tile, right=True)
    real = seq < b
    seq = seq.clamp(max=max(b - 1, 0))
    key0 = starts[seq] + (tile - (past[seq] - counts[seq])) * height
    return torch.stack([starts[seq], key0, ends[seq]], 1) * real[:, None]


@triton.jit
def _selection_bits_kernel(idx_ptr, first_ptr, bits_ptr, T, K, WORDS, stride_it, stride_ik, stride_f,
                           BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, WORD_BITS: tl.constexpr):
    """ORs bit (rel % WORD_BITS) into word rel // WORD_BITS of row t for each selection of BLOCK_T rows
    (rel: the index relative to the row's first_row), BLOCK_K slots at a time. The words are zero
    before the launch; OR commutes, so the integer result does not depend on the order of the atomics."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    first = tl.load(first_ptr + rows * stride_f, mask=row_ok, other=0).to(tl.int64)
    one = tl.full((BLOCK_T, BLOCK_K), 1, tl.int64)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols < K)[None, :]
        idx = tl.load(idx_ptr + rows[:, None] * stride_it + cols[None, :] * stride_ik, mask=ok, other=-1)
        rel = idx.to(tl.int64) - first[:, None]
        picked = ok & (idx >= 0) & (rel >= 0)
        rel = tl.where(picked, rel, 0)  # empty slots shift by 0, never by a negative amount
        word = rel // WORD_BITS
        # an int64 shift: bit 63 is the sign bit, 1 << 63 the int64 minimum, as torch's << gives it
        bit = one << (rel % WORD_BITS)
        # a word past the row's end is never written (an index outside the precondition sets nothing
        # there rather than writing into the next row)
        tl.atomic_or(bits_ptr + rows[:, None] * WORDS + word, bit, mask=picked & (word < WORDS), sem="relaxed")


def _bits_config(k: int) -> dict:
    """BLOCK_K slots per step, BLOCK_T rows per program: about 1024 slots a program (256 under the
    interpreter, whose cost is per program and per element). The result is integers, the same for
    any blocking."""
    budget = 256 if INTERPRET else 1024
    block_k = min(next_power_of_2(k), budget)
    return dict(BLOCK_T=budget // block_k, BLOCK_K=block_k)


def selection_bits(indices: torch.Tensor, first_row: torch.Tensor, max_len: int) -> torch.Tensor:
    """indices [T, k] into the packed rows (each row's own sequence, strictly ascending, -1 padded),
    first_row [T] (its sequence's first packed row) -> bitmap [T, ceil(max_len / WORD)] int64: bit b
    of word w of row t is set when t selects the key at position WORD w + b of its sequence.
    Precondition (the caller's packing checks or vouches for it): every index is -1 or in
    [first_row[t], first_row[t] + max_len), and a row's indices are distinct.

    Two launches: the zeroed bitmap and one Triton kernel that ORs each selection's bit into its
    word. OR commutes, so the words do not depend on the order of the atomics; distinct keys set
    distinct bits, so they also equal the per-word sum of the bits (a scatter-add's result)."""
    t_len, width = indices.shape
    words = cdiv(max_len, WORD)
    bits = torch.zeros(t_len, words, dtype=torch.int64, device=indices.device)
    if t_len == 0 or width == 0 or words == 0:
        return bits
    cfg = _bits_config(width)
    keyed(_selection_bits_kernel, "selection_bits", num_warps=4)(
        (cdiv(t_len, cfg["BLOCK_T"]), 1),
        (indices, first_row, bits, t_len, width, words, indices.stride(0), indices.stride(1), first_row.stride(0)),
        dict(**cfg, WORD_BITS=WORD))
    return bits


def pairs_by_key(indices: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [T, k] (-1 = none) -> (query row of each pair [T * k], sorted by key, ascending query
    within a key; bounds [S + 1]: key s's pairs are pair_t[bounds[s]:bounds[s + 1]]). On device."""
    width = indices.shape[1]
    flat = indices.reshape(-1)
    key = torch.where(flat >= 0, flat, num_keys)  # empty slots sort after every key
    sorted_key, order = torch.sort(key, stable=True)  # stable: a key's pairs keep ascending (t, j)
    bounds = torch.searchsorted(sorted_key, torch.arange(num_keys + 1, device=indices.device))
    return order // width, bounds


def sparse_mla_backward(q, qr, kv, kr, idx, out, lse, d_out, d_lse, scale, num_leaves, key_grads=True,
                        packing=None):
    """-> (dq [T, H, C], dqr [T, H, R] | None, dkv [G, S, C] | None, dkr [G, S, R] | None) in the
    inputs' dtype; dkv / dkr per head leaf (G = num_leaves), None when key_grads is False.

    packing (a zmrl.batch_invariant.Packing whose rows are both the queries and the keys, each
    query's indices in its own sequence at or before it, strictly ascending): the key gradients come from the
    sequence-tiled kernel on tensor cores; else from the key-major kernel over sorted pairs."""
    t_len, heads, c = q.shape
    num_keys, width = kv.shape[0], idx.shape[1]
    has_rope = qr is not None and qr.shape[-1] > 0
    rope_dim = qr.shape[-1] if has_rope else 0
    dev = q.device
    dq = torch.empty_like(q)
    dqr = torch.empty_like(qr) if qr is not None else None
    dkv = torch.zeros(num_leaves, num_keys, c, dtype=kv.dtype, device=dev) if key_grads else None
    dkr = (torch.zeros(num_leaves, num_keys, rope_dim, dtype=kv.dtype, device=dev)
           if key_grads and kr is not None else None)
    if t_len == 0 or heads == 0 or width == 0:
        return dq.zero_(), dqr.zero_() if dqr is not None else None, dkv, dkr
    ql, o, do = (x.contiguous() for x in (q, out, d_out))
    qr_ = qr.contiguous() if has_rope else ql
    kv_ = kv.contiguous()
    kr_ = kr.contiguous() if has_rope else kv_
    idx = idx.contiguous()
    dlse = d_lse.contiguous()
    delta = torch.empty(t_len, heads, dtype=torch.float32, device=dev)
    dqr_ = dqr if has_rope else dq
    block_c = next_power_of_2(c)
    block_r = max(16, next_power_of_2(max(rope_dim, 1)))
    cfg = _query_config(c)
    _query_kernel[(t_len, cdiv(heads, cfg["BLOCK_H"]))](
        ql, qr_, kv_, kr_, idx, o, do, lse, dlse, dq, dqr_, delta, heads, c, rope_dim, width, float(scale),
        ql.stride(0), ql.stride(1), qr_.stride(0), qr_.stride(1), kv_.stride(0), kr_.stride(0), idx.stride(0),
        o.stride(0), o.stride(1), do.stride(0), do.stride(1), lse.stride(0), dlse.stride(0),
        dq.stride(0), dq.stride(1), dqr_.stride(0), dqr_.stride(1), delta.stride(0),
        BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_W=next_power_of_2(width), HAS_ROPE=has_rope,
        IEEE=q.dtype == torch.float32, UPCAST=INTERPRET, **cfg,
    )
    if dqr is not None and not has_rope:  # a q_rope of width 0
        dqr.zero_()
    if not key_grads or num_keys == 0:
        return dq, dqr, dkv, dkr
    dkr_ = dkr if has_rope else dkv
    if packing is not None:
        cfg = _tile_config(c, q.dtype)
        tiles = key_tiles_of(packing, kv.device, cfg["BLOCK_S"])
        bits = selection_bits(idx, packing.first_row, packing.max_len)
        _key_tile_kernel[(tiles.shape[0], num_leaves)](
            ql, qr_, kv_, kr_, do, lse, dlse, delta, bits, tiles, dkv, dkr_, c, rope_dim, heads // num_leaves,
            float(scale), ql.stride(0), ql.stride(1), qr_.stride(0), qr_.stride(1), kv_.stride(0), kr_.stride(0),
            do.stride(0), do.stride(1), lse.stride(0), dlse.stride(0), delta.stride(0), bits.stride(0),
            dkv.stride(0), dkv.stride(1), dkr_.stride(0), dkr_.stride(1),
            BLOCK_C=block_c, BLOCK_R=block_r, WORD_BITS=WORD, HAS_ROPE=has_rope,
            IEEE=q.dtype == torch.float32, UPCAST=INTERPRET, **cfg,
        )
        return dq, dqr, dkv, dkr
    pair_t, bounds = pairs_by_key(idx, num_keys)
    _key_kernel[(num_keys, num_leaves)](
        ql, qr_, kv_, kr_, do, lse, dlse, delta, pair_t, bounds, dkv, dkr_, c, rope_dim, heads // num_leaves,
        float(scale), ql.stride(0), ql.stride(1), qr_.stride(0), qr_.stride(1), kv_.stride(0), kr_.stride(0),
        do.stride(0), do.stride(1), lse.stride(0), dlse.stride(0), delta.stride(0),
        dkv.stride(0), dkv.stride(1), dkr_.stride(0), dkr_.stride(1),
        BLOCK_C=block_c, BLOCK_R=block_r, HAS_ROPE=has_rope, **_key_config(c),
    )
    return dq, dqr, dkv, dkr
