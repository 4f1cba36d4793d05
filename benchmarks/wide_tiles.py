"""Wide tiles for the narrow split-K shapes: an experiment, timed against cuBLAS and the table.

Triton's tiles are powers of two, so N = 576 (4.5 x 128) leaves half of every last column tile
empty, and 1536 x 7168 at M = 1024 / 2048 makes 192 tiles of 64 x 128 / 128 x 128 for 132 SMs
(one and a half waves). Here a tile is 192 columns wide: two or three sub-tiles (64 + 64 + 64 or
128 + 64 columns) whose accumulators share each A tile, which makes 128 tiles there and none
partial on 576 = 3 x 192 or 1536 = 8 x 192.

K is split as the table's entry splits it (`--splits` ranges, 256-aligned: _splitk.k_chunk), each
range into fresh fp32 accumulators, and the partials are added ((p0 + p1) + p2) + p3, the order of
_splitk_sum. So a wide tile must give the bits of the table's two-kernel split; every candidate is
compared with it (torch.equal) before it is timed, and one that differs is reported. Two modes:
  in-program: one program reduces its tile's ranges one after another (running sums in registers);
  programs:   one program per (tile, range) writes an fp32 partial; _splitk.sum_partials adds them.

    python benchmarks/wide_tiles.py --rep 10                       # GPU: candidates vs cuBLAS and `linear`
    python benchmarks/wide_tiles.py --shapes 1536x7168 --ms 1024,2048
    TRITON_INTERPRET=1 python benchmarks/wide_tiles.py --check     # CPU: small fp32 shapes, exact equality

Not part of `linear`: a rung of this width would need sub-tile accumulators in _gemm_kernel's
kernel (or a second kernel for the launch plans); docs/benchmarks.md has the figures that decide.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import zmrl.batch_invariant.triton as tri  # noqa: E402
from zmrl.batch_invariant.triton._common import INTERPRET, cdiv, make_desc, num_sms  # noqa: E402
from zmrl.batch_invariant.triton._splitk import k_chunk, sum_partials  # noqa: E402

mm = importlib.import_module("zmrl.batch_invariant.triton.matmul")
MM = mm.MMConfig
SPLITS = 4  # the table's partition of K = 7168 (_gemm_config.py)
K_ALIGN = 256


@triton.jit
def _k_range_wide(a_desc, b0_desc, b1_desc, b2_desc, row, off_n, k_start, k_tiles, BM: tl.constexpr, BK: tl.constexpr,
            W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W2A: tl.constexpr, PRECISION: tl.constexpr,
            UPCAST: tl.constexpr):
    """One K range into fresh accumulators, one per sub-tile (widths W0, W1, W2; W2 = 0: two
    sub-tiles, W2A is then a placeholder width), ascending BLOCK_K steps."""
    p0 = tl.zeros((BM, W0), dtype=tl.float32)
    p1 = tl.zeros((BM, W1), dtype=tl.float32)
    p2 = tl.zeros((BM, W2A), dtype=tl.float32)
    for ki in range(k_tiles):
        k_off = k_start + ki * BK
        a = a_desc.load([row, k_off])
        b0 = b0_desc.load([off_n, k_off]).T
        b1 = b1_desc.load([off_n + W0, k_off]).T
        if UPCAST:
            a = a.to(tl.float32)
            b0 = b0.to(tl.float32)
            b1 = b1.to(tl.float32)
        p0 = tl.dot(a, b0, p0, input_precision=PRECISION)
        p1 = tl.dot(a, b1, p1, input_precision=PRECISION)
        if W2 > 0:
            b2 = b2_desc.load([off_n + W0 + W1, k_off]).T
            if UPCAST:
                b2 = b2.to(tl.float32)
            p2 = tl.dot(a, b2, p2, input_precision=PRECISION)
    return p0, p1, p2


@triton.jit(do_not_specialize=["M", "k_chunk"])
def _wide_kernel(a_desc, b0_desc, b1_desc, b2_desc, c0_desc, c1_desc, c2_desc, M, N, K, k_chunk, BM: tl.constexpr,
                 BK: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W2A: tl.constexpr,
                 SPLITS: tl.constexpr, INLINE: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, W0 + W1 + W2)
    per_split = tiles_m * tiles_n
    num_tiles = per_split if INLINE else per_split * SPLITS
    for tile in tl.range(pid, num_tiles, NUM_PROGS):
        s0 = 0 if INLINE else tile // per_split
        t = tile % per_split
        per_group = GROUP_M * tiles_n
        first_m = (t // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (t % per_group) % group_rows
        pid_n = (t % per_group) // group_rows
        row = pid_m * BM
        off_n = pid_n * (W0 + W1 + W2)
        k_s = s0 * k_chunk
        acc0, acc1, acc2 = _k_range_wide(a_desc, b0_desc, b1_desc, b2_desc, row, off_n, k_s,
                                   tl.cdiv(tl.minimum(K - k_s, k_chunk), BK), BM, BK, W0, W1, W2, W2A, PRECISION,
                                   UPCAST)
        if INLINE:
            for s in tl.static_range(1, SPLITS):
                k_s = s * k_chunk
                q0, q1, q2 = _k_range_wide(a_desc, b0_desc, b1_desc, b2_desc, row, off_n, k_s,
                                     tl.cdiv(tl.minimum(K - k_s, k_chunk), BK), BM, BK, W0, W1, W2, W2A, PRECISION,
                                     UPCAST)
                acc0 = acc0 + q0
                acc1 = acc1 + q1
                acc2 = acc2 + q2
        out_row = s0 * M + row  # one program per range: slab s0 of the [SPLITS * M, N] fp32 workspace
        c0_desc.store([out_row, off_n], acc0.to(c0_desc.dtype))
        c1_desc.store([out_row, off_n + W0], acc1.to(c1_desc.dtype))
        if W2 > 0:
            c2_desc.store([out_row, off_n + W0 + W1], acc2.to(c2_desc.dtype))


def wide_linear(x, w, bm, bk, widths, splits, align, inline, num_warps, num_stages):
    """x [M, K] @ w [N, K].T in tiles of BLOCK_M x sum(widths) columns (2 or 3 sub-tiles), K in
    `splits` ranges aligned to `align`; in-program (inline) or one program per range."""
    m, k = x.shape
    n = w.shape[0]
    w0, w1, w2 = (tuple(widths) + (0,))[:3]
    w2a = w2 or 16
    chunk = k_chunk(k, splits, align)
    parts = cdiv(k, chunk)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dest = out if inline else torch.empty(parts * m, n, dtype=torch.float32, device=x.device)
    # the fp32 workspace is [parts * M, N]: a store clips at N only, so a slab's partial last row
    # tile would spill into the next slab's rows; the experiment runs that mode at M % BLOCK_M == 0 only
    if not inline and m % bm:
        raise ValueError(f"one program per K range needs M % BLOCK_M == 0 here, got M={m}, BLOCK_M={bm}")
    a_desc = make_desc(x, [bm, bk])
    bd = [make_desc(w, [wd, bk]) for wd in (w0, w1, w2a)]
    cd = [make_desc(dest, [bm, wd]) for wd in (w0, w1, w2a)]
    tiles = cdiv(m, bm) * cdiv(n, w0 + w1 + w2) * (1 if inline else parts)
    progs = tiles if INTERPRET else min(tiles, num_sms(x.device.index))
    _wide_kernel[(progs,)](a_desc, *bd, *cd, m, n, k, chunk, BM=bm, BK=bk, W0=w0, W1=w1, W2=w2, W2A=w2a,
                           SPLITS=parts, INLINE=inline, GROUP_M=8, NUM_PROGS=progs,
                           PRECISION="ieee" if x.dtype == torch.float32 else None, UPCAST=INTERPRET,
                           num_warps=num_warps, num_stages=num_stages)
    if not inline:
        sum_partials(dest.view(parts, m, n), out.view(1, m, n), None, parts)
    return out


def split_reference(x, w, splits: int, align: int, tile=(64, 64, 64)):
    """The two-kernel split of this partition (separate programs, fp32 partials summed in order):
    what the table's entry computes for the shape."""
    bm, bn, bk = tile
    return mm.gemm(x[None], w.t()[None], None, MM(bm, bn, bk, split_k=splits, k_align=align))[0]


