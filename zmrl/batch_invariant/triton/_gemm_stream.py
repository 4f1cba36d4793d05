"""A split-K shape's K ranges dealt out across the persistent programs (stream-K by range).

A split shape (_splitk.py) has 4 K ranges per output tile. At mid and large M its tiles fill
the SMs unevenly: 96 tiles of 128 x 128 for M = 1024, N = 1536 leave 36 of 132 SMs idle, and
192 tiles at M = 2048 run as one full wave plus 60 tiles. Separate programs per range fill the
SMs but pay an fp32 workspace of the whole output and a second kernel. Here, instead:

- All but the last one or two waves of tiles run one tile per program, its ranges added in
  order inside the program (as MMConfig.split_inline does).
- The remaining tiles' ranges, tile after tile, are cut into one contiguous run per program of
  equal length (to one range). A program adds the ranges it holds of a tile left to right. A
  tile that straddles two programs is begun by the first, which stores its prefix sum
  ((p0 + p1) + ...) as fp32 in its workspace slot and raises its flag. The second computes its
  first range meanwhile, waits for the flag, and adds its ranges onto that prefix.

The additions are those of the two-kernel split, in its order ((p0 + p1) + p2) + p3 on the
same fp32 values, so the bits are the same whichever program computes what, and do not depend
on M. A program waits only on the one before it, which published first thing in its run, and a
program is never waited on before it starts. Both workspace and flags are per device and reused
by every call: each flag is lowered again by the program that consumed it, so the next call (or
graph replay) finds them all down. Calls on one device must therefore not run concurrently on
two streams.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmrl.batch_invariant.triton._common import num_sms
from zmrl.batch_invariant.triton._gemm_config import _SPLIT_MAX_TILE
from zmrl.batch_invariant.triton._gemm_tile import k_range, range_tiles, ranges_onto, store_tile, tile_at, whole_tile

MAX_TILE_ELEMS = _SPLIT_MAX_TILE  # the largest tile a stream rung may take (_gemm_config.banded)
_BUFFERS: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}


def buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace [SMs, MAX_TILE_ELEMS] fp32, flags [SMs] int32, all down): one slot per program of a
    stream launch on this device, made once (launch plans keep their addresses)."""
    held = _BUFFERS.get(device.index)
    if held is None:
        programs = num_sms(device.index)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K stream workspace is made outside CUDA-graph capture: run this GEMM "
                               "once eagerly first (the tile ladder's self-check does)")
        held = _BUFFERS[device.index] = (
            torch.empty(programs, MAX_TILE_ELEMS, dtype=torch.float32, device=device),
            torch.zeros(programs, dtype=torch.int32, device=device),
        )
    return held


@triton.jit
def _tile_origin(T, tiles_m, tiles_n, per_batch, M, b_batch_rows, BM: tl.constexpr, BN: tl.constexpr,
                 GROUP_M: tl.constexpr):
    bid = T // per_batch
    pid_m, pid_n = tile_at(T % per_batch, tiles_m, tiles_n, GROUP_M)
    return bid, pid_m, pid_n, bid * M + pid_m * BM, bid * b_batch_rows, pid_n * BN


