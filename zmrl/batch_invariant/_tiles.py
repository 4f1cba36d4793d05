"""Fixed-shape tiling: the CPU fast paths' one trick for batch invariance.

A BLAS or TensorIterator call may choose its algorithm, blocking and thread split from the
shapes it is given (MKL's fp32 `mm` here gives row 0 different bits at M=1 and M=3 than at
M=64). If every row of every call instead passes through a call of one fixed shape
`[ROW_TILE, K]`, the library sees the same problem every time and a row's bits cannot
depend on how many rows came with it. Rows are zero-padded up to a whole tile. (Row
reductions need no tiles: see rowwise.tree_sum.)

That the BLAS then really picks one microkernel for every row of the tile is a property of one
CPU and one BLAS build, not a promise: cpu_gemm.py checks it per shape before trusting it.

fp32: one `torch.bmm` over all tiles, the weight broadcast with a stride-0 batch dimension
(never copied). bf16: one `torch.mm` per tile, because torch's bf16 bmm with a broadcast weight
leaves oneDNN for a loop that runs at 0.01-0.1x of F.linear here, while the per-tile mm keeps
oneDNN; the large tiles (LARGE_ROW_TILES below) run the same way. The `out=` overloads are called:
`enable()` overrides the functional `aten::mm`/`aten::bmm`, and this keeps the override from calling
itself.

The BLAS sees one operand layout whatever the caller passed and however many tiles a call has: A's
tiles are always dense rows, and a bmm's B is always a dense [batch x tiles, K, N] (a copy where the
caller's is a transposed or otherwise strided view). A BLAS may pick its kernel by the layout: under
oneDNN's AVX2 bf16 GEMM (`ONEDNN_MAX_CPU_ISA=AVX2`, i.e. a CPU without AVX-512), a k-major B gives
some rows other bits than the same B n-major. bmm_tiles once passed B as given to a call of one tile
per batch entry and a dense copy to a call of several, so a row's bits depended on how many rows
came with it, and the self-check, whose probe B has a stride-0 batch that no call copies, never saw
the switch. An mm's B (a weight) is passed as given: every call and the self-check use the same
tensor.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

# 32 rows: on this 2-core AMD EPYC (2026-11-30) 64-row tiles ran at 0.88-1.06x of F.linear
# for M >= 64 but 0.09-0.23x at M = 1 (a decode step pays for 63 zero rows); 32-row tiles
# keep 0.74-1.01x at M >= 64 and are 1.6-1.7x faster than 64 at M <= 8; 16-row tiles fell to
# 0.61x at M = 1024. (zmrl bench kernels measures the current choice.)
ROW_TILE = 32
# A call of at most SMALL_ROW_TILE rows (a decode step of a few requests) may run as one
# [SMALL_ROW_TILE, K] tile instead of paying for 32 - M zero rows, but only for a shape where
# cpu_gemm.py's self-check has shown the small tile to give each row the bits of the 32-row tiles
# (on this 2-core AMD EPYC it did at every fp32 and bf16 shape tried except N = 1).
SMALL_ROW_TILE = 8
# min_tiles (mm_tiles, bmm_tiles): a BLAS given fewer GEMMs than threads may split one GEMM, even
# its K, across the threads, and then a row's bits depend on how many tiles came with it. Seen
# with MKL's fp32 bmm on a 2-core Intel Xeon at K = 1024: a call of one tile differs from a call of
# many; at one thread, or with two tiles or more, it does not. Padding a call to at least one tile
# per thread with zero tiles keeps each GEMM on one thread. cpu_gemm.py asks for it only where its
# self-check found the plain tiles row-variant and the padded ones not.


# Large tiles: a call's rows that fill whole [256, K] tiles, then whole [128, K], then whole [64, K]
# tiles, may run in them, the rest in 32-row tiles, but only for a shape where cpu_gemm.py's
# self-check has shown each large tile to give every row the bits of the 32-row tiles. Fewer, larger
# calls: a BLAS pays a weight reorder and a kernel set-up per call (oneDNN's bf16 GEMM, one call per
# tile: 32 calls at M = 1024). On this 2-core AMD EPYC (2026-12-04), bf16 at M = 1024, ratio to
# F.linear: 32-row tiles 0.34-0.73, 64-row tiles 0.49-0.91, 256-row tiles 0.72-1.06, each row's bits
# unchanged. The 128-row tile is for CPUs where the 256-row one changes bits: on an Intel Xeon with
# AMX (2 threads, 2026-12-07) bf16 2048 x 2048 and 4096 x 1024 kept them in 128-row tiles, not in
# 256-row ones, and M = 1024 went from 0.48 and 0.62 of F.linear (64-row tiles) to 0.76-0.78 and 0.86-0.88.
LARGE_ROW_TILES = (256, 128, 64)


def num_tiles(rows: int, tile: int = ROW_TILE) -> int:
    return max(1, -(-rows // tile))


def padded_rows(rows: int, tile: int = ROW_TILE, min_tiles: int = 1) -> int:
    """The rows a call of `rows` rows is padded to: whole tiles, at least `min_tiles` of them."""
    return max(num_tiles(rows, tile), min_tiles) * tile


def pad_rows(x: torch.Tensor, tile: int = ROW_TILE, dim: int = 0, min_tiles: int = 1) -> torch.Tensor:
    """x with dim `dim` zero-padded to padded_rows(M) rows (a contiguous copy, only when needed).
    One constant_pad_nd: the same values as zeros with x copied in, one op instead of three (a
    decode step pads every one of its GEMM calls)."""
    rows = x.shape[dim]
    padded = padded_rows(rows, tile, min_tiles)
    if padded == rows:
        return x
    return torch.constant_pad_nd(x, (0, 0) * (x.dim() - 1 - dim) + (0, padded - rows))


def mm_tiles(a: torch.Tensor, b: torch.Tensor, tile: int = ROW_TILE, min_tiles: int = 1) -> torch.Tensor:
    """[M, K] x [K, N] through fixed [tile, K] tiles, at least `min_tiles` of them (see
    min_tiles above)."""
    return TiledMM(a.shape[0], tile, min_tiles)(a, b)


class TiledMM:
    """mm_tiles for calls of one row count, the padding worked out once: a planned call
    (cpu_plans.py) keeps one and skips the arithmetic and the layers around it (a decode step
    makes ~200 GEMM calls of a few microseconds each)."""

    __slots__ = ("rows", "tile", "padded", "pad")

    def __init__(self, rows: int, tile: int = ROW_TILE, min_tiles: int = 1):
        self.rows, self.tile = rows, tile
        self.padded = padded_rows(rows, tile, min_tiles)
        self.pad = (0, 0, 0, self.padded - rows) if self.padded != rows else None  # pad_rows's op, dim 0

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = (a if self.pad is None else torch.constant_pad_nd(a, self.pad)).contiguous()
        out = a.new_empty(self.padded, b.shape[1])
        _whole_tiles(a, b, out, self.tile)
        return out if self.pad is None else out[:self.rows]


def mm_large_tiles(a: torch.Tensor, b: torch.Tensor, sizes: tuple[int, ...],
                   rest: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mm_tiles) -> torch.Tensor:
    """[M, K] x [K, N]: the rows that fill whole tiles of sizes[0] rows through them, of the rows
    left those that fill whole tiles of sizes[1] rows through those, and so on; the last rows
    through `rest` (the 32-row tiles). See LARGE_ROW_TILES."""
    rows, n = a.shape[0], b.shape[1]
    a = a.contiguous()  # dense rows, as the 32-row tiles give the BLAS (see the module docstring)
    out = a.new_empty(rows, n)
    start = 0
    for size in sizes:
        count = (rows - start) // size
        if count:
            end = start + count * size
            _whole_tiles(a[start:end], b, out[start:end], size)
            start = end
    if start < rows:
        out[start:] = rest(a[start:], b)
    return out


def _whole_tiles(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, tile: int) -> None:
    """out [tiles * tile, N] = the [tile, K] tiles of a [tiles * tile, K], each times b [K, N]."""
    tiles = a.shape[0] // tile
    if a.dtype != torch.bfloat16:
        torch.bmm(a.view(tiles, tile, -1), b.expand(tiles, *b.shape), out=out.view(tiles, tile, -1))
    elif tiles == 1:  # a decode step's call: the tile itself, no views (~1 us each of a ~20 us call)
        torch.mm(a, b, out=out)
    else:
        for i in range(tiles):
            rows = slice(i * tile, (i + 1) * tile)
            torch.mm(a[rows], b, out=out[rows])


def bmm_tiles(a: torch.Tensor, b: torch.Tensor, tile: int = ROW_TILE, min_tiles: int = 1) -> torch.Tensor:
    """[B, M, K] x [B, K, N] through fixed [tile, K] tiles of each batch entry, at least `min_tiles`
    tiles in all (see min_tiles above)."""
    batch, rows, k = a.shape
    tiles = max(num_tiles(rows, tile), -(-min_tiles // batch))
    padded = pad_rows(a, tile, dim=1, min_tiles=tiles)  # pad M, keep B outermost
    # both operands dense at every tile count and batch size (see the module docstring): reshape
    # keeps a strided view where it can, so A is made dense; B's entry for each tile is a dense copy
    a_tiles = padded.reshape(batch * tiles, tile, k).contiguous()
    b_tiles = b.contiguous() if tiles == 1 else b.repeat_interleave(tiles, dim=0)
    out = a.new_empty(batch * tiles, tile, b.shape[2])
    torch.bmm(a_tiles, b_tiles, out=out)
    return out.view(batch, tiles * tile, -1)[:, :rows]
