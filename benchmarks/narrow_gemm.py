"""The narrow GEMM shapes, graph-replayed, against cuBLAS: the table as it is, or a sweep for it.

    python benchmarks/narrow_gemm.py                         # the public path at the powers of two and between them
    python benchmarks/narrow_gemm.py --sweep --shape 576x7168 --splits 4
    python benchmarks/narrow_gemm.py --plan-only --sweep     # no GPU: what a sweep would time
    python benchmarks/narrow_gemm.py --sweep --ms 256,512,1024 --then-table  # sweep, then the public path with it

Shapes (bf16, weight [N, K], x [M, K]): 1536x7168, 576x7168 (the MLA down-projections of a
K3.1-sized model) and 24576x1536; the target is >= 0.8x cuBLAS at every M.

Default: zmrl's public `linear` (the table's entry for the shape, the ladder's self-check deciding
whether its rungs run; its decision is printed) and F.linear, each replayed from a CUDA graph
(triton.testing.do_bench_cudagraph) in the same run, cuBLAS time / zmrl time per M; then the rows
are checked for batch invariance (each row alone vs inside batches, torch.equal), with cuBLAS's rows
as the control that the check can see a difference.

--sweep: for one K partition (--splits ranges, 256-aligned: the partition is the shape's, so every
rung of it gives the same bits), each M of the grid times every candidate rung: K ranges reduced
by separate programs (a fp32 partial each, summed by a second kernel) with tiles sized to M, and
above MID_M the ranges reduced one after another in one program (--splits 1: an unsplit shape's
tiles, up to 128 x 256). Each candidate's rows are compared
with the partition's plain two-kernel split (they must be equal; one that is not is reported and
dropped). It prints the best per M and the `banded(...)` entry to put into TUNED
(zmrl/batch_invariant/triton/_gemm_config.py): each band ends at a grid M and takes the rung
fastest there. An unsplit tile is timed beside it at M >= 256 as a reference (another partition:
other bits, not a candidate).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import zmrl.batch_invariant.triton as tri  # noqa: E402

mm = importlib.import_module("zmrl.batch_invariant.triton.matmul")
configs = importlib.import_module("zmrl.batch_invariant.triton._gemm_config")
MM = configs.MMConfig
BF16 = torch.bfloat16
SHAPES = [(1536, 7168), (576, 7168), (24576, 1536)]
GRID = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# token counts between the powers of two, where a trainer's batches land: a tile that fits the grid
# can leave a partial row tile or a partial wave here (H100, 2026-12-06: down to 0.40 at M = 1280
# on 576 x 7168, where the lowest of the powers read 0.55)
BETWEEN = (96, 160, 320, 768, 1280, 3072, 6144)
TABLE_MS = tuple(sorted(GRID + BETWEEN))
INVARIANCE_MS = (1, 2, 3, 16, 17, 33, 128, 255, 257, 600, 1024)
K_ALIGN = 256  # a multiple of every candidate's BLOCK_K
DEVICE = "cuda"  # the CPU smoke test (tests/bench) runs the control flow on "cpu" with stand-in GEMMs

_ONE = dict(num_warps=4, num_stages=4, persistent=False)
ROWS_16 = [MM(16, 32, 256, **_ONE), MM(16, 64, 256, **_ONE), MM(16, 128, 128, **_ONE)]
ROWS_32 = [MM(32, 32, 256, **_ONE), MM(32, 64, 256, **_ONE), MM(32, 128, 128, **_ONE)]
ROWS_64 = [MM(64, 64, 128, **_ONE), MM(64, 128, 64, num_warps=4, num_stages=4),
           MM(128, 64, 64, num_warps=4, num_stages=4), MM(128, 128, 64, num_warps=4, num_stages=4)]
IN_PROGRAM = [MM(64, 128, 64, num_warps=4, num_stages=4), MM(128, 64, 64, num_warps=4, num_stages=4),
              MM(128, 128, 64, num_warps=8, num_stages=4), MM(64, 256, 64, num_warps=8, num_stages=4)]
WIDE = [MM(64, 256, 64, num_warps=4, num_stages=4), MM(128, 256, 64, num_warps=8, num_stages=3)]
# tiles of three 64-column sub-tiles (192 columns: 576 = 3 x 192, 1536 = 8 x 192, no partial
# tile) from M = 256, in both reductions of a split partition
SUB_TILED = [MM(64, 64, 64, num_warps=4, num_stages=4, sub_n=3), MM(128, 64, 64, num_warps=8, num_stages=3, sub_n=3)]
SUB_TILED_IN_PROGRAM = [MM(64, 64, 64, num_warps=4, num_stages=4, sub_n=3),
                        MM(64, 64, 64, num_warps=8, num_stages=4, sub_n=3),
                        MM(128, 64, 64, num_warps=8, num_stages=3, sub_n=3),
                        MM(128, 64, 64, num_warps=8, num_stages=4, sub_n=3)]
SUB_TILED_FROM_M = 256
UNSPLIT_REFERENCE = MM(128, 128, 64, num_warps=8, num_stages=4)


def candidates(m: int, splits: int) -> list[tuple[MM, str]]:
    """(rung, label) for one M of a `splits`-range partition: separate programs per range with
    tiles for this many rows, and in-program ranges above MID_M."""
    base = MM(64, 64, 64, split_k=splits, k_align=K_ALIGN)
    sized = ROWS_16 if m <= configs.SMALL_M else ROWS_16[1:] + ROWS_32 if m <= configs.MID_M \
        else ROWS_32[1:] + ROWS_64 if m <= 128 else ROWS_64[1:]
    if splits == 1 and m > configs.MID_M:  # an unsplit tile keeps one accumulator: wider tiles fit
        sized = sized + WIDE
    if m >= SUB_TILED_FROM_M:
        sized = sized + SUB_TILED
    out = [(configs.banded(base, [(None, t)]).bands[0][1], "programs") for t in sized]
    if m > configs.MID_M and splits > 1:
        in_program = IN_PROGRAM + (SUB_TILED_IN_PROGRAM if m >= SUB_TILED_FROM_M else [])
        out += [(dataclasses.replace(t, split_k=splits, k_align=K_ALIGN, split_inline=True), "in-program")
                for t in in_program]
    return out


def graph_us(fn, rep: int) -> float:
    from triton.testing import do_bench_cudagraph

    return 1e3 * do_bench_cudagraph(fn, rep=rep)


def tile(cfg: MM) -> str:
    return f"{configs.tile_name(cfg)} w{cfg.num_warps} s{cfg.num_stages}"


def cfg_line(cfg: MM) -> str:
    fields = [f"{cfg.block_m}, {cfg.block_n}, {cfg.block_k}", f"num_warps={cfg.num_warps}", f"num_stages={cfg.num_stages}"]
    if not cfg.persistent:
        fields.append("persistent=False")
    if cfg.split_inline:
        fields.append("split_inline=True")
    if cfg.sub_n > 1:
        fields.append(f"sub_n={cfg.sub_n}")
    return f"MMConfig({', '.join(fields)})"


def variant_rows(fn, n: int, k: int, sizes) -> int:
    """Rows whose bits differ between the row alone and the row inside a batch (torch.equal)."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    pool = torch.randn(64, k, device=DEVICE, generator=g).to(BF16)
    w = (torch.randn(n, k, device=DEVICE, generator=g) * k ** -0.5).to(BF16)
    alone = torch.cat([fn(pool[i:i + 1], w) for i in range(pool.shape[0])])
    bad = 0
    for m in sizes:
        idx = torch.randint(0, pool.shape[0], (m,), device=DEVICE, generator=g)
        got = fn(pool[idx], w)
        bad += sum(not torch.equal(got[i], alone[idx[i]]) for i in range(m))
    return bad


