"""Batch-invariant GEMM for matmul, linear and bmm: TMA loads, wgmma through tl.dot, persistent.

Why the bits cannot depend on M: every output tile reduces the full K in one loop of
BLOCK_K steps in ascending order into one fp32 accumulator (no split-K, no stream-K), and
the tile configuration is a function of (N, K, dtype, B layout, GPU) alone. Rows past M are
zero-filled by TMA and never stored. A row's position inside its tile changes which
registers hold it, not the arithmetic. fp32 runs with input_precision="ieee" (no TF32).

The persistent grid only changes which SM computes a tile, never how it is computed.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import (
    INTERPRET,
    aligned_cols,
    check_runnable,
    device_index,
    make_desc,
    num_sms,
    pad_cols,
    tma_ready,
)


@dataclasses.dataclass(frozen=True)
class MMConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = True
    flatten: bool = False


# Chosen on an H200 by `benchmarks/triton_bench.py --sweep` (2026-11-30): the best geometric
# mean of the cuBLAS/Triton time ratio over M in {1024, 4096, 8192}, weight [N, K] layout.
# Keys: (dtype, N, K); other shapes use _default_config.
TUNED: dict[tuple[torch.dtype, int, int], MMConfig] = {
    (torch.bfloat16, 4096, 4096): MMConfig(128, 256, 64, num_warps=8, num_stages=3),
    (torch.bfloat16, 2048, 7168): MMConfig(64, 256, 64, num_warps=4, num_stages=4),
    (torch.bfloat16, 7168, 2048): MMConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True),
}


def _default_config(n: int, k: int, dtype: torch.dtype) -> MMConfig:
    if INTERPRET:
        return MMConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        # the FMA path (no TF32): 64x64 is the largest tile ptxas keeps out of local memory
        return MMConfig(64, 64, 16, num_warps=4, num_stages=3, persistent=False)
    if n >= 4096:
        return MMConfig(128, 256, 64, num_warps=8, num_stages=3)
    if n >= 2048:
        return MMConfig(64, 256, 64, num_warps=4, num_stages=4)
    return MMConfig(128, 128, 64, num_warps=4, num_stages=4)


def config_for(n: int, k: int, dtype: torch.dtype) -> MMConfig:
    """The one tile configuration used for every M (the numerics contract)."""
    if not INTERPRET and (dtype, n, k) in TUNED:
        return TUNED[(dtype, n, k)]
    return _default_config(n, k, dtype)


# Tile shapes for ladder_config, most efficient first (one wgmma K-step: BLOCK_K = 64).
_LADDER = [
    MMConfig(128, 256, 64, num_warps=8, num_stages=3), MMConfig(64, 256, 64, num_warps=4, num_stages=4),
    MMConfig(128, 128, 64, num_warps=4, num_stages=4), MMConfig(64, 128, 64, num_warps=4, num_stages=6),
    MMConfig(64, 64, 64, num_warps=4, num_stages=6, persistent=False),
    MMConfig(64, 32, 64, num_warps=4, num_stages=8, persistent=False),
    MMConfig(64, 16, 64, num_warps=4, num_stages=8, persistent=False),
]


def ladder_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms_: int = 132) -> MMConfig:
    """EXPERIMENTAL, not used by the public ops, because it reads M: the most efficient tile
    that still gives ~every SM a tile. Every rung has the same BLOCK_K and K loop, so a row's
    arithmetic would only change if the tensor cores' per-element result depended on the
    instruction's M/N shape; the benchmark and a GPU test compare it bit for bit with the
    fixed configuration. Offered as evidence for relaxing "never from M" to "BLOCK_K and the
    K loop never from M"."""
    base = config_for(n, k, dtype)
    if dtype == torch.float32 or INTERPRET or base.block_k != 64:
        return base
    for cfg in _LADDER:
        if triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) >= 0.9 * num_sms_:
            return base if cfg.block_m == base.block_m and cfg.block_n == base.block_n else cfg
    return _LADDER[-1]


