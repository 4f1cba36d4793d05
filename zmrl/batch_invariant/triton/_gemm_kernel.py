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
from zmrl.batch_invariant.triton._gemm_config import MMConfig, check_sub_n, output_tiles, split_align
from zmrl.batch_invariant.triton._splitk import effective_splits, k_chunk, sum_partials


@triton.jit
def _load_a(a_desc, bid, row, row_a, k_off, BM: tl.constexpr, BK: tl.constexpr, A_3D: tl.constexpr):
    """A's [BM, BK] tile at (row, k_off) of batch entry bid: a [B, M, K] descriptor clips rows at
    this entry's M; a 2-D one over [B * M, K] (row_a = bid * M + row) reads the next entry's rows
    there instead, which only ever reach output rows that are never stored."""
    if A_3D:
        return a_desc.load([bid, row, k_off]).reshape(BM, BK)
    else:
        return a_desc.load([row_a, k_off])


@triton.jit
def _load_b(b_desc, bid, b_row0, off_n, k_off, BN: tl.constexpr, BK: tl.constexpr, B_KMAJOR: tl.constexpr,
            B_3D: tl.constexpr):
    """B's [BK, BN] tile: K-major ([B, N, K] or [B * N, K]) or N-major ([B, K, N] or [B * K', N],
    b_row0 = the entry's first row of the 2-D form)."""
    if B_3D:
        if B_KMAJOR:
            return b_desc.load([bid, off_n, k_off]).reshape(BN, BK).T
        else:
            return b_desc.load([bid, k_off, off_n]).reshape(BK, BN)
    else:
        if B_KMAJOR:
            return b_desc.load([b_row0 + off_n, k_off]).T
        else:
            return b_desc.load([b_row0 + k_off, off_n])


