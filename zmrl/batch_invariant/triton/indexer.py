"""DSA lightning-indexer scores, invariant in the number of queries and of keys.

score[t, s] = sum over h ascending of w[t, h] * relu(q[t, h] . k[s]), -inf where
k_pos[s] > q_pos[t]. A program owns a [BLOCK_T, BLOCK_S] tile of scores; the dot products
are one tl.dot of [BLOCK_T, D] x [D, BLOCK_S] per head (the whole head dim in one fixed
reduction), and the heads are added into one fp32 accumulator in ascending order. Tile
sizes come from (H, D, dtype) only, so neither T nor S changes any element's arithmetic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import INTERPRET, check_runnable


def _config(d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_S, num_warps, num_stages)."""
    if INTERPRET:
        return 16, 16, 1, 1
    if dtype == torch.float32:
        return 32, 64, 4, 2
    return 64, 128, 8, 3


@triton.jit(do_not_specialize=["T", "S"])
def _indexer_kernel(q_ptr, w_ptr, k_ptr, qpos_ptr, kpos_ptr, out_ptr, T, S, H, D,
                    stride_qt, stride_qh, stride_wt, stride_ks, stride_ot,
                    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < T
    s_ok = offs_s < S
    d_ok = offs_d < D
    k = tl.load(k_ptr + offs_s[:, None].to(tl.int64) * stride_ks + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    kt = tl.trans(k)
    if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns as integers
        kt = kt.to(tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.float32)
    q_rows = q_ptr + offs_t[:, None].to(tl.int64) * stride_qt + offs_d[None, :]
    for h in range(H):
        q = tl.load(q_rows + h * stride_qh, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        if IEEE:
            dots = tl.dot(q, kt, input_precision="ieee")
        else:
            dots = tl.dot(q, kt)
        w = tl.load(w_ptr + offs_t.to(tl.int64) * stride_wt + h, mask=t_ok, other=0.0).to(tl.float32)
        acc = acc + tl.maximum(dots, 0.0) * w[:, None]
    qpos = tl.load(qpos_ptr + offs_t, mask=t_ok, other=0)
    kpos = tl.load(kpos_ptr + offs_s, mask=s_ok, other=0)
    acc = tl.where(kpos[None, :] > qpos[:, None], float("-inf"), acc)
    tl.store(out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + offs_s[None, :], acc,
             mask=t_ok[:, None] & s_ok[None, :])


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                   q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], weights [T, H], k [S, D], q_pos [T], k_pos [S] (int) -> [T, S] fp32."""
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
    t_len, heads, d = q.shape
    s_len = k.shape[0]
    out = torch.empty(t_len, s_len, dtype=torch.float32, device=q.device)
    if t_len == 0 or s_len == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(1) == 1 else k.contiguous()
    weights = weights.contiguous()
    block_t, block_s, warps, stages = _config(d, q.dtype)
    grid = (triton.cdiv(t_len, block_t), triton.cdiv(s_len, block_s))
    _indexer_kernel[grid](
        q, weights, k, q_pos.reshape(-1).long().contiguous(), k_pos.reshape(-1).long().contiguous(), out,
        t_len, s_len, heads, d, q.stride(0), q.stride(1), weights.stride(0), k.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_D=max(16, triton.next_power_of_2(d)),
        IEEE=q.dtype == torch.float32, UPCAST=INTERPRET, num_warps=warps, num_stages=stages,
    )
    return out