@triton.jit
def _slot(ws_ptr, program, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    return ws_ptr + program.to(tl.int64) * (BM * BN) + rows[:, None] * BN + cols[None, :]


@triton.jit
def _publish(total, ws_ptr, flag_ptr, pid, BM: tl.constexpr, BN: tl.constexpr):
    tl.store(_slot(ws_ptr, pid, BM, BN), total, cache_modifier=".cg")
    tl.debug_barrier()  # every thread's stores before the release
    tl.atomic_xchg(flag_ptr + pid, 1, sem="release", scope="gpu")


@triton.jit
def stream_tiles(a_desc, b_desc, c_desc, c_ptr, bias_ptr, ws_ptr, flag_ptr, M, N, K, k_chunk, b_batch_rows,
                 num_batches, stride_cb, stride_cm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr, B_KMAJOR: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, TMA_STORE: tl.constexpr, SPLIT_K: tl.constexpr):
    """One program's share of the launch (grid = NUM_PROGS programs); see the module docstring."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_batch = tiles_m * tiles_n
    tiles = per_batch * num_batches
    # whole waves first: consecutive tiles on neighbouring programs share L2
    whole = tl.maximum(tiles // NUM_PROGS - 1, 0) * NUM_PROGS
    for T in tl.range(pid, whole, NUM_PROGS):
        bid, pid_m, pid_n, row_a, b_row0, off_n = _tile_origin(T, tiles_m, tiles_n, per_batch, M, b_batch_rows,
                                                               BM, BN, GROUP_M)
        acc = whole_tile(a_desc, b_desc, row_a, b_row0, off_n, K, k_chunk, BM, BN, BK, B_KMAJOR, PRECISION,
                         UPCAST, SPLIT_K)
        store_tile(acc, c_desc, c_ptr, bias_ptr, bid, pid_m, pid_n, M, N, stride_cb, stride_cm, BM, BN, HAS_BIAS,
                   TMA_STORE)
    # the rest by K range: this program's run is units [lo, hi) (unit = tile * SPLIT_K + range)
    units = (tiles - whole) * SPLIT_K
    lo = (pid * units) // NUM_PROGS
    hi = ((pid + 1) * units) // NUM_PROGS
    if hi > lo:
        t0 = whole + lo // SPLIT_K
        r0 = lo % SPLIT_K
        t1 = whole + (hi - 1) // SPLIT_K
        r1 = (hi - 1) % SPLIT_K
        # 1. the run's last tile, begun here and finished by the next program: its prefix first
        if r1 < SPLIT_K - 1 and (t1 > t0 or r0 == 0):
            bid, pid_m, pid_n, row_a, b_row0, off_n = _tile_origin(t1, tiles_m, tiles_n, per_batch, M,
                                                                   b_batch_rows, BM, BN, GROUP_M)
            total = k_range(a_desc, b_desc, row_a, b_row0, off_n, 0, range_tiles(K, k_chunk, 0, BK), BM, BN, BK,
                            B_KMAJOR, PRECISION, UPCAST)
            total = ranges_onto(total, a_desc, b_desc, row_a, b_row0, off_n, K, k_chunk, 1, r1, BM, BN, BK,
                                B_KMAJOR, PRECISION, UPCAST)
            _publish(total, ws_ptr, flag_ptr, pid, BM, BN)
        # 2. tiles held whole
        first_whole = tl.where(r0 == 0, t0, t0 + 1)
        last_whole = tl.where(r1 == SPLIT_K - 1, t1, t1 - 1)
        for T in range(first_whole, last_whole + 1):
            bid, pid_m, pid_n, row_a, b_row0, off_n = _tile_origin(T, tiles_m, tiles_n, per_batch, M, b_batch_rows,
                                                                   BM, BN, GROUP_M)
            acc = whole_tile(a_desc, b_desc, row_a, b_row0, off_n, K, k_chunk, BM, BN, BK, B_KMAJOR, PRECISION,
                             UPCAST, SPLIT_K)
            store_tile(acc, c_desc, c_ptr, bias_ptr, bid, pid_m, pid_n, M, N, stride_cb, stride_cm, BM, BN,
                       HAS_BIAS, TMA_STORE)
        # 3. the run's first tile, begun by the program holding unit lo - 1: its first range here,
        # then onto that program's prefix
        if r0 > 0:
            bid, pid_m, pid_n, row_a, b_row0, off_n = _tile_origin(t0, tiles_m, tiles_n, per_batch, M,
                                                                   b_batch_rows, BM, BN, GROUP_M)
            part = k_range(a_desc, b_desc, row_a, b_row0, off_n, r0 * k_chunk, range_tiles(K, k_chunk, r0, BK),
                           BM, BN, BK, B_KMAJOR, PRECISION, UPCAST)
            prev = tl.cdiv(lo * NUM_PROGS, units) - 1
            while tl.atomic_add(flag_ptr + prev, 0, sem="acquire", scope="gpu") == 0:
                pass
            total = tl.load(_slot(ws_ptr, prev, BM, BN), cache_modifier=".cg")
            tl.debug_barrier()  # every thread has read the prefix before the flag goes down
            tl.atomic_xchg(flag_ptr + prev, 0, sem="relaxed", scope="gpu")
            last = tl.where(t1 == t0, r1, SPLIT_K - 1)
            total = ranges_onto(total + part, a_desc, b_desc, row_a, b_row0, off_n, K, k_chunk, r0 + 1, last,
                                BM, BN, BK, B_KMAJOR, PRECISION, UPCAST)
            if last < SPLIT_K - 1:  # a run inside one tile: the next program finishes it
                _publish(total, ws_ptr, flag_ptr, pid, BM, BN)
            else:
                store_tile(total, c_desc, c_ptr, bias_ptr, bid, pid_m, pid_n, M, N, stride_cb, stride_cm, BM, BN,
                           HAS_BIAS, TMA_STORE)