# M and the batch count are never specialized on (Triton would compile M == 1 separately)
@triton.jit(do_not_specialize=["M", "num_batches", "b_batch_rows", "stride_cb"])
def _mm_kernel(a_desc, b_desc, c_desc, c_ptr, bias_ptr, M, N, K, b_batch_rows, num_batches, stride_cb, stride_cm,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               NUM_PROGS: tl.constexpr, B_KMAJOR: tl.constexpr, HAS_BIAS: tl.constexpr,
               IEEE: tl.constexpr, UPCAST: tl.constexpr, FLATTEN: tl.constexpr, TMA_STORE: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    tiles_per_batch = tiles_m * tiles_n
    num_tiles = tiles_per_batch * num_batches
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(pid, num_tiles, NUM_PROGS, flatten=FLATTEN):
        bid = tile // tiles_per_batch
        t = tile % tiles_per_batch
        # grouped order: GROUP_M row-tiles share each weight column-tile while it is in L2
        per_group = GROUP_M * tiles_n
        first_m = (t // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (t % per_group) % group_rows
        pid_n = (t % per_group) // group_rows
        row_a = bid * M + pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([row_a, ki * BK])
            if B_KMAJOR:
                b = b_desc.load([bid * b_batch_rows + off_n, ki * BK]).T
            else:
                b = b_desc.load([bid * b_batch_rows + ki * BK, off_n])
            if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns as integers
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        offs_n = off_n + tl.arange(0, BN)
        c = acc.to(c_ptr.dtype.element_ty)
        if HAS_BIAS:
            # as torch's `gemm_out + bias`: the GEMM result is rounded first, then one add
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            c = (c.to(tl.float32) + bias.to(tl.float32)).to(c_ptr.dtype.element_ty)
        if TMA_STORE:
            # [B, M, N] descriptor: the copy engine clips rows past this batch entry's M
            # and columns past N, and a [BM, BN] tile of 64-bit pointers never exists
            c_desc.store([bid, pid_m * BM, off_n], c.reshape(1, BM, BN))
        else:
            offs_m = pid_m * BM + tl.arange(0, BM)
            ptrs = c_ptr + bid * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :]
            tl.store(ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _prep_a(a2: torch.Tensor) -> torch.Tensor:
    if tma_ready(a2):
        return a2
    es = a2.element_size()
    cols = aligned_cols(a2.shape[1], es)
    return pad_cols(a2, cols) if cols != a2.shape[1] else a2.contiguous()


def _prep_b(b: torch.Tensor, batches: int, block_k: int) -> tuple[torch.Tensor, bool]:
    """b [B, K, N] -> (2-D operand, k_major): K-major is [B*N, K], N-major is [B*K', N].

    The layout follows the weight's own strides (a linear weight [N, K] is K-major), never
    the activations. An N-major operand with B > 1 gets K padded to a BLOCK_K multiple so a
    K-tile cannot read the next batch entry's rows; zero rows are what TMA returns past the
    edge anyway, so padding does not change a single product."""
    _, k, n = b.shape
    es = b.element_size()
    n_major = b.stride(2) == 1 and (n * es) % 16 == 0
    if not n_major:
        return _prep_a(b.transpose(1, 2).reshape(batches * n, k)), True
    if batches > 1 and k % block_k:
        padded = b.new_zeros(batches, -(-k // block_k) * block_k, n)
        padded[:, :k] = b
        b = padded
    flat = b.reshape(-1, n)
    return (flat if tma_ready(flat) else flat.contiguous()), False


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
         cfg: MMConfig | None = None, pad_rows: bool = False) -> torch.Tensor:
    """a [B, M, K] x b [B, K, N] (+ bias [N]) -> [B, M, N] in a's dtype. B may be 1 with a
    weight shared by all rows. No autograd here; see the Function classes below.
    pad_rows (experimental): copy a lone partial row tile into BLOCK_M zero rows first, which
    changes no product, only how much of the TMA box lies past the tensor's edge."""
    batches, m, k = a.shape
    n = b.shape[2]
    dtype = a.dtype
    out = torch.empty(batches, m, n, dtype=dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        return out if bias is None else out + bias.to(dtype)
    cfg = cfg or config_for(n, k, dtype)
    a2 = _prep_a(a.reshape(batches * m, k))
    if pad_rows and batches == 1 and m < cfg.block_m:
        full = a2.new_zeros(cfg.block_m, a2.shape[1])
        full[:m] = a2
        a2 = full
    b2, k_major = _prep_b(b, batches, cfg.block_k)
    a_desc = make_desc(a2, [cfg.block_m, cfg.block_k])
    b_block = [cfg.block_n, cfg.block_k] if k_major else [cfg.block_k, cfg.block_n]
    b_desc = make_desc(b2, b_block)
    b_batch_rows = n if k_major else b2.shape[0] // batches
    tma_store = (n * out.element_size()) % 16 == 0
    c_desc = make_desc(out, [1, cfg.block_m, cfg.block_n]) if tma_store else a_desc
    tiles = batches * triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    progs = min(tiles, num_sms(device_index(a))) if cfg.persistent else tiles
    _mm_kernel[(progs,)](
        a_desc, b_desc, c_desc, out, bias if bias is not None else out, m, n, k, b_batch_rows, batches,
        out.stride(0), out.stride(1),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, NUM_PROGS=progs,
        B_KMAJOR=k_major, HAS_BIAS=bias is not None, IEEE=dtype == torch.float32,
        UPCAST=INTERPRET, FLATTEN=cfg.flatten, TMA_STORE=tma_store, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _check_pair(a: torch.Tensor, b: torch.Tensor, names: tuple[str, str]) -> None:
    for name, t in zip(names, (a, b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, bfloat16, float16")
        check_runnable(name, t)
    if a.dtype != b.dtype:
        raise TypeError(f"{names[0]} ({a.dtype}) and {names[1]} ({b.dtype}) must share one dtype")
    if a.device != b.device:
        raise ValueError(f"{names[0]} is on {a.device} but {names[1]} is on {b.device}")


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a2, b):
        ctx.save_for_backward(a2, b)
        return gemm(a2[None], b[None])[0]

    @staticmethod
    def backward(ctx, grad):
        a2, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = gemm(grad[None], b.t()[None])[0] if ctx.needs_input_grad[0] else None
        grad_b = gemm(a2.t()[None], grad[None])[0] if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias):
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return gemm(x2[None], weight.t()[None], bias)[0]

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = gemm(grad[None], weight[None])[0] if ctx.needs_input_grad[0] else None
        grad_w = gemm(grad.t()[None], x2[None])[0] if ctx.needs_input_grad[1] else None
        grad_b = grad.float().sum(0).to(grad.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class _Bmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return gemm(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = gemm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        grad_b = gemm(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [*, K] x b [K, N] -> [*, N]."""
    _check_pair(a, b, ("a", "b"))
    if a.dim() < 1 or b.dim() != 2:
        raise ValueError(f"matmul takes a [*, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"b: K is {b.shape[0]} but a.shape[-1] is {a.shape[-1]}")
    out = _Matmul.apply(a.reshape(-1, a.shape[-1]), b)
    return out.reshape(*a.shape[:-1], b.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [*, in], weight [out, in], bias [out] | None -> [*, out]; bias added after rounding."""
    _check_pair(x, weight, ("x", "weight"))
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [out, in={x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}")
    if bias is not None:
        _check_pair(x, bias, ("x", "bias"))
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    out = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] x b [B, K, N] -> [B, M, N]."""
    _check_pair(a, b, ("a", "b"))
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"bmm takes a [B, M, K] and b [B, K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    return _Bmm.apply(a, b)