# (M, N, K, widths, in-program, BLOCK_M) at BLOCK_K 16 and a 32-aligned partition: 2 and 3 sub-tiles
# of equal and unequal widths, both modes, a ragged last K range, partial row and column tiles
CHECK_CASES = [(16, 96, 160, (32, 32, 32), True, 16), (20, 64, 96, (32, 32), True, 16),
               (32, 192, 128, (32, 32, 32), False, 16), (16, 100, 200, (32, 32, 32), True, 16),
               (32, 96, 224, (32, 32, 32), False, 16), (20, 148, 224, (64, 32), True, 16),
               (32, 96, 160, (64, 32), False, 16)]
CHECK_TILE = (16, 32, 16)  # the reference's tile in the check (fp32: BLOCK_K 16)


def check_case(case, device="cpu", seed=0):
    """(wide == split, another partition's wide == split) for one CHECK_CASES entry, fp32: the first
    must hold, the second is the control (the same kernel over 2 ranges instead of 4)."""
    m, n, k, widths, inline, bm = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device)
    w = torch.randn(n, k, generator=g).to(device)
    ref = split_reference(x, w, 4, 32, CHECK_TILE)
    got = wide_linear(x, w, bm, 16, widths, 4, 32, inline, num_warps=4, num_stages=1)
    other = wide_linear(x, w, bm, 16, widths, 2, 32, inline, num_warps=4, num_stages=1)
    return torch.equal(got, ref), torch.equal(other, ref)


