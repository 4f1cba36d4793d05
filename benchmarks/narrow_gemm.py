"""Sweep split-K counts and tiles for the narrow GEMM shapes, graph-replayed, against cuBLAS.

    python benchmarks/narrow_gemm.py [--shape 1536x7168] [--top 3] [--ms 1,16,256,1024]

For each shape (bf16, weight [N, K], x [M, K]) and each candidate config (tile x split count;
the split count is part of the shape's config, never a function of M) it times zmrl's GEMM
replayed from a CUDA graph (triton.testing.do_bench_cudagraph) and F.linear (cuBLAS) in the same
run, and prints cuBLAS time / zmrl time per M (>= 0.8 is the target at every M). Phase 1 runs
each candidate as the fixed config at every M (ladder off); phase 2 runs the best `--top` of them
as the shape's table entry with the tile ladder on (the public path: the ladder's self-check
decides per process whether its small-M tiles are used; its decision is printed). The pick
maximizes the worst ratio over M (then the geometric mean); it is printed as the one line to put
into TUNED in zmrl/batch_invariant/triton/matmul.py. Invariance of the pick is checked at the
end (each row alone vs in batches of several M, torch.equal).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())

import zmrl.batch_invariant.triton as tri  # noqa: E402

mm = importlib.import_module("zmrl.batch_invariant.triton.matmul")
splitk = importlib.import_module("zmrl.batch_invariant.triton._splitk")
BF16 = torch.bfloat16
SHAPES = [(1536, 7168), (576, 7168), (24576, 1536)]
MS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TILES = [  # BLOCK_K 64 throughout: the tile ladder applies to BLOCK_K 64 configs only
    mm.MMConfig(64, 64, 64, num_warps=4, num_stages=4),
    mm.MMConfig(64, 128, 64, num_warps=4, num_stages=4),
    mm.MMConfig(128, 128, 64, num_warps=4, num_stages=4),
    mm.MMConfig(128, 128, 64, num_warps=8, num_stages=4),
    mm.MMConfig(64, 256, 64, num_warps=4, num_stages=4),
    mm.MMConfig(128, 256, 64, num_warps=8, num_stages=3),
]


def splits_for(k: int) -> list[int]:
    """Split counts that give distinct K ranges at the ladder's 1024 alignment."""
    seen, out = set(), []
    for s in (1, 2, 3, 4, 5, 7, 8):
        eff = splitk.effective_splits(k, s, 1024)
        if eff not in seen:
            seen.add(eff)
            out.append(eff)
    return out


def graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return 1e3 * do_bench_cudagraph(fn, rep=25)


def cfg_line(cfg: mm.MMConfig) -> str:
    fields = [f"{cfg.block_m}, {cfg.block_n}, {cfg.block_k}", f"num_warps={cfg.num_warps}", f"num_stages={cfg.num_stages}"]
    if cfg.group_m != 8:
        fields.append(f"group_m={cfg.group_m}")
    if not cfg.persistent:
        fields.append("persistent=False")
    if cfg.flatten:
        fields.append("flatten=True")
    if cfg.split_k != 1:
        fields.append(f"split_k={cfg.split_k}")
    return f"MMConfig({', '.join(fields)})"


def score(ratios: list[float]) -> tuple[float, float]:
    return min(ratios), math.exp(sum(map(math.log, ratios)) / len(ratios))


def row(label: str, ratios: list[float]) -> str:
    lo, gm = score(ratios)
    return f"  {label:<58} " + " ".join(f"{r:5.2f}" for r in ratios) + f" | min {lo:4.2f} gmean {gm:4.2f}"


