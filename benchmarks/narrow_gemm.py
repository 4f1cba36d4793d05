"""Sweep tiles and split-K counts for the narrow GEMM shapes, graph-replayed, against cuBLAS.

    python benchmarks/narrow_gemm.py                 # all three shapes, M = 1, 16, 128, 1024
    python benchmarks/narrow_gemm.py --shape 576x7168 --ms 1,16,128,1024 --top 2
    python benchmarks/narrow_gemm.py --plan-only     # no GPU: what would be measured, and its cost

For each shape (bf16, weight [N, K], x [M, K]; default 1536x7168, 576x7168, 24576x1536) and each
candidate config (a tile x a split-K count; the split count is part of the shape's config, never
a function of M) it times zmrl's GEMM replayed from a CUDA graph (triton.testing.
do_bench_cudagraph) and F.linear (cuBLAS) in the same run and prints cuBLAS time / zmrl time per
M (the target is >= 0.8 at every M).

What a candidate runs at each M is what the public path would run with that candidate as the
shape's TUNED entry: the tile ladder's rung for that M (the same split count; at small M a
16/32-row tile) where the ladder's self-check passes, so one measurement serves every candidate
whose rung at that M is the same config. The best `--top` candidates (worst ratio over M, then
the geometric mean) are then run through the public path itself (`linear`, the self-check
deciding whether the ladder is used; its decision is printed), the best of those is the pick,
its rows are checked for batch invariance (each row alone vs in batches, torch.equal, with
cuBLAS's rows as the control that the check can see a difference), and the line to paste into
TUNED (zmrl/batch_invariant/triton/_gemm_config.py) is printed.

Candidates: BLOCK_K 64 tiles (the ladder applies to those), from 64x64 to 128x256; split counts
that give distinct K ranges at the ladder's 1024-column alignment (K = 7168: 1, 2, 3, 4, 7;
K = 1536: 1, 2). A split tile keeps an fp32 partial in shared memory, so a split candidate drops
pipeline stages until it fits (as the ladder's rungs do), and tiles above 128x128 are unsplit
only. Why small-N tiles are in the list: a split count cannot change with M, and at M = 1024 the
split's fp32 workspace traffic cost more than its parallelism gave (2026-12-01: 0.53x with 4
splits); where a 64x128 or 64x64 tile fills the SMs unsplit, the ladder now runs the split
in-program (no workspace, same bits), and narrower tiles give more output tiles at large M.
--plan-only prints, per candidate and M, the config the ladder would run ("in-program" marks
those rungs).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import zmrl.batch_invariant.triton as tri  # noqa: E402

mm = importlib.import_module("zmrl.batch_invariant.triton.matmul")
configs = importlib.import_module("zmrl.batch_invariant.triton._gemm_config")
splitk = importlib.import_module("zmrl.batch_invariant.triton._splitk")
BF16 = torch.bfloat16
SHAPES = [(1536, 7168), (576, 7168), (24576, 1536)]
MS = (1, 16, 128, 1024)
INVARIANCE_MS = (1, 2, 3, 16, 17, 33, 128, 255, 1024)
SMS = 132  # an H200; the real count is read from the GPU when there is one
DEVICE = "cuda"  # the CPU smoke test (tests/bench) runs the code path on "cpu" with stand-in GEMMs
TILES = [
    configs.MMConfig(64, 64, 64, num_warps=4, num_stages=4),
    configs.MMConfig(128, 64, 64, num_warps=4, num_stages=4),
    configs.MMConfig(64, 128, 64, num_warps=4, num_stages=4),
    configs.MMConfig(128, 128, 64, num_warps=4, num_stages=4),
    configs.MMConfig(128, 128, 64, num_warps=8, num_stages=4),
    configs.MMConfig(64, 256, 64, num_warps=4, num_stages=4),
    configs.MMConfig(128, 256, 64, num_warps=8, num_stages=3),
]


def split_counts(k: int) -> list[int]:
    """Split counts that give distinct K ranges at the ladder's alignment."""
    align = configs.split_align(BF16, TILES[0])
    seen: list[int] = []
    for s in range(1, 9):
        eff = splitk.effective_splits(k, s, align)
        if eff not in seen:
            seen.append(eff)
    return seen


def candidates(k: int) -> list[configs.MMConfig]:
    out = []
    for tile in TILES:
        for s in split_counts(k):
            if s == 1:
                out.append(tile)
            elif tile.block_m * tile.block_n <= configs._SPLIT_MAX_TILE:
                out.append(configs._with_splits(tile, dataclasses.replace(tile, split_k=s)))
    return out


def runs_at(base: configs.MMConfig, m: int, n: int, sms: int) -> tuple[configs.MMConfig, bool]:
    """(config, pad_rows) the public path runs at this M with `base` as the shape's entry, when
    the ladder's self-check passes."""
    rung = configs._rung_for(m, n, base, sms)
    return rung, rung != base and configs.pads_rows(m, rung)