def check() -> int:
    bad = 0
    for case in CHECK_CASES:
        same, control = check_case(case)
        m, n, k, widths, inline, _ = case
        print(f"M={m} N={n} K={k} widths={widths} {'in-program' if inline else 'programs'}: equal={same} "
              f"(control, 2 ranges: equal={control})")
        bad += (not same) + control
    print("ALL EQUAL, every control differs" if not bad else f"{bad} FAILURES")
    return bad


def graph_us(fn, rep: int) -> float:
    from triton.testing import do_bench_cudagraph

    return 1e3 * do_bench_cudagraph(fn, rep=rep)


T3, T2 = (64, 64, 64), (128, 64)
CANDIDATES = [  # (BLOCK_M, BLOCK_K, widths, in-program, warps, stages)
    (64, 64, T3, True, 4, 3), (64, 64, T3, True, 4, 4), (64, 64, T3, True, 8, 4), (128, 64, T3, True, 8, 3),
    (128, 64, T3, True, 8, 4), (64, 64, T2, True, 4, 4), (64, 64, T2, True, 8, 4), (128, 64, T2, True, 8, 3),
    (64, 64, T3, False, 4, 4), (128, 64, T3, False, 8, 4), (128, 64, T2, False, 8, 4), (64, 128, T2, False, 4, 3),
]


def bench(rep: int, shapes, ms, splits: int) -> None:
    bf = torch.bfloat16
    for n, k in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(bf)
        x = torch.randn(max(ms), k, device="cuda", generator=g).to(bf)
        print(f"\n## N={n} K={k} bf16, {splits} K ranges: cuBLAS us; `linear` (the table) and the best wide "
              f"tiles as cuBLAS time / their time, graph-replayed", flush=True)
        for m in ms:
            xm = x[:m].clone()
            ref = split_reference(xm, w, splits, K_ALIGN)
            tri.linear(xm, w)  # the ladder's self-check runs outside the capture
            table_same = torch.equal(tri.linear(xm, w), ref)
            cub = graph_us(lambda: F.linear(xm, w), rep)
            table = graph_us(lambda: tri.linear(xm, w), rep)
            timed, differ = [], []
            for bm, bk, widths, inline, warps, stages in CANDIDATES:
                name = f"{bm}x({'+'.join(map(str, widths))})x{bk} w{warps} s{stages} " \
                       f"{'in-program' if inline else 'programs'}"
                if not inline and m % bm:
                    continue  # see wide_linear
                run = lambda: wide_linear(xm, w, bm, bk, widths, splits, K_ALIGN, inline, warps, stages)  # noqa: E731
                try:
                    same = torch.equal(run(), ref)
                    us = graph_us(run, rep)
                except Exception as e:  # noqa: BLE001 - a tile that does not fit this GPU: report, go on
                    print(f"  M={m} {name}: {type(e).__name__} {str(e)[:90]}")
                    continue
                (timed if same else differ).append((cub / us, name))
            timed.sort(reverse=True)
            print(f"  M={m:<5} cuBLAS {cub:7.1f} us  table {cub / table:.2f}"
                  f"{'' if table_same else ' (NOT the split bits)'} | "
                  + "; ".join(f"{r:.2f} {nm}" for r, nm in timed[:3])
                  + (f" | DIFFER from the split: {', '.join(nm for _, nm in differ)}" if differ else ""), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="the exact-equality check (TRITON_INTERPRET=1 on a CPU)")
    p.add_argument("--rep", type=int, default=10, help="ms of graph replay per timing (do_bench_cudagraph)")
    p.add_argument("--shapes", default="1536x7168,576x7168", help="NxK,...")
    p.add_argument("--ms", default="256,512,1024,2048,4096,8192", help="row counts")
    p.add_argument("--splits", type=int, default=SPLITS, help="K ranges (the table's: 4)")
    args = p.parse_args(argv)
    if args.check:
        if not INTERPRET:
            sys.exit("--check runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1")
        sys.exit(1 if check() else 0)
    if not torch.cuda.is_available():
        sys.exit("the timings need a CUDA GPU (--check runs on a CPU under TRITON_INTERPRET=1)")
    t0 = time.time()
    bench(args.rep, [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")],
          [int(v) for v in args.ms.split(",")], args.splits)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
