"""The GEMM kernel and one launch of it with a given tile config: TMA loads, wgmma through
tl.dot, persistent.

Why the bits cannot depend on M: every output tile reduces the full K in one loop of BLOCK_K
steps in ascending order into one fp32 accumulator (for a split-K shape, each of its fixed K
ranges does, and the ranges' partial sums are added in one fixed order: _splitk.py), and the
fixed tile configuration is a function of (N, K, dtype, B layout, GPU) alone (_gemm_config.py).
Rows past M are zero-filled by TMA and never stored. A row's position inside its tile changes
which registers hold it, not the arithmetic. fp32 runs with input_precision="ieee" (no TF32).
The persistent grid only changes which SM computes a tile, never how it is computed.

`launch_config` launches through Triton's JIT and returns what a launch plan (_gemm_plan.py) needs to
repeat the same launch later without the JIT.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton import _gemm_plan
from zmrl.batch_invariant.triton._common import (
    INTERPRET,
    aligned_cols,
    cdiv,
    device_index,
    make_desc,
    num_sms,
    pad_cols,
    tma_ready,
)
from zmrl.batch_invariant.triton import _gemm_stream
from zmrl.batch_invariant.triton._gemm_config import MMConfig, split_align
from zmrl.batch_invariant.triton._gemm_stream import stream_tiles
from zmrl.batch_invariant.triton._gemm_tile import k_range, range_tiles, store_tile, tile_at, whole_tile
from zmrl.batch_invariant.triton._splitk import effective_splits, k_chunk, sum_partials


# M and the batch count are never specialized on (Triton would compile M == 1 separately)
@triton.jit(do_not_specialize=["M", "num_batches", "b_batch_rows", "stride_cb", "k_chunk"])
def _mm_kernel(a_desc, b_desc, c_desc, c_ptr, bias_ptr, ws_ptr, flag_ptr, M, N, K, k_chunk, b_batch_rows, num_batches,
               stride_cb, stride_cm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               NUM_PROGS: tl.constexpr, B_KMAJOR: tl.constexpr, HAS_BIAS: tl.constexpr,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr, FLATTEN: tl.constexpr, TMA_STORE: tl.constexpr,
               SPLIT_K: tl.constexpr, SPLIT_INLINE: tl.constexpr, SPLIT_STREAM: tl.constexpr):
    if SPLIT_STREAM:  # the K ranges dealt out across the programs (_gemm_stream.py)
        stream_tiles(a_desc, b_desc, c_desc, c_ptr, bias_ptr, ws_ptr, flag_ptr, M, N, K, k_chunk, b_batch_rows,
                     num_batches, stride_cb, stride_cm, BM, BN, BK, GROUP_M, NUM_PROGS, B_KMAJOR, HAS_BIAS,
                     PRECISION, UPCAST, TMA_STORE, SPLIT_K)
        return
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    tiles_per_batch = tiles_m * tiles_n
    num_tiles = tiles_per_batch * num_batches
    if not SPLIT_INLINE:
        num_tiles = num_tiles * SPLIT_K
    for tile in tl.range(pid, num_tiles, NUM_PROGS, flatten=FLATTEN):
        # SPLIT_K > 1: slab s * num_batches + b reduces K range [s * k_chunk, (s + 1) * k_chunk) of
        # batch entry b into an fp32 partial (no rounding, no bias: _splitk_sum does both); with
        # SPLIT_INLINE one program reduces the SPLIT_K ranges of its tile one after another
        slab = tile // tiles_per_batch
        bid = slab if SPLIT_K == 1 or SPLIT_INLINE else slab % num_batches
        pid_m, pid_n = tile_at(tile % tiles_per_batch, tiles_m, tiles_n, GROUP_M)
        row_a = bid * M + pid_m * BM
        off_n = pid_n * BN
        if SPLIT_K == 1 or SPLIT_INLINE:
            # the same fp32 additions as _splitk_sum, in its order: ((p0 + p1) + p2) + ..., each
            # partial from a fresh accumulator, so the bits equal the two-kernel split's
            acc = whole_tile(a_desc, b_desc, row_a, bid * b_batch_rows, off_n, K, k_chunk, BM, BN, BK, B_KMAJOR,
                             PRECISION, UPCAST, SPLIT_K)
        else:
            s = slab // num_batches
            acc = k_range(a_desc, b_desc, row_a, bid * b_batch_rows, off_n, s * k_chunk,
                          range_tiles(K, k_chunk, s, BK), BM, BN, BK, B_KMAJOR, PRECISION, UPCAST)
        store_tile(acc, c_desc, c_ptr, bias_ptr, slab, pid_m, pid_n, M, N, stride_cb, stride_cm, BM, BN, HAS_BIAS,
                   TMA_STORE)


def _prep_a(a2: torch.Tensor) -> torch.Tensor:
    if tma_ready(a2):
        return a2
    es = a2.element_size()
    cols = aligned_cols(a2.shape[1], es)
    return pad_cols(a2, cols) if cols != a2.shape[1] else a2.contiguous()


def b_layout(b: torch.Tensor) -> str:
    """How _prep_b will feed b [B, K, N] to the kernel (it follows b's strides, never a's)."""
    n_major = b.stride(2) == 1 and (b.shape[2] * b.element_size()) % 16 == 0
    return "n_major" if n_major else "k_major"


def _prep_b(b: torch.Tensor, batches: int, block_k: int) -> tuple[torch.Tensor, bool]:
    """b [B, K, N] -> (2-D operand, k_major): K-major is [B*N, K], N-major is [B*K', N].

    The layout follows the weight's own strides (a linear weight [N, K] is K-major), never
    the activations. An N-major operand with B > 1 gets K padded to a BLOCK_K multiple so a
    K-tile cannot read the next batch entry's rows; zero rows are what TMA returns past the
    edge anyway, so padding does not change a single product."""
    _, k, n = b.shape
    if b_layout(b) == "k_major":
        return _prep_a(b.transpose(1, 2).reshape(batches * n, k)), True
    if batches > 1 and k % block_k:
        padded = b.new_zeros(batches, cdiv(k, block_k) * block_k, n)
        padded[:, :k] = b
        b = padded
    flat = b.reshape(-1, n)
    return (flat if tma_ready(flat) else flat.contiguous()), False



def _a_operand(a: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] or [M, K] -> the 2-D operand launch_config feeds the kernel (a launch plan's copy)."""
    return _prep_a(a.reshape(-1, a.shape[-1]))


def _b_operand(b: torch.Tensor, batches: int, block_k: int) -> torch.Tensor:
    """b [B, K, N] -> the 2-D operand launch_config feeds the kernel (a launch plan's copy)."""
    return _prep_b(b, batches, block_k)[0]


_ONE_PASS = _gemm_plan.ONE_PASS  # the loop stride when every program computes one tile (tile + stride stays < 2^31)


def persistent_at(cfg, m: int, n: int, programs_per_tile: int, device_index: int | None) -> bool:
    """Whether a launch of cfg over [m, n] (times programs_per_tile: split-K ranges and batches)
    runs persistent programs, one per SM (NUM_PROGS = the SM count, a constexpr of the kernel)."""
    tiles = programs_per_tile * cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    return cfg.persistent and tiles > num_sms(device_index)


def launch_config(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, cfg: MMConfig, pad_rows: bool,
                  out: torch.Tensor) -> _gemm_plan.Launched | None:
    """Launch one configured GEMM into `out` [B, M, N] through Triton's JIT; returns what a
    launch plan needs to repeat it (None under the interpreter)."""
    batches, m, k = a.shape
    n = b.shape[2]
    dtype = a.dtype
    a_view = a.reshape(batches * m, k)
    a2 = _prep_a(a_view)
    pad_to = 0
    if pad_rows and batches == 1 and m < cfg.block_m:
        full = a2.new_zeros(cfg.block_m, a2.shape[1])
        full[:m] = a2
        a2, pad_to = full, cfg.block_m
    b2, k_major = _prep_b(b, batches, cfg.block_k)
    align = split_align(dtype, cfg)
    splits = effective_splits(k, cfg.split_k, align) if cfg.split_k > 1 else 1
    chunk = k_chunk(k, splits, align) if splits > 1 else k
    inline = splits > 1 and cfg.split_inline
    stream = splits > 1 and cfg.split_stream
    parallel = 1 if inline or stream else splits  # K ranges reduced by separate programs
    # split-K: fp32 partials [splits * B, M, N], summed in order into out by _splitk.sum_partials
    dest = out if parallel == 1 else torch.empty(splits * batches, m, n, dtype=torch.float32, device=out.device)
    a_desc = make_desc(a2, [cfg.block_m, cfg.block_k])
    b_block = [cfg.block_n, cfg.block_k] if k_major else [cfg.block_k, cfg.block_n]
    b_desc = make_desc(b2, b_block)
    b_batch_rows = n if k_major else b2.shape[0] // batches
    tma_store = (n * dest.element_size()) % 16 == 0
    c_desc = make_desc(dest, [1, cfg.block_m, cfg.block_n]) if tma_store else a_desc
    tiles = parallel * batches * cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    # NUM_PROGS is the persistent loop's stride (a constexpr): with one program per tile any
    # stride >= the tile count runs each program once, so one fixed value serves every M instead
    # of compiling a kernel per tile count (per new M); which program computes a tile never
    # changes how it is computed
    # a stream launch always runs one program per SM (some may hold no K range at small M)
    persistent = stream or persistent_at(cfg, m, n, parallel * batches, device_index(a))
    progs = num_sms(device_index(a)) if persistent else tiles
    ws, flags = _gemm_stream.buffers(out.device) if stream else (dest, dest)
    if tiles >= _ONE_PASS:
        raise ValueError(f"{tiles} output tiles: more than this kernel indexes ({_ONE_PASS})")
    main_bias = bias if bias is not None and parallel == 1 else None
    ints = (m, n, k, chunk, b_batch_rows, batches, dest.stride(0), dest.stride(1))
    consts = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
                  NUM_PROGS=progs if persistent else _ONE_PASS,
                  B_KMAJOR=k_major, HAS_BIAS=main_bias is not None,
                  PRECISION="ieee" if dtype == torch.float32 else None, UPCAST=INTERPRET, FLATTEN=cfg.flatten,
                  TMA_STORE=tma_store, SPLIT_K=splits, SPLIT_INLINE=inline, SPLIT_STREAM=stream)
    main = _mm_kernel[(progs,)](a_desc, b_desc, c_desc, dest, main_bias if main_bias is not None else dest, ws, flags,
                                *ints, **consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    total = None
    if parallel > 1:
        total = sum_partials(dest, out, bias, splits)
    if INTERPRET:
        return None
    es = a.element_size()
    # the plan repeats this launch with only the addresses changed. An operand this call copied
    # (a transposed view, K padding) is copied again per call by the same function; the key holds
    # every shape, stride and alignment those copies follow, so they come out laid out alike.
    # Rows padded to BLOCK_M: only with A and B used in place (the pad is made again per call).
    a_in_place = a2 is a_view and a_view.data_ptr() == a.data_ptr()
    b_in_place = b2.data_ptr() == b.data_ptr()
    if pad_to:
        direct = _prep_a(a_view) is a_view and (k * es) % 16 == 0 and a_view.data_ptr() == a.data_ptr() \
            and b_in_place and tma_store
        prep_a = prep_b = None
    else:
        direct = tma_store
        prep_a = None if a_in_place else _a_operand
        prep_b = None if b_in_place else functools.partial(_b_operand, batches=batches, block_k=cfg.block_k)
    return _gemm_plan.Launched(
        direct=bool(direct), main=main, total=total, device_index=a.device.index, splits=parallel, progs=progs,
        ints=ints, consts=tuple(consts.values()), pad_to=pad_to, prep_a=prep_a, prep_b=prep_b,
        stream_buffers=(ws.data_ptr(), flags.data_ptr()) if stream else None,
        a_desc=(tuple(a2.shape), tuple(a2.stride())), b_desc=(tuple(b2.shape), tuple(b2.stride())),
        c_desc=(tuple(dest.shape), tuple(dest.stride())), out_shape=tuple(out.shape),
    )