def _operands(n: int, k: int, m_max: int):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = (torch.randn(n, k, device=DEVICE, generator=g) * k ** -0.5).to(BF16)
    x = torch.randn(m_max, k, device=DEVICE, generator=g).to(BF16)
    return w, x


def table(n: int, k: int, ms, rep: int) -> list[float]:
    """The public path at every M; prints the ratios, the ladder's decision and the invariance check."""
    w, x = _operands(n, k, max(ms))
    mm.reset_ladder_decisions()
    for m in ms:  # eager first: the ladder's self-check never runs inside a capture
        tri.linear(x[:m], w)
    ratios = []
    print(f"\n## N={n} K={k} bf16, the table's entry through `linear`: cuBLAS us / zmrl us = ratio", flush=True)
    for m in ms:
        xm = x[:m].clone()
        cublas = graph_us(lambda: F.linear(xm, w), rep)
        ours = graph_us(lambda: tri.linear(xm, w), rep)
        ratios.append(cublas / ours)
        print(f"  M={m:<5} {cublas:8.1f} / {ours:8.1f} = {cublas / ours:.2f}", flush=True)
    dec = mm.ladder_decision(n, k, BF16, "k_major", DEVICE)
    bad = variant_rows(lambda x_, w_: tri.linear(x_, w_), n, k, INVARIANCE_MS)
    control = variant_rows(lambda x_, w_: F.linear(x_, w_), n, k, INVARIANCE_MS)
    low = [m for m, r in zip(ms, ratios) if r < 0.8]
    print(f"  min {min(ratios):.2f}; {'>= 0.8 at every M' if not low else f'MISS below 0.8 at M = {low}'}; "
          f"ladder: {dec['reason'][:160]}", flush=True)
    print(f"  {'INVARIANT' if bad == 0 else f'NOT INVARIANT: {bad} rows differ'} (torch.equal per row, M in "
          f"{list(INVARIANCE_MS)}; control: cuBLAS {control} rows differ)", flush=True)
    return ratios


