"""Fixed-shape tiling: the CPU fast paths' one trick for batch invariance.

A BLAS or TensorIterator call may choose its algorithm, blocking and thread split from the
shapes it is given (MKL's fp32 `mm` here gives row 0 different bits at M=1 and M=3 than at
M=64). If every row of every call instead passes through a call of one fixed shape
`[ROW_TILE, K]`, the library sees the same problem every time and a row's bits cannot
depend on how many rows came with it. Rows are zero-padded up to a whole tile. (Row
reductions need no tiles: see rowwise.tree_sum.)
"""
from __future__ import annotations

import torch

# 32 rows: on this 2-core AMD EPYC (2026-11-30) 64-row tiles ran at 0.88-1.06x of F.linear
# for M >= 64 but 0.09-0.23x at M = 1 (a decode step pays for 63 zero rows); 32-row tiles
# keep 0.74-1.01x at M >= 64 and are 1.6-1.7x faster than 64 at M <= 8; 16-row tiles fell to
# 0.61x at M = 1024. (zmrl bench kernels measures the current choice.)
ROW_TILE = 32


def num_tiles(rows: int, tile: int = ROW_TILE) -> int:
    return max(1, -(-rows // tile))


def pad_rows(x: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """[M, ...] -> [ceil(M / tile) * tile, ...], zero rows appended (a copy only when needed)."""
    rows = x.shape[0]
    padded = num_tiles(rows, tile) * tile
    if padded == rows:
        return x
    out = x.new_zeros((padded, *x.shape[1:]))
    out[:rows] = x
    return out

