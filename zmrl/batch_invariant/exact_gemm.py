"""A CPU GEMM whose bits no BLAS can change: every partial sum it asks the BLAS for is exact.

Why: the tile path (_tiles.py) trusts the BLAS to pick one microkernel and one reduction order
for every row of a fixed-shape tile. Where a CPU or BLAS build breaks that (cpu_gemm.py checks
it per shape), this path takes over. It does not fix an order; it makes the order irrelevant.

How (the error-free splitting of Ozaki et al.): each row of A is scaled by a power of two so
that its largest element is just below 2^BETA, then cut into integer slices,
a_row = 2^(e_row - BETA) * (S1 + S2 * 2^-BETA + ...), with |S_i| <= 2^BETA; the same per column
of B. A slice product S_i @ T_j is a sum of K products of integers below 2^(2 BETA); with
2 BETA + log2(K) <= 53 every partial sum is an integer below 2^53, so a float64 GEMM gets it
exactly, in any order, with or without FMA, on any number of threads. zmrl then adds the
slice products elementwise in one written order, scales by the row's and column's powers of
two (exact) and rounds to the output dtype. Everything that depends on the data is a function
of that row of A and of B alone, so a row's bits cannot depend on the other rows, their
number or its position.

Accuracy: the slices keep the top NUM_SLICES * BETA bits of every element relative to its row's
(column's) largest element (fp32: 2 x 18-21 bits, i.e. every element within 2^-12 of its row's
maximum is kept whole); the dropped slice product S2 @ T2 and the lost low bits are below
~K * 2^(-2 BETA) of max|a_row| * max|b_col|, far under fp32 rounding. bf16 keeps one slice (every
element within 2^-10 of its row's maximum whole). Measured against float64 in the tests.
Non-finite inputs give NaN in every output their row or column touches.
Cost: fp32 three float64 GEMMs, bf16 one, plus the elementwise splitting of A and B each call.
"""
from __future__ import annotations

import torch

_MANTISSA_BITS_F64 = 53


def slice_bits(k: int) -> int:
    """BETA for a reduction of length k: the widest slice whose K-term sums stay exact in fp64."""
    return (_MANTISSA_BITS_F64 - max(1, (k - 1).bit_length())) // 2


def num_slices(dtype: torch.dtype) -> int:
    return 1 if dtype == torch.bfloat16 else 2


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64, built from its bit pattern (exact; torch.exp2/ldexp go through a vector
    exp2 or a float32 pow that need not be exact). e: integers in [-1022, 1023]."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _split(x: torch.Tensor, dim: int, beta: int, slices: int):
    """x (fp32/bf16) -> (integer-valued fp64 slices, exponent e, finite mask) along `dim`:
    x = 2^(e - beta) * sum_i S_i * 2^(-beta i) + (dropped low bits); e, mask keep `dim` as size 1."""
    x64 = x.double()
    finite = torch.isfinite(x64)
    x64 = torch.where(finite, x64, 0.0)
    exp = torch.frexp(x64.abs().amax(dim, keepdim=True))[1]  # max|x| < 2^exp (exp = 0 for a zero row)
    y = x64 * pow2(beta - exp)  # |y| < 2^beta, exact (a power-of-two scaling in fp64)
    parts = []
    for i in range(slices):
        s = torch.round(y)
        parts.append(s)
        if i + 1 < slices:
            y = (y - s) * float(2**beta)  # |y - s| <= 1/2 and exact
    return parts, exp, finite.all(dim, keepdim=True)


def exact_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] x b [B, K, N] -> [B, M, N] in a.dtype (see the module docstring)."""
    batch, rows, k = a.shape
    cols = b.shape[2]
    if k == 0 or rows == 0 or cols == 0:
        return a.new_zeros(batch, rows, cols)
    beta = slice_bits(k)
    slices = num_slices(a.dtype)
    sa, ea, fa = _split(a, -1, beta, slices)  # ea [B, M, 1]
    sb, eb, fb = _split(b, -2, beta, slices)  # eb [B, 1, N]
    out = None
    # the slice products are exact; zmrl adds them in this fixed order, most significant first
    for order in range(slices):
        level = None
        for i in range(order + 1):
            p = torch.bmm(sa[i], sb[order - i], out=sa[i].new_empty(batch, rows, cols))
            level = p if level is None else level + p
        out = level if out is None else out + level * 2.0 ** (-beta * order)
    out = out * pow2(ea + eb - 2 * beta)
    out = torch.where(fa & fb, out, float("nan"))
    return out.to(a.dtype)


def exact_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] x b [K, N] -> [M, N] in a.dtype."""
    return exact_bmm(a[None], b[None])[0]