def sweep(n: int, k: int, ms, splits: int, rep: int) -> list[tuple[int, MM]]:
    """The fastest rung per M of one partition, and the banded(...) entry built from them."""
    t0 = time.time()
    w, x = _operands(n, k, max(ms))
    print(f"\n## sweep N={n} K={k} bf16, {splits} K ranges: cuBLAS time / rung time per M", flush=True)
    picks = []
    for m in ms:
        xm = x[:m].clone()
        cublas = graph_us(lambda: F.linear(xm, w), rep)
        two_kernels = mm.gemm(xm[None], w.t()[None], None, MM(64, 64, 64, split_k=splits, k_align=K_ALIGN))
        timed = []
        for cfg, how in candidates(m, splits):
            pad = configs.pads_rows(m, cfg)
            try:
                same = torch.equal(mm.gemm(xm[None], w.t()[None], None, cfg, pad), two_kernels)
                us = graph_us(lambda: mm.gemm(xm[None], w.t()[None], None, cfg, pad), rep)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit this GPU: report, go on
                print(f"  M={m} {tile(cfg)} {how} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            if not same:
                print(f"  M={m} {tile(cfg)} {how}: DIFFERS from the two-kernel split, dropped", flush=True)
                continue
            timed.append((cublas / us, cfg, how))
        timed.sort(key=lambda t: t[0], reverse=True)
        note = ""
        if m >= 256:
            ref = graph_us(lambda: mm.gemm(xm[None], w.t()[None], None, UNSPLIT_REFERENCE), rep)
            note = f" | unsplit {tile(UNSPLIT_REFERENCE)} (other bits): {cublas / ref:.2f}"
        print(f"  M={m:<5} cuBLAS {cublas:7.1f} us: " + "; ".join(f"{r:.2f} {tile(c)} {h}" for r, c, h in timed[:3])
              + note, flush=True)
        if timed:
            picks.append((m, timed[0][1]))
    bands: list[tuple[int | None, MM]] = []
    for m, cfg in picks:
        if bands and bands[-1][1] == cfg:
            bands[-1] = (m, cfg)
        else:
            bands.append((m, cfg))
    if bands:
        bands[-1] = (None, bands[-1][1])
    print(f"  banded entry ({time.time() - t0:.0f} s):")
    print(f"    TUNED[(torch.bfloat16, {n}, {k})] = banded(MMConfig(..., split_k={splits}, k_align={K_ALIGN}), [")
    for hi, cfg in bands:
        print(f"        ({hi}, {cfg_line(cfg)}),")
    print("    ])", flush=True)
    return bands


def install(n: int, k: int, swept: list[tuple[int | None, MM]], first_m: int) -> MM:
    """TUNED's entry for (N, K) with the swept bands from first_m up and the table's own below it,
    installed in this process (the public path then selects from it, self-check included)."""
    key = (BF16, n, k)
    entry = configs.TUNED[key]
    base = dataclasses.replace(entry, bands=())
    kept = [(hi, cfg) for hi, cfg in entry.bands if hi is not None and hi < first_m]
    merged = configs.banded(base, kept + list(swept))  # rungs already split as base splits K
    configs.TUNED[key] = merged
    mm.reset_ladder_decisions()
    print(f"  installed for this run (the table's bands below M = {first_m}, the sweep's from there):")
    for hi, cfg in merged.bands:
        print(f"        ({hi}, {cfg_line(cfg)}),")
    return merged


def plan_only(shapes, ms, splits: int) -> int:
    total = 0
    for n, k in shapes:
        count = sum(len(candidates(m, splits)) for m in ms)
        total += count
        print(f"## N={n} K={k}: {count} rung timings over M = {list(ms)}")
        for m in ms:
            print(f"  M={m}: " + ", ".join(f"{tile(c)} {h}" for c, h in candidates(m, splits)))
    print(f"# {total} graph measurements in all (plus cuBLAS and the unsplit references)")
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", help="NxK (repeatable); default: all narrow shapes")
    ap.add_argument("--ms", help=f"comma-separated M values (default: the table {','.join(map(str, TABLE_MS))}; "
                                 f"the sweep {','.join(map(str, GRID))})")
    ap.add_argument("--sweep", action="store_true", help="time candidate rungs per M and print a banded entry")
    ap.add_argument("--splits", type=int, default=4, help="K ranges of the swept partition")
    ap.add_argument("--rep", type=int, default=15, help="ms of kernels per graph replay (do_bench_cudagraph)")
    ap.add_argument("--plan-only", action="store_true", help="no GPU: print what a sweep would time")
    ap.add_argument("--then-table", action="store_true",
                    help="after each shape's sweep, install its bands (the table's own below the first swept M) "
                         "and measure the public path with them at every M of the table")
    args = ap.parse_args(argv)
    shapes = [tuple(map(int, s.lower().split("x"))) for s in args.shape] if args.shape else SHAPES
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else GRID if args.sweep or args.plan_only else TABLE_MS
    splitk = importlib.import_module("zmrl.batch_invariant.triton._splitk")
    for _, k in shapes:
        if args.sweep and (args.splits < 1 or splitk.effective_splits(k, args.splits, K_ALIGN) != args.splits):
            raise SystemExit(f"--splits {args.splits}: K={k} does not split into {args.splits} ranges of whole "
                             f"{K_ALIGN}-column blocks")
    if args.plan_only:
        plan_only(shapes, ms, args.splits)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{importlib.import_module('triton').__version__}")
    t0 = time.time()
    with torch.no_grad():
        for n, k in shapes:
            if not args.sweep:
                table(n, k, ms, args.rep)
                continue
            bands = sweep(n, k, ms, args.splits, args.rep)
            if args.then_table and bands:
                install(n, k, bands, min(ms))
                table(n, k, TABLE_MS, args.rep)
    print(f"# total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