def invariant(n: int, k: int, ms) -> str:
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn(64, k, device="cuda", generator=g).to(BF16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(BF16)
    alone = torch.cat([tri.linear(pool[i:i + 1], w) for i in range(pool.shape[0])])
    bad = 0
    for m in ms:
        idx = torch.randint(0, pool.shape[0], (m,), device="cuda", generator=g)
        bad += int((tri.linear(pool[idx], w) != alone[idx]).any(-1).sum())
    return "invariant (torch.equal, every row)" if bad == 0 else f"NOT INVARIANT: {bad} rows differ"


def sweep(n: int, k: int, ms, top: int) -> None:
    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(BF16)
    xs = {m: torch.randn(m, k, device="cuda").to(BF16) for m in ms}
    key = (BF16, n, k)
    table_before = mm.TUNED.get(key)
    print(f"\n## N={n} K={k} bf16: cuBLAS time / zmrl time, graph-replayed; M = {list(ms)}", flush=True)
    cublas = {m: graph_us(lambda m=m: F.linear(xs[m], w)) for m in ms}
    print("  cuBLAS us: " + " ".join(f"{cublas[m]:.1f}" for m in ms))
    # today's public path (whatever the table says now, ladder on)
    mm.reset_ladder_decisions()
    for m in ms:
        tri.linear(xs[m], w)
    now = [cublas[m] / graph_us(lambda m=m: tri.linear(xs[m], w)) for m in ms]
    print(row(f"current table entry {cfg_line(mm.config_for(n, k, BF16))}", now), flush=True)

    print("  phase 1: fixed config at every M (ladder off)")
    results = []
    t0 = time.time()
    for tile in TILES:
        for s in splits_for(k):
            cfg = dataclasses.replace(tile, split_k=s)
            try:
                ratios = [cublas[m] / graph_us(lambda m=m: mm.gemm(xs[m][None], w.t()[None], None, cfg)) for m in ms]
            except Exception as e:  # noqa: BLE001 - a tile that does not fit this GPU: report, go on
                print(f"  {cfg_line(cfg):<58} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            results.append((score(ratios), cfg, ratios))
            print(row(cfg_line(cfg), ratios), flush=True)
    print(f"  ({time.time() - t0:.0f} s)")
    results.sort(key=lambda r: r[0], reverse=True)

    print(f"  phase 2: the best {top} as the table entry, ladder on (public path)")
    best = (score(now), table_before, now, "current")
    for _, cfg, fixed in results[:top]:
        mm.TUNED[key] = cfg
        mm.reset_ladder_decisions()
        for m in ms:
            tri.linear(xs[m], w)  # eager first: the ladder's self-check never runs inside a capture
        ratios = [cublas[m] / graph_us(lambda m=m: tri.linear(xs[m], w)) for m in ms]
        dec = mm.ladder_decision(n, k, BF16, "k_major", "cuda")
        print(row(f"{cfg_line(cfg)} ladder", ratios) + f" [{'ladder used' if dec['use_ladder'] else 'ladder off'}]")
        if not dec["use_ladder"]:
            print(f"    ladder decision: {dec['reason'][:200]}")
        for cand, how in ((ratios, "ladder on"), (fixed, "ZMRL_GEMM_LADDER=off")):
            if score(cand) > best[0]:
                best = (score(cand), cfg, cand, how)
    (lo, gm), cfg, ratios, how = best
    mm.TUNED[key] = cfg
    mm.reset_ladder_decisions()
    print(f"  PICK for N={n} K={k}: min {lo:.2f} gmean {gm:.2f} ({how}); table line:")
    print(f"    (torch.bfloat16, {n}, {k}): {cfg_line(cfg) if cfg is not None else '(no entry: the default config)'},")
    if how == "ZMRL_GEMM_LADDER=off":
        print("    note: this score was measured with the ladder off; with the ladder on the public path may differ")
    print(f"  pick: {invariant(n, k, (1, 2, 3, 16, 17, 33, 64, 255, 256, 1000))}", flush=True)
    if table_before is not None:
        mm.TUNED[key] = table_before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", help="NxK (repeatable); default: all narrow shapes")
    ap.add_argument("--ms", help="comma-separated M values")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [tuple(map(int, s.split("x"))) for s in args.shape] if args.shape else SHAPES
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else MS
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{importlib.import_module('triton').__version__}")
    with torch.no_grad():
        for n, k in shapes:
            sweep(n, k, ms, args.top)


if __name__ == "__main__":
    main()
