"""DSA lightning-indexer scores, invariant in the number of queries and of keys.

score[t, s] = sum over h ascending of w[t, h] * relu(q[t, h] . k[s]), -inf where
k_pos[s] > q_pos[t]. A program owns a [BLOCK_T, BLOCK_S] tile of one sequence's scores; the dot products
are one tl.dot of [BLOCK_T, D] x [D, BLOCK_S] per head (the whole head dim in one fixed
reduction), and the heads are added into one fp32 accumulator in ascending order. Tile
sizes come from (H, D, dtype) only, so neither T nor S changes any element's arithmetic.
Packed sequences (`indexer_scores_varlen`) add a grid dimension over the sequences: a program
reads its sequence's row offsets, so one launch scores every sequence against its own keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import INTERPRET, cdiv, check_runnable, next_power_of_2


def _config(d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_S, num_warps, num_stages)."""
    if INTERPRET:
        return 16, 16, 1, 1
    if dtype == torch.float32:
        return 32, 64, 4, 2
    return 64, 128, 8, 3


@triton.jit(do_not_specialize=["T", "S", "OUT_W"])
def _indexer_kernel(q_ptr, w_ptr, k_ptr, qpos_ptr, kpos_ptr, out_ptr, cuq_ptr, cuk_ptr, T, S, OUT_W, H, D,
                    stride_qt, stride_qh, stride_wt, stride_ks, stride_ot,
                    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                    VARLEN: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Program (query tile, key tile, sequence b): b's queries rows cu_q[b]:cu_q[b+1], its keys
    rows cu_k[b]:cu_k[b+1]; tiles count from the sequence's first row, columns are key indices
    within the sequence. Without VARLEN the call is one sequence: T queries, S keys."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    seq = tl.program_id(2)
    if VARLEN:
        q0 = tl.load(cuq_ptr + seq)
        t_len = tl.load(cuq_ptr + seq + 1) - q0
    else:
        q0 = 0
        t_len = T
    if pid_t * BLOCK_T < t_len:
        if VARLEN:
            k0 = tl.load(cuk_ptr + seq)
            s_len = tl.load(cuk_ptr + seq + 1) - k0
        else:
            k0 = 0
            s_len = S
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        t_ok = offs_t < t_len
        s_ok = offs_s < s_len
        d_ok = offs_d < D
        rows_t = (q0 + offs_t).to(tl.int64)
        rows_s = (k0 + offs_s).to(tl.int64)
        k = tl.load(k_ptr + rows_s[:, None] * stride_ks + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        kt = tl.trans(k)
        if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns as integers
            kt = kt.to(tl.float32)
        acc = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.float32)
        q_rows = q_ptr + rows_t[:, None] * stride_qt + offs_d[None, :]
        for h in range(H):
            q = tl.load(q_rows + h * stride_qh, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            if IEEE:
                dots = tl.dot(q, kt, input_precision="ieee")
            else:
                dots = tl.dot(q, kt)
            w = tl.load(w_ptr + rows_t * stride_wt + h, mask=t_ok, other=0.0).to(tl.float32)
            acc = acc + tl.maximum(dots, 0.0) * w[:, None]
        qpos = tl.load(qpos_ptr + rows_t, mask=t_ok, other=0)
        kpos = tl.load(kpos_ptr + rows_s, mask=s_ok, other=0)
        acc = tl.where((kpos[None, :] > qpos[:, None]) | (offs_s[None, :] >= s_len), float("-inf"), acc)
        tl.store(out_ptr + rows_t[:, None] * stride_ot + offs_s[None, :], acc,
                 mask=t_ok[:, None] & (offs_s[None, :] < OUT_W))


def _launch(q, weights, k, q_pos, k_pos, cu_q, cu_k, num_seqs: int, max_q: int, out: torch.Tensor) -> None:
    """cu_q / cu_k None: one sequence of q.shape[0] queries and k.shape[0] keys."""
    heads, d = q.shape[1], q.shape[2]
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(1) == 1 else k.contiguous()
    weights = weights.contiguous()
    block_t, block_s, warps, stages = _config(d, q.dtype)
    grid = (cdiv(max_q, block_t), cdiv(out.shape[1], block_s), num_seqs)
    _indexer_kernel[grid](
        q, weights, k, q_pos.reshape(-1).long().contiguous(), k_pos.reshape(-1).long().contiguous(), out,
        out if cu_q is None else cu_q, out if cu_k is None else cu_k, q.shape[0], k.shape[0], out.shape[1],
        heads, d, q.stride(0), q.stride(1), weights.stride(0), k.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_D=max(16, next_power_of_2(d)), VARLEN=cu_q is not None,
        IEEE=q.dtype == torch.float32, UPCAST=INTERPRET, num_warps=warps, num_stages=stages,
    )


def _check(q, weights, k, q_pos, k_pos) -> None:
    for name, t in (("q", q), ("weights", weights), ("k", k), ("q_pos", q_pos), ("k_pos", k_pos)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_runnable(name, t)
    if q.dim() != 3 or k.dim() != 2 or q.shape[2] != k.shape[1]:
        raise ValueError(f"q must be [T, H, D] and k [S, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q ({q.dtype}) and k ({k.dtype}) must share one float dtype")
    if tuple(weights.shape) != tuple(q.shape[:2]) or not weights.is_floating_point():
        raise ValueError(f"weights must be float [T, H] = {tuple(q.shape[:2])}, got {tuple(weights.shape)}")
    for name, pos, n in (("q_pos", q_pos, q.shape[0]), ("k_pos", k_pos, k.shape[0])):
        if pos.dtype not in (torch.int64, torch.int32) or pos.numel() != n:
            raise ValueError(f"{name} must be an int tensor of {n} positions, got {pos.dtype} {tuple(pos.shape)}")


def indexer_scores_varlen(q, weights, k, q_pos, k_pos, cu_q, cu_k, max_q: int, max_k: int) -> torch.Tensor:
    """Packed sequences: q [T, H, D] / k [S, D] with sequence b in rows cu_q[b]:cu_q[b+1] /
    cu_k[b]:cu_k[b+1] -> [T, max_k] fp32, column j = key j of the query's own sequence (-inf past
    its keys). One launch; each score has the bits of a call over its sequence alone."""
    _check(q, weights, k, q_pos, k_pos)
    out = torch.empty(q.shape[0], max_k, dtype=torch.float32, device=q.device)
    if q.shape[0] == 0 or max_k == 0:
        return out.fill_(float("-inf"))
    cu_q = cu_q.to(device=q.device, dtype=torch.int64).contiguous()
    cu_k = cu_k.to(device=q.device, dtype=torch.int64).contiguous()
    _launch(q, weights, k, q_pos, k_pos, cu_q, cu_k, cu_q.numel() - 1, max_q, out)
    return out


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                   q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], weights [T, H], k [S, D], q_pos [T] and k_pos [S] (int) -> [T, S] fp32."""
    _check(q, weights, k, q_pos, k_pos)
    t_len, s_len = q.shape[0], k.shape[0]
    out = torch.empty(t_len, s_len, dtype=torch.float32, device=q.device)
    if t_len == 0 or s_len == 0:
        return out
    _launch(q, weights, k, q_pos, k_pos, None, None, 1, t_len, out)
    return out