def cfg_line(cfg: configs.MMConfig) -> str:
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


def row(label: str, ratios: list[float], note: str = "") -> str:
    lo, gm = score(ratios)
    return f"  {label:<62} " + " ".join(f"{r:5.2f}" for r in ratios) + f" | min {lo:4.2f} gmean {gm:4.2f}{note}"


def graph_us(fn, rep: int) -> float:
    from triton.testing import do_bench_cudagraph

    return 1e3 * do_bench_cudagraph(fn, rep=rep)


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


def sweep(n: int, k: int, ms, top: int, rep: int, sms: int, fixed_tiles: bool = True) -> None:
    t_shape = time.time()
    torch.manual_seed(0)
    w = (torch.randn(n, k, device=DEVICE) * k ** -0.5).to(BF16)
    xs = {m: torch.randn(m, k, device=DEVICE).to(BF16) for m in ms}
    key = (BF16, n, k)
    table_before = mm.TUNED.get(key)
    print(f"\n## N={n} K={k} bf16: cuBLAS time / zmrl time, graph-replayed, M = {list(ms)}", flush=True)
    cublas = {m: graph_us(lambda m=m: F.linear(xs[m], w), rep) for m in ms}
    print("  cuBLAS us: " + " ".join(f"{cublas[m]:.1f}" for m in ms))

    def public(label: str) -> list[float]:
        """The public path with the table as it is now: eager calls first (the ladder's self-check
        never runs inside a capture), then graph-replayed."""
        mm.reset_ladder_decisions()
        for m in ms:
            tri.linear(xs[m], w)
        ratios = [cublas[m] / graph_us(lambda m=m: tri.linear(xs[m], w), rep) for m in ms]
        dec = mm.ladder_decision(n, k, BF16, "k_major", DEVICE)
        note = " [ladder used]" if dec["use_ladder"] else f" [fixed config: {dec['reason'][:120]}]"
        print(row(label, ratios, note), flush=True)
        return ratios

    now = public(f"now: {cfg_line(mm.config_for(n, k, BF16))}")

    cands = candidates(k)
    print(f"  {len(cands)} candidates, each as the rung the ladder runs at each M (measured once per config and M)")
    timed: dict[tuple, float] = {}
    results = []
    t0 = time.time()
    for base in cands:
        ratios = []
        try:
            for m in ms:
                cfg, pad = runs_at(base, m, n, sms)
                if (cfg, pad, m) not in timed:
                    timed[(cfg, pad, m)] = graph_us(lambda: mm.gemm(xs[m][None], w.t()[None], None, cfg, pad), rep)
                ratios.append(cublas[m] / timed[(cfg, pad, m)])
        except Exception as e:  # noqa: BLE001 - a tile that does not fit this GPU: report, go on
            print(f"  {cfg_line(base):<62} failed: {type(e).__name__}: {str(e)[:100]}")
            continue
        results.append((score(ratios), base, ratios))
        print(row(cfg_line(base), ratios), flush=True)
    print(f"  ({len(timed)} measurements, {time.time() - t0:.0f} s)")
    results.sort(key=lambda r: r[0], reverse=True)

    # The ladder picks its rung by filling the SMs, whatever the entry's own tile (the rows above
    # differ mostly by split count), so the entry's tile runs only where it is that rung. Where M
    # is large enough for the fixed tiles, show for the best split count whether one of them
    # beats the ladder's rung (what ZMRL_GEMM_LADDER=off would run; a hint for the rung order,
    # not a table entry).
    big = [m for m in ms if m > configs.MID_M]
    top_splits = list(dict.fromkeys(base.split_k for _, base, _ in results))[:1] if fixed_tiles else []
    if big and top_splits:
        print(f"  fixed configs (no ladder) at M = {big} for split counts {top_splits}, vs the ladder's rung:")
    for split in top_splits:
        ladder_best = {m: max(cublas[m] / timed[runs_at(b, m, n, sms) + (m,)] for _, b, _ in results if b.split_k == split)
                       for m in big}
        for base in (b for b in cands if b.split_k == split):
            try:
                ratios = []
                for m in big:
                    if (base, False, m) not in timed:
                        timed[(base, False, m)] = graph_us(lambda: mm.gemm(xs[m][None], w.t()[None], None, base), rep)
                    ratios.append(cublas[m] / timed[(base, False, m)])
            except Exception as e:  # noqa: BLE001
                print(f"    {cfg_line(base):<60} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            beats = [f"M={m}: {r:.2f} vs ladder {ladder_best[m]:.2f}" for m, r in zip(big, ratios) if r > ladder_best[m] * 1.03]
            print(f"    {cfg_line(base):<60} " + " ".join(f"{r:5.2f}" for r in ratios)
                  + (f"  BEATS THE LADDER ({'; '.join(beats)})" if beats else ""), flush=True)
    print(f"  ({len(timed)} measurements in all, {time.time() - t0:.0f} s)")

    # candidates that run the same configs at every M are one choice for the public path; among
    # them the one whose own tile is fastest (where it runs: a refused ladder, M where it is the rung)
    def own_tile(base):
        got = [cublas[m] / timed[(base, False, m)] for m in big if (base, False, m) in timed]
        return score(got)[1] if got else 0.0

    results.sort(key=lambda r: (r[0], own_tile(r[1])), reverse=True)
    distinct, seen = [], set()
    for result in results:
        signature = tuple(runs_at(result[1], m, n, sms) for m in ms)
        if signature not in seen:
            seen.add(signature)
            distinct.append(result)

    print(f"  the best {top} (distinct at some M) through the public path (linear, the ladder's self-check deciding):")
    best = (score(now), table_before, now)
    for _, base, _ in distinct[:top]:
        mm.TUNED[key] = base
        ratios = public(cfg_line(base))
        if score(ratios) > best[0]:
            best = (score(ratios), base, ratios)
    (lo, gm), pick, ratios = best
    mm.TUNED[key] = pick
    mm.reset_ladder_decisions()
    if pick is None:
        del mm.TUNED[key]
    bad = variant_rows(lambda x, w_: tri.linear(x, w_), n, k, INVARIANCE_MS)
    control = variant_rows(lambda x, w_: F.linear(x, w_), n, k, INVARIANCE_MS)
    line = cfg_line(pick if pick is not None else mm.config_for(n, k, BF16))
    print(f"  PICK for N={n} K={k}: min {lo:.2f} gmean {gm:.2f} "
          f"({'>= 0.8 at every M' if lo >= 0.8 else 'MISS: below 0.8 at some M'}); "
          f"{'INVARIANT' if bad == 0 else f'NOT INVARIANT: {bad} rows differ'} (torch.equal per row, "
          f"M in {list(INVARIANCE_MS)}; control: cuBLAS {control} rows differ)")
    print(f"  TUNED line: (torch.bfloat16, {n}, {k}): {line},  # shape total {time.time() - t_shape:.0f} s", flush=True)
    if table_before is not None:
        mm.TUNED[key] = table_before
    else:
        mm.TUNED.pop(key, None)
    mm.reset_ladder_decisions()


def plan_only(shapes, ms, sms: int) -> None:
    """What a run would measure, without a GPU: candidates, the config each runs at each M, and
    the number of distinct graph measurements and compiled kernels."""
    total = 0
    for n, k in shapes:
        cands = candidates(k)
        runs = {runs_at(base, m, n, sms) + (m,) for base in cands for m in ms}
        splits = split_counts(k)[:1]  # the run takes the best split count: as many candidates
        runs |= {(base, False, m) for base in cands for m in ms if m > configs.MID_M and base.split_k in splits}
        kernels = {(cfg, m > 0) for cfg, _, m in runs}
        total += len(runs)
        print(f"## N={n} K={k}: {len(cands)} candidates (splits {split_counts(k)}), {len(runs)} distinct "
              f"(config, M) measurements, {len({cfg for cfg, _ in kernels})} distinct configs")
        for base in cands:
            at = [runs_at(base, m, n, sms)[0] for m in ms]
            print(f"  {cfg_line(base):<62} " + " | ".join(
                f"M={m}: {c.block_m}x{c.block_n}x{c.block_k}/{c.split_k}{' in-program' if c.split_inline else ''}"
                for m, c in zip(ms, at)))
    print(f"# {total} graph measurements in all (plus cuBLAS and the public-path checks)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", help="NxK (repeatable); default: all narrow shapes")
    ap.add_argument("--ms", help="comma-separated M values (default 1,16,128,1024)")
    ap.add_argument("--top", type=int, default=2, help="candidates run through the public path per shape")
    ap.add_argument("--rep", type=int, default=10, help="ms of kernels per graph replay (do_bench_cudagraph)")
    ap.add_argument("--plan-only", action="store_true", help="no GPU: print what would be measured")
    ap.add_argument("--no-fixed-tiles", action="store_true",
                    help="skip timing the candidates' own tiles without the ladder at large M")
    args = ap.parse_args(argv)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shape] if args.shape else SHAPES
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else MS
    if args.plan_only:
        plan_only(shapes, ms, SMS)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()} ({sms} SMs) torch {torch.__version__} triton "
          f"{importlib.import_module('triton').__version__}")
    t0 = time.time()
    with torch.no_grad():
        for n, k in shapes:
            sweep(n, k, ms, args.top, args.rep, sms, fixed_tiles=not args.no_fixed_tiles)
    print(f"# total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
