"""Probe activations for the GEMM self-checks (the CPU tiles in cpu_gemm.py, the GPU tile ladder in
triton/_gemm_ladder.py): rows that make a change of the K reduction order visible in a bf16 output."""
from __future__ import annotations

import torch


def cancelling_rows(b: torch.Tensor, rows: int, dtype: torch.dtype, seed: int = 0xCA9CE1) -> torch.Tensor:
    """[rows, K] activations on b's device against b [K, N] that make a K order visible through a
    bf16 rounding.

    Row r aims at one column n of b (the columns in turn): small random terms, plus two large
    ones far apart in K (i in the first part, j in the last) whose products cancel:
    x_i = c b_jn, x_j = -c b_in, c a power of two that makes them ~2^20 times the small products.
    The exact result is the small terms' sum, but every small term added while one large term sat
    in the fp32 partial sum lost most of its bits to it, and which ones did depends on the order of
    the K reduction (and on how each step of it rounds). Random rows hide most such changes behind
    the output's bf16 rounding (their fp32 results differ in the last fp32 bits, which a bf16
    rounding drops unless it falls near a tie); on these rows the same change moves the result by
    an fp32 unit of the large terms, about a bf16 unit of the result or more."""
    k, n = b.shape
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 2.0 ** -4).to(b.device)
    if k < 2 or n == 0 or rows == 0:
        return x.to(dtype)
    dev = b.device
    cols = torch.arange(rows, device=dev) % n
    col_b = b.detach()[:, cols].float().t()  # [rows, K]: each row's column of b
    col_mag = col_b.abs()
    quarter = max(1, k // 4)
    far = (torch.arange(rows, device=dev) // n) % 2 == 1  # every other round: the first and last quarters
    lo_end = torch.where(far, quarter, k // 2)
    hi_start = torch.where(far, k - quarter, k // 2)
    pos = torch.arange(k, device=dev)[None, :]
    i = torch.where(pos < lo_end[:, None], col_mag, -1.0).argmax(1)
    j = torch.where(pos >= hi_start[:, None], col_mag, -1.0).argmax(1)
    r = torch.arange(rows, device=dev)
    b_i, b_j = col_b[r, i], col_b[r, j]
    small = 2.0 ** -4 * col_mag.mean(1)
    pair = (b_i * b_j).abs()
    ok = (pair > 0) & (small > 0) & (i != j)
    c = torch.exp2(torch.round(torch.log2(2.0 ** 20 * small / torch.where(ok, pair, 1.0))))
    if dtype == torch.float16:  # keep the large activations well inside fp16's range (65504)
        big = torch.maximum(b_i.abs(), b_j.abs()).clamp_min(torch.finfo(torch.float32).tiny)
        c = torch.minimum(c, torch.exp2(torch.floor(torch.log2(2.0 ** 14 / big))))
    x[r[ok], i[ok]] = (c * b_j)[ok]
    x[r[ok], j[ok]] = (-c * b_i)[ok]
    return x.to(dtype)