@triton.jit
def _k_range(a_desc, b_desc, bid, row, row_a, b_row0, off_n, k_start, k_tiles, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, B_KMAJOR: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
             A_3D: tl.constexpr, B_3D: tl.constexpr, SUB_N: tl.constexpr):
    """One K range [k_start, k_start + k_tiles * BK) of one output tile, ascending BLOCK_K steps,
    into fresh fp32 accumulators: one per BN-column sub-tile (SUB_N of them, side by side), each
    A tile loaded once and multiplied into every sub-tile. A sub-tile's columns see the same
    steps in the same order as in a tile of their own: SUB_N changes which program computes a
    column, not its arithmetic. Returns three accumulators; those past SUB_N are the first one
    again (never stored, so the compiler drops them)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if SUB_N > 1:
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    if SUB_N > 2:
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(k_tiles):
        k_off = k_start + ki * BK
        a = _load_a(a_desc, bid, row, row_a, k_off, BM, BK, A_3D)
        if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns as integers
            a = a.to(tl.float32)
        b = _load_b(b_desc, bid, b_row0, off_n, k_off, BN, BK, B_KMAJOR, B_3D)
        if UPCAST:
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if SUB_N > 1:
            b1 = _load_b(b_desc, bid, b_row0, off_n + BN, k_off, BN, BK, B_KMAJOR, B_3D)
            if UPCAST:
                b1 = b1.to(tl.float32)
            acc1 = tl.dot(a, b1, acc1, input_precision=PRECISION)
        if SUB_N > 2:
            b2 = _load_b(b_desc, bid, b_row0, off_n + 2 * BN, k_off, BN, BK, B_KMAJOR, B_3D)
            if UPCAST:
                b2 = b2.to(tl.float32)
            acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
    if SUB_N == 1:
        acc1 = acc
    if SUB_N < 3:
        acc2 = acc
    return acc, acc1, acc2


@triton.jit
def _store_sub_tile(c_desc, c_ptr, bias_ptr, acc, slab, row, off_n, M, N, stride_cb, stride_cm, BM: tl.constexpr,
                    BN: tl.constexpr, HAS_BIAS: tl.constexpr, TMA_STORE: tl.constexpr):
    """Round one [BM, BN] accumulator to the output dtype, add the bias, store it at (row, off_n)."""
    offs_n = off_n + tl.arange(0, BN)
    c = acc.to(c_ptr.dtype.element_ty)
    if HAS_BIAS:
        # as torch's `gemm_out + bias`: the GEMM result is rounded first, then one add
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        c = (c.to(tl.float32) + bias.to(tl.float32)).to(c_ptr.dtype.element_ty)
    if TMA_STORE:
        # [B, M, N] descriptor: the copy engine clips rows past this batch entry's M
        # and columns past N, and a [BM, BN] tile of 64-bit pointers never exists
        c_desc.store([slab, row, off_n], c.reshape(1, BM, BN))
    else:
        offs_m = row + tl.arange(0, BM)
        ptrs = c_ptr + slab * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# M and the batch count are never specialized on (Triton would compile M == 1 separately)
@triton.jit(do_not_specialize=["M", "num_batches", "b_batch_rows", "stride_cb", "k_chunk"])
def _mm_kernel(a_desc, b_desc, c_desc, c_ptr, bias_ptr, M, N, K, k_chunk, b_batch_rows, num_batches, stride_cb,
               stride_cm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               NUM_PROGS: tl.constexpr, B_KMAJOR: tl.constexpr, HAS_BIAS: tl.constexpr,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr, FLATTEN: tl.constexpr, TMA_STORE: tl.constexpr,
               SPLIT_K: tl.constexpr, SPLIT_INLINE: tl.constexpr, A_3D: tl.constexpr, B_3D: tl.constexpr,
               SUB_N: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN * SUB_N)  # a tile is SUB_N sub-tiles of BN columns
    tiles_per_batch = tiles_m * tiles_n
    num_tiles = tiles_per_batch * num_batches
    if not SPLIT_INLINE:
        num_tiles = num_tiles * SPLIT_K
    for tile in tl.range(pid, num_tiles, NUM_PROGS, flatten=FLATTEN):
        # SPLIT_K > 1: slab s * num_batches + b reduces K range [s * k_chunk, (s + 1) * k_chunk) of
        # batch entry b into an fp32 partial (no rounding, no bias: _splitk_sum does both); with
        # SPLIT_INLINE one program reduces the SPLIT_K ranges of its tile one after another
        slab = tile // tiles_per_batch
        if SPLIT_K == 1:
            bid = slab
            k_start = 0
            k_tiles = tl.cdiv(K, BK)
        elif SPLIT_INLINE:
            bid = slab
            k_start = 0
            k_tiles = tl.cdiv(tl.minimum(K, k_chunk), BK)  # the first range; the others below
        else:
            bid = slab % num_batches
            k_start = (slab // num_batches) * k_chunk
            k_tiles = tl.cdiv(tl.minimum(K - k_start, k_chunk), BK)
        t = tile % tiles_per_batch
        # grouped order: GROUP_M row-tiles share each weight column-tile while it is in L2
        per_group = GROUP_M * tiles_n
        first_m = (t // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (t % per_group) % group_rows
        pid_n = (t % per_group) // group_rows
        row = pid_m * BM
        row_a = bid * M + row
        off_n = pid_n * BN * SUB_N
        b_row0 = bid * b_batch_rows
        acc, acc1, acc2 = _k_range(a_desc, b_desc, bid, row, row_a, b_row0, off_n, k_start, k_tiles, BM, BN, BK,
                                   B_KMAJOR, PRECISION, UPCAST, A_3D, B_3D, SUB_N)
        if SPLIT_INLINE:
            # the same fp32 additions as _splitk_sum, in its order: ((p0 + p1) + p2) + ..., each
            # partial from fresh accumulators, so the bits equal the two-kernel split's
            for s in tl.static_range(1, SPLIT_K):
                k_s = s * k_chunk
                part, part1, part2 = _k_range(a_desc, b_desc, bid, row, row_a, b_row0, off_n, k_s,
                                              tl.cdiv(tl.minimum(K - k_s, k_chunk), BK), BM, BN, BK, B_KMAJOR,
                                              PRECISION, UPCAST, A_3D, B_3D, SUB_N)
                acc = acc + part
                if SUB_N > 1:
                    acc1 = acc1 + part1
                if SUB_N > 2:
                    acc2 = acc2 + part2
        _store_sub_tile(c_desc, c_ptr, bias_ptr, acc, slab, row, off_n, M, N, stride_cb, stride_cm, BM, BN, HAS_BIAS,
                        TMA_STORE)
        if SUB_N > 1:
            _store_sub_tile(c_desc, c_ptr, bias_ptr, acc1, slab, row, off_n + BN, M, N, stride_cb, stride_cm, BM, BN,
                            HAS_BIAS, TMA_STORE)
        if SUB_N > 2:
            _store_sub_tile(c_desc, c_ptr, bias_ptr, acc2, slab, row, off_n + 2 * BN, M, N, stride_cb, stride_cm, BM,
                            BN, HAS_BIAS, TMA_STORE)


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



def _tma_ready_3d(t: torch.Tensor) -> bool:
    """A 3-D tensor a TMA descriptor can address in place: unit inner stride, 16-byte base and
    16-byte nonzero pitches (a broadcast batch entry is not)."""
    es = t.element_size()
    return (t.dim() == 3 and t.stride(2) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and (s * es) % 16 == 0 for s in t.stride()[:2]))


def _batched_in_place(a: torch.Tensor, b: torch.Tensor, block_k: int) -> tuple[bool, bool]:
    """Whether a batched call reads A [B, M, K] and B [B, K, N] through 3-D descriptors, in place,
    where the 2-D operands _prep_a / _prep_b form would be copies (a head-batched product over a
    transposed activation or a slice of a weight: the MLA's absorbed kv_b_proj). The arithmetic
    is the same either way (the same tiles reach the same dot); only the copies go."""
    batches, m, k = a.shape
    n = b.shape[2]
    if batches == 1:
        return False, False
    a_3d = m > 1 and a.stride(0) != m * a.stride(1) and _tma_ready_3d(a)  # one row: [B, K] is a view
    if b_layout(b) == "k_major":
        bt = b.transpose(1, 2)
        b_3d = bt.stride(0) != n * bt.stride(1) and _tma_ready_3d(bt)
    else:
        b_3d = (k % block_k != 0 or b.stride(0) != k * b.stride(1)) and _tma_ready_3d(b)
    return a_3d, b_3d


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
    tiles = programs_per_tile * output_tiles(m, n, cfg)
    return cfg.persistent and tiles > num_sms(device_index)


def row_views(a: torch.Tensor, out: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows lo..hi of a [1, M, K] and out [1, M, N] as [1, hi - lo, *] views strided as a [None] of
    2-D rows would be (one op each): the operands of one part of a row split (row_parts)."""
    rows, row_a, row_out = hi - lo, a.stride(1), out.stride(1)
    return (a.as_strided((1, rows, a.shape[2]), (rows * row_a, row_a, a.stride(2)), a.storage_offset() + lo * row_a),
            out.as_strided((1, rows, out.shape[2]), (rows * row_out, row_out, out.stride(2)),
                           out.storage_offset() + lo * row_out))


def launch_config(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, cfg: MMConfig, pad_rows: bool,
                  out: torch.Tensor) -> _gemm_plan.Launched | None:
    """Launch one configured GEMM into `out` [B, M, N] through Triton's JIT; returns what a
    launch plan needs to repeat it (None under the interpreter)."""
    if cfg.tail is not None:
        raise ValueError("a row-split config is two launches: run it through matmul.gemm (row_parts)")
    check_sub_n(cfg)
    batches, m, k = a.shape
    n = b.shape[2]
    dtype = a.dtype
    a_3d, b_3d = _batched_in_place(a, b, cfg.block_k)
    a_view = a if a_3d else a.reshape(batches * m, k)
    a2 = a_view if a_3d else _prep_a(a_view)
    pad_to = 0
    if pad_rows and batches == 1 and m < cfg.block_m:
        full = a2.new_zeros(cfg.block_m, a2.shape[1])
        full[:m] = a2
        a2, pad_to = full, cfg.block_m
    if b_3d:
        k_major = b_layout(b) == "k_major"
        b2 = b.transpose(1, 2) if k_major else b
    else:
        b2, k_major = _prep_b(b, batches, cfg.block_k)
    align = split_align(dtype, cfg)
    splits = effective_splits(k, cfg.split_k, align) if cfg.split_k > 1 else 1
    chunk = k_chunk(k, splits, align) if splits > 1 else k
    inline = splits > 1 and cfg.split_inline
    parallel = 1 if inline else splits  # K ranges reduced by separate programs
    # split-K: fp32 partials [splits * B, M, N], summed in order into out by _splitk.sum_partials
    dest = out if parallel == 1 else torch.empty(splits * batches, m, n, dtype=torch.float32, device=out.device)
    a_desc = make_desc(a2, [1, cfg.block_m, cfg.block_k] if a_3d else [cfg.block_m, cfg.block_k])
    b_block = [cfg.block_n, cfg.block_k] if k_major else [cfg.block_k, cfg.block_n]
    b_desc = make_desc(b2, [1, *b_block] if b_3d else b_block)
    b_batch_rows = n if k_major else b2.shape[0] // batches
    tma_store = (n * dest.element_size()) % 16 == 0
    c_desc = make_desc(dest, [1, cfg.block_m, cfg.block_n]) if tma_store else a_desc
    tiles = parallel * batches * output_tiles(m, n, cfg)
    # NUM_PROGS is the persistent loop's stride (a constexpr): with one program per tile any
    # stride >= the tile count runs each program once, so one fixed value serves every M instead
    # of compiling a kernel per tile count (per new M); which program computes a tile never
    # changes how it is computed
    persistent = persistent_at(cfg, m, n, parallel * batches, device_index(a))
    progs = num_sms(device_index(a)) if persistent else tiles
    if tiles >= _ONE_PASS:
        raise ValueError(f"{tiles} output tiles: more than this kernel indexes ({_ONE_PASS})")
    main_bias = bias if bias is not None and parallel == 1 else None
    ints = (m, n, k, chunk, b_batch_rows, batches, dest.stride(0), dest.stride(1))
    consts = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
                  NUM_PROGS=progs if persistent else _ONE_PASS,
                  B_KMAJOR=k_major, HAS_BIAS=main_bias is not None,
                  PRECISION="ieee" if dtype == torch.float32 else None, UPCAST=INTERPRET, FLATTEN=cfg.flatten,
                  TMA_STORE=tma_store, SPLIT_K=splits, SPLIT_INLINE=inline, A_3D=a_3d, B_3D=b_3d, SUB_N=cfg.sub_n)
    main = _mm_kernel[(progs,)](a_desc, b_desc, c_desc, dest, main_bias if main_bias is not None else dest, *ints,
                                **consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
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
        a_desc=(tuple(a2.shape), tuple(a2.stride())), b_desc=(tuple(b2.shape), tuple(b2.stride())),
        c_desc=(tuple(dest.shape), tuple(dest.stride())), out_shape=tuple(out.shape),
    )

