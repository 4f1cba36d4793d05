"""Triton batch-invariant kernels vs cuBLAS / torch on one GPU, ratios measured in one run.

    python benchmarks/triton_bench.py                 # everything, tables on stdout
    python benchmarks/triton_bench.py --only matmul   # named sections (matmul matmul_fp32 rowwise
                                                      # rowvariants topk mla moe train)
    python benchmarks/triton_bench.py --sweep         # try matmul tile configs per (N, K, dtype)
    python benchmarks/triton_bench.py --sweep --only rungs_bf16   # candidate ladder rungs per M
    python benchmarks/triton_bench.py --out DIR       # also write DIR/triton_bench.{md,json}

Every figure is the median over trials of a CUDA-graph replay that runs the op on several
buffer sets in turn (so weights come from HBM, not L2, and launch gaps are not timed).
ratio = baseline time / Triton time: above 1 the invariant kernel is faster.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import zmrl.batch_invariant.triton as tri  # noqa: E402

mm = importlib.import_module("zmrl.batch_invariant.triton.matmul")
ladder = importlib.import_module("zmrl.batch_invariant.triton._gemm_ladder")
topk_mod = importlib.import_module("zmrl.batch_invariant.triton.topk")
mla_mod = importlib.import_module("zmrl.batch_invariant.triton.sparse_mla")

# with token counts between the powers of two (160, 1280, 3072), where a partial last wave or row
# tile shows
MATMUL_M = (1, 8, 16, 32, 64, 160, 256, 1024, 1280, 3072, 4096, 8192)
MATMUL_NK = ((4096, 4096), (2048, 7168), (7168, 2048))
ROW_M = (1, 8, 64, 256, 1024, 4096)
L2_BYTES = 60 << 20


def _median_ms(run, reps: int, trials: int, calls_per_run: int = 1) -> float:
    """Median over `trials` of CUDA-event milliseconds per call, `reps` runs of `run` each."""
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (reps * calls_per_run))
    return statistics.median(times)


def time_calls(calls, reps: int = 10, trials: int = 5) -> float:
    """Median milliseconds per call of `calls` (one closure per buffer set), graph-replayed."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    return _median_ms(graph.replay, reps, trials, len(calls))


def copies(nbytes: int) -> int:
    """Buffer sets needed so one replay streams more than 3x the L2."""
    return max(2, min(16, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def table(title, header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).rjust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    out = [f"\n### {title}", line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    text = "\n".join(out)
    print(text, flush=True)
    return text


# ----------------------------------------------------------------------------- matmul
def _linear_sets(m, n, k, dtype):
    sets = []
    for i in range(copies((m * k + n * k + m * n) * torch.finfo(dtype).bits // 8)):
        g = torch.Generator(device="cuda").manual_seed(i)
        x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * k ** -0.5
        sets.append((x, w))
    return sets


def bench_matmul(dtype, shapes=MATMUL_NK, ms=MATMUL_M):
    """The public path (gemm without a config: the tile ladder where the shape's self-check
    passed, else the fixed config) and the fixed config, both against cuBLAS."""
    rows, records, decisions = [], [], {}
    for n, k in shapes:
        fixed_cfg = mm.config_for(n, k, dtype)
        for m in ms:
            sets = _linear_sets(m, n, k, dtype)
            t_cublas = time_calls([lambda x=x, w=w: F.linear(x, w) for x, w in sets])
            # the first public call runs the shape's self-check (outside the graph capture)
            t_pub = time_calls([lambda x=x, w=w: mm.gemm(x[None], w.t()[None]) for x, w in sets])
            t_fix = time_calls([lambda x=x, w=w: mm.gemm(x[None], w.t()[None], None, fixed_cfg) for x, w in sets])
            cfg, pad = mm.chosen_config(m, n, k, dtype, "k_major", "cuda")
            x, w = sets[0]
            same = torch.equal(mm.gemm(x[None], w.t()[None]), mm.gemm(x[None], w.t()[None], None, fixed_cfg))
            tflop = 2 * m * n * k / 1e9
            rec = dict(op="linear", dtype=str(dtype), m=m, n=n, k=k, cublas_ms=t_cublas, public_ms=t_pub,
                       ratio=t_cublas / t_pub, fixed_ms=t_fix, fixed_ratio=t_cublas / t_fix, bitwise_public_eq_fixed=same,
                       public_config=str(cfg), pad_rows=pad, fixed_config=str(fixed_cfg))
            records.append(rec)
            tail = "" if cfg.tail is None else f" + tail {cfg.tail.block_m}x{cfg.tail.block_n}"  # a row split
            tile = f"{cfg.block_m}x{cfg.block_n}{tail}" + ("+pad" if pad else "") + ("" if cfg != fixed_cfg else " (fixed)")
            rows.append((m, f"{n}x{k}", f"{tflop / t_cublas:.0f}", f"{tflop / t_pub:.0f}", f"{rec['ratio']:.2f}", tile,
                         f"{rec['fixed_ratio']:.2f}", "yes" if same else "NO"))
            print("  row:", rows[-1], flush=True)  # progress, in case the run is cut short
            del sets
        decisions[(n, k)] = mm.ladder_decision(n, k, dtype, "k_major", "cuda")
    text = table(f"linear {dtype} (x [M,K] @ W[N,K]^T): TFLOP/s and ratio cuBLAS/Triton; public path = ladder "
                 f"where its self-check passed (ZMRL_GEMM_LADDER={mm.ladder_mode()})",
                 ("M", "NxK", "cuBLAS", "public", "ratio", "public tile", "fixed-config ratio", "bits==fixed"), rows)
    lines = [f"- {n}x{k}: {'LADDER' if d['use_ladder'] else 'FIXED'}: {d['reason']} ({d['seconds']:.2f} s)"
             for (n, k), d in decisions.items()]
    print("\n".join(lines), flush=True)
    records += [dict(op="ladder_decision", **d) for d in decisions.values()]
    return text + "\n\nladder self-check per shape:\n" + "\n".join(lines), records


SWEEP_BF16 = [
    mm.MMConfig(128, 256, 64, 8, 8, 3), mm.MMConfig(128, 256, 64, 8, 8, 3, flatten=True),
    mm.MMConfig(128, 256, 64, 8, 8, 3, persistent=False), mm.MMConfig(128, 128, 64, 8, 8, 4),
    mm.MMConfig(128, 128, 64, 8, 4, 4), mm.MMConfig(128, 128, 64, 8, 8, 4, persistent=False),
    mm.MMConfig(256, 128, 64, 8, 8, 3), mm.MMConfig(64, 256, 64, 8, 4, 4),
    mm.MMConfig(128, 128, 64, 1, 8, 4), mm.MMConfig(128, 256, 64, 1, 8, 3),
]
SWEEP_FP32 = [
    mm.MMConfig(64, 64, 16, 8, 4, 3), mm.MMConfig(64, 64, 16, 8, 4, 4), mm.MMConfig(32, 64, 16, 8, 4, 3),
    mm.MMConfig(128, 128, 16, 8, 16, 3), mm.MMConfig(64, 64, 16, 8, 4, 3, persistent=False),
]


def sweep(dtype, configs, ms=(64, 1024, 4096, 8192)):
    rows, best = [], {}
    for n, k in MATMUL_NK:
        base = {}
        for m in ms:
            sets = _linear_sets(m, n, k, dtype)
            base[m] = (time_calls([lambda x=x, w=w: F.linear(x, w) for x, w in sets], reps=5, trials=3), sets)
        scores = []
        for cfg in configs:
            try:
                ratios = [base[m][0] / time_calls([lambda x=x, w=w: mm.gemm(x[None], w.t()[None], None, cfg)
                                                   for x, w in base[m][1]], reps=5, trials=3) for m in ms]
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                print(f"  {n}x{k} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            big = [r for m, r in zip(ms, ratios) if m >= 1024]
            score = math.exp(sum(map(math.log, big)) / len(big))
            scores.append((score, cfg))
            rows.append((f"{n}x{k}", str(cfg).replace("MMConfig", ""), *[f"{r:.2f}" for r in ratios], f"{score:.3f}"))
        best[(n, k)] = max(scores, key=lambda s: s[0])[1] if scores else None
        del base
    text = table(f"sweep {dtype}: ratio cuBLAS/Triton per M; score = geomean over M >= 1024",
                 ("NxK", "config", *[f"M={m}" for m in ms], "score"), rows)
    text += "\nbest: " + "; ".join(f"{nk}: {c}" for nk, c in best.items())
    print(text.splitlines()[-1])
    return text, [dict(n=nk[0], k=nk[1], best=str(c)) for nk, c in best.items()]


def _rung_candidates(m: int, dtype) -> list:
    """Tile shapes to try as ladder rungs at M rows (the lists behind the rungs' choice)."""
    C = mm.MMConfig
    if dtype == torch.float32:  # the FMA path: tile shapes and BLOCK_K 8/16/32
        return [C(bm, bn, bk, 8, w, st, False) for bm, bn, bk, w in (
            (64, 64, 16, 4), (64, 64, 32, 4), (128, 64, 16, 8), (64, 128, 16, 8), (128, 128, 16, 8),
            (128, 128, 16, 16), (32, 64, 16, 4), (32, 32, 16, 4), (16, 64, 16, 2), (16, 32, 16, 2)) for st in (2, 3)]
    smem = lambda bm, bn, bk, st: (bm + bn) * bk * 2 * st <= 210 * 1024  # noqa: E731
    rows = (16,) if m <= 16 else (16, 32) if m <= 32 else (32, 64) if m <= 64 else (64, 128)
    cols = (16, 32, 64) if m <= 64 else (64, 128, 256)
    deep = ((64, 8), (128, 6), (128, 4), (256, 4), (256, 3), (512, 4), (512, 3), (1024, 3), (1024, 2))
    return [C(bm, bn, bk, 1, 4, st, False) for bm in rows for bn in cols for bk, st in deep if smem(bm, bn, bk, st)]


def ladder_sweep(dtype, shapes=MATMUL_NK, ms=(1, 8, 16, 32, 64, 256)):
    """Every candidate rung at each M: bits against the fixed config (probe data of mixed
    magnitudes) and time against cuBLAS, both in this run. Best 5 per (shape, M) printed."""
    rows, records = [], []
    for n, k in shapes:
        fixed = mm.config_for(n, k, dtype)
        xs, _ = ladder._probe_inputs(max(ms), 16, k, dtype, "k_major", torch.device("cuda"), None)
        g = torch.Generator(device="cuda").manual_seed(5)
        w_probe = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)
        want = mm.gemm(xs[0][None], w_probe.t()[None], None, fixed)[0]
        for m in ms:
            sets = _linear_sets(m, n, k, dtype)
            t_cublas = time_calls([lambda x=x, w=w: F.linear(x, w) for x, w in sets])
            found = []
            for cfg in _rung_candidates(m, dtype):
                pad = mm.pads_rows(m, cfg)
                try:
                    same = torch.equal(mm.gemm(xs[0][None, :m], w_probe.t()[None], None, cfg, pad)[0], want[:m])
                    t = time_calls([lambda x=x, w=w: mm.gemm(x[None], w.t()[None], None, cfg, pad) for x, w in sets],
                                   reps=5, trials=3)
                except Exception as e:  # noqa: BLE001 - a shape that does not compile is reported, not fatal
                    print(f"  {n}x{k} M={m} {cfg}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                found.append((t_cublas / t, cfg, same))
                records.append(dict(op="rung", dtype=str(dtype), m=m, n=n, k=k, config=str(cfg), pad_rows=pad,
                                    ratio=t_cublas / t, bitwise_eq_fixed=same))
            found.sort(key=lambda r: -r[0])
            for ratio, cfg, same in found[:5]:
                rows.append((m, f"{n}x{k}", f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}", cfg.num_warps, cfg.num_stages,
                             f"{ratio:.2f}", "yes" if same else "NO"))
            differ = [str(cfg) for _, cfg, same in found if not same]
            print(f"  {n}x{k} M={m}: {len(found)} candidates, {len(differ)} differ from the fixed config", flush=True)
            del sets
    text = table(f"ladder sweep {dtype}: best 5 candidate rungs per M (ratio = cuBLAS / candidate)",
                 ("M", "NxK", "tile", "warps", "stages", "ratio", "bits==fixed"), rows)
    n_diff = sum(not r["bitwise_eq_fixed"] for r in records)
    text += f"\n{len(records)} candidates timed, {n_diff} not bit-equal to the fixed config"
    print(text.splitlines()[-1], flush=True)
    return text, records


# ----------------------------------------------------------------------------- rowwise
def bench_rowwise():
    cases = [
        ("log_softmax", torch.float32, 129280), ("log_softmax", torch.float32, 163840),
        ("softmax", torch.float32, 129280), ("softmax", torch.bfloat16, 129280),
        ("rms_norm", torch.bfloat16, 4096), ("rms_norm", torch.bfloat16, 7168),
    ]
    ours = {"log_softmax": lambda x, w: tri.log_softmax(x, -1), "softmax": lambda x, w: tri.softmax(x, -1),
            "rms_norm": lambda x, w: tri.rms_norm(x, w, 1e-6)}
    theirs = {"log_softmax": lambda x, w: torch.log_softmax(x, -1), "softmax": lambda x, w: torch.softmax(x, -1),
              "rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)}
    rows, records = [], []
    for name, dtype, width in cases:
        for m in ROW_M:
            nbytes = 2 * m * width * torch.finfo(dtype).bits // 8
            sets = [(torch.randn(m, width, device="cuda", dtype=dtype) * 3, torch.randn(width, device="cuda", dtype=dtype))
                    for _ in range(copies(nbytes))]
            t_t = time_calls([lambda x=x, w=w: theirs[name](x, w) for x, w in sets])
            t_o = time_calls([lambda x=x, w=w: ours[name](x, w) for x, w in sets])
            gbs = nbytes / t_o / 1e6
            records.append(dict(op=name, dtype=str(dtype), m=m, width=width, torch_ms=t_t, triton_ms=t_o, ratio=t_t / t_o))
            rows.append((name, str(dtype).replace("torch.", ""), width, m, f"{t_t * 1e3:.1f}", f"{t_o * 1e3:.1f}",
                         f"{gbs:.0f}", f"{t_t / t_o:.2f}"))
            del sets
    return table("row ops vs torch (us; Triton GB/s counts one read + one write)",
                 ("op", "dtype", "width", "M", "torch us", "Triton us", "GB/s", "ratio"), rows), records


ROW_VARIANTS = [(8192, 16, 3), (8192, 16, 6), (16384, 32, 3), (16384, 16, 4), (4096, 8, 8), (8192, 32, 4)]


def bench_row_variants():
    """log_softmax launch shapes (CHUNK, warps, load stages) at one row and at many."""
    rw = importlib.import_module("zmrl.batch_invariant.triton.rowwise")
    saved = (rw.CHUNK, rw.CHUNK_WARPS, rw.LOAD_STAGES)
    rows, records = [], []
    for m in (1, 8, 4096):
        sets = [torch.randn(m, 129280, device="cuda") * 3 for _ in range(copies(m * 129280 * 8))]
        t_t = time_calls([lambda x=x: torch.log_softmax(x, -1) for x in sets])
        cells = []
        for chunk, warps, stages in ROW_VARIANTS:
            rw.CHUNK, rw.CHUNK_WARPS, rw.LOAD_STAGES = chunk, warps, stages
            t_o = time_calls([lambda x=x: tri.log_softmax(x, -1) for x in sets])
            cells.append(f"{t_t / t_o:.2f}")
            records.append(dict(op="log_softmax_variant", m=m, chunk=chunk, warps=warps, stages=stages,
                                ratio=t_t / t_o))
        rw.CHUNK, rw.CHUNK_WARPS, rw.LOAD_STAGES = saved
        rows.append((m, *cells))
        del sets
    return table("log_softmax fp32, width 129280: ratio torch/Triton per (CHUNK, warps, stages)",
                 ("M", *[f"{c}/{w}/{st}" for c, w, st in ROW_VARIANTS]), rows), records


# ----------------------------------------------------------------------------- topk
def bench_topk():
    rows, records = [], []
    # decode-style rows of a long context (k = 2048), then a packed train batch's many short rows:
    # a router's top-6 of 64 experts and an indexer's top-256 of a ~570-token sequence
    cases = [(n, r, 2048) for n in (8192, 32768, 131072) for r in (1, 64, 1024)]
    cases += [(64, 14788, 6), (571, 14788, 256)]
    for n, r, k in cases:
        sets = [torch.randn(r, n, device="cuda") for _ in range(copies(r * n * 4))]
        t_t = time_calls([lambda x=x: torch.topk(x, k, dim=-1, sorted=False) for x in sets])
        t_o = time_calls([lambda x=x: topk_mod.topk_launch(x, k) for x in sets])
        alt = []
        for block, warps in ((2048, 8), (4096, 16)) if n <= topk_mod.SINGLE_MAX else ():
            t_v = time_calls([lambda x=x: topk_mod.topk_launch(x, k, block, warps) for x in sets])
            alt.append(f"{block}/w{warps}: {t_t / t_v:.2f}")
        records.append(dict(op="topk", n=n, rows=r, k=k, torch_ms=t_t, triton_ms=t_o, ratio=t_t / t_o,
                            variants=alt))
        rows.append((n, r, k, f"{t_t * 1e3:.1f}", f"{t_o * 1e3:.1f}", f"{t_t / t_o:.2f}", "; ".join(alt)))
        del sets
    return table(f"top-k, fp32 (torch.topk sorted=False vs canonical radix select; rows over "
                 f"{topk_mod.SINGLE_MAX} columns run as {topk_mod.SEG}-column segments)",
                 ("N", "rows", "k", "torch us", "Triton us", "ratio", "other BLOCK/warps: ratio"), rows), records


# ----------------------------------------------------------------------------- sparse MLA
def _dense_mla(ql, qr, kv, kr, idx, scale):
    """The dense torch path: gather the selected rows, then SDPA (MQA: one KV head for all)."""
    valid = idx >= 0
    safe = idx.clamp(min=0)
    q = torch.cat([ql, qr], -1)[:, None]  # [T, 1, H, C+R]: heads as query rows of one KV head
    keys = torch.cat([kv, kr], -1)[safe][:, None]  # [T, 1, k, C+R]
    vals = kv[safe][:, None]  # [T, 1, k, C]
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=valid[:, None, None, :], scale=scale)


MLA_VARIANTS = [dict(BLOCK_H=64, BLOCK_CV=128, BLOCK_CK=64, num_warps=8, num_stages=2),  # the default until 2026-12-02
                dict(BLOCK_H=64, BLOCK_CV=64, BLOCK_CK=64, num_warps=8, num_stages=2),
                dict(BLOCK_H=64, BLOCK_CV=256, BLOCK_CK=64, num_warps=16, num_stages=2),
                dict(BLOCK_H=64, BLOCK_CV=512, BLOCK_CK=64, num_warps=16, num_stages=1)]


def bench_mla():
    rows, records = [], []
    h, c, r, width = 64, 512, 64, 2048
    for s_len in (8192, 65536):
        for t_len, kind in ((1, "decode"), (32, "decode"), (1024, "prefill")):
            sets = []
            for i in range(2):
                kv = torch.randn(s_len, c, device="cuda", dtype=torch.bfloat16)
                kr = torch.randn(s_len, r, device="cuda", dtype=torch.bfloat16)
                ql = torch.randn(t_len, h, c, device="cuda", dtype=torch.bfloat16)
                qr = torch.randn(t_len, h, r, device="cuda", dtype=torch.bfloat16)
                idx = torch.stack([torch.randperm(s_len, device="cuda")[:width].sort().values for _ in range(t_len)])
                sets.append((ql, qr, kv, kr, idx))
            scale = (c + r) ** -0.5
            try:
                t_d = time_calls([lambda a=a: _dense_mla(*a, scale) for a in sets], reps=3, trials=3)
            except Exception as e:  # noqa: BLE001 - report the baseline's failure, keep going
                print(f"dense sparse-MLA baseline failed at T={t_len}: {type(e).__name__}: {str(e)[:200]}")
                t_d = float("nan")
            t_o = time_calls([lambda a=a: mla_mod.sparse_mla_forward(*a, scale, 64) for a in sets], reps=3, trials=3)
            alt = []
            for cfg in MLA_VARIANTS if s_len == 8192 else ():
                t_v = time_calls([lambda a=a: mla_mod.sparse_mla_forward(*a, scale, 64, cfg) for a in sets],
                                 reps=3, trials=3)
                alt.append(f"{cfg['BLOCK_H']}/{cfg['BLOCK_CV']}/{cfg['BLOCK_CK']}/w{cfg['num_warps']}: {t_d / t_v:.2f}")
            records.append(dict(op="sparse_mla", kind=kind, t=t_len, s=s_len, h=h, topk=width,
                                dense_ms=t_d, triton_ms=t_o, ratio=t_d / t_o, variants=alt))
            rows.append((kind, t_len, s_len, f"{t_d * 1e3:.0f}", f"{t_o * 1e3:.0f}", f"{t_d / t_o:.2f}",
                         "; ".join(alt)))
            del sets
    return table(f"sparse MLA bf16, H={h}, C={c}+{r}, topk={width} (dense = gather + SDPA)",
                 ("kind", "T", "context", "dense us", "Triton us", "ratio", "other tiles (H/CV/CK/warps: ratio)"),
                 rows), records


# ----------------------------------------------------------------------------- MoE
def bench_moe():
    rows, records = [], []
    d, i, e, k = 7168, 2048, 32, 8
    wg = torch.randn(e, i, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5
    wu = torch.randn(e, i, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5
    wd = torch.randn(e, d, i, device="cuda", dtype=torch.bfloat16) * i ** -0.5
    for n in (16, 256, 4096):
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(n, e, device="cuda").topk(k, -1).indices.sort(-1).values
        w = torch.rand(n, k, device="cuda")
        per_expert = [(ids == j).nonzero(as_tuple=True) for j in range(e)]  # routing is not timed

        def loop():
            out = torch.zeros(n, d, device="cuda", dtype=torch.float32)
            for j, (tok, slot) in enumerate(per_expert):
                xe = x[tok]
                h = F.silu(xe @ wg[j].t()) * (xe @ wu[j].t())
                out.index_add_(0, tok, (h @ wd[j].t()).float() * w[tok, slot][:, None])
            return out.to(x.dtype)

        t_t = time_calls([loop], reps=3, trials=3)
        t_o = time_calls([lambda: tri.moe_experts(x, ids, w, wg, wu, wd)], reps=3, trials=3)
        records.append(dict(op="moe", tokens=n, d=d, i=i, experts=e, k=k, torch_ms=t_t, triton_ms=t_o, ratio=t_t / t_o))
        rows.append((n, f"{t_t * 1e3:.0f}", f"{t_o * 1e3:.0f}", f"{t_t / t_o:.2f}"))
    return table(f"MoE experts bf16, D={d}, I={i}, E={e}, top-{k} (torch = per-expert mm loop)",
                 ("tokens", "torch us", "Triton us", "ratio"), rows), records


# ----------------------------------------------------------------------------- training step
def time_eager(fn, reps: int = 5, trials: int = 3) -> float:
    """Median milliseconds per call without a CUDA graph (the MoE backward syncs on the host)."""
    fn()
    torch.cuda.synchronize()
    return _median_ms(fn, reps, trials)


def _fwd_bwd(op, leaves, grad_out):
    def step():
        for t in leaves:
            t.grad = None
        op().backward(grad_out)
    return step


def bench_train():
    """Forward + backward (what a trainer step runs) against torch's own kernels, eager, same
    run: linear vs F.linear (cuBLAS), MoE vs a per-expert torch loop under autograd (trained and
    frozen experts), sparse MLA vs gather + SDPA. Times include autograd's own overhead."""
    rows, records = [], []
    bf = torch.bfloat16
    for n, k in MATMUL_NK:
        for m in (1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=bf, requires_grad=True)
            w = (torch.randn(n, k, device="cuda", dtype=bf) * k ** -0.5).requires_grad_()
            g = torch.randn(m, n, device="cuda", dtype=bf)
            t_t = time_eager(_fwd_bwd(lambda: F.linear(x, w), (x, w), g))
            t_o = time_eager(_fwd_bwd(lambda: tri.linear(x, w), (x, w), g))
            rows.append(("linear", f"M={m} {n}x{k}", f"{t_t * 1e3:.0f}", f"{t_o * 1e3:.0f}", f"{t_t / t_o:.2f}"))
            print("  row:", rows[-1], flush=True)
    d, i, e, k = 7168, 2048, 32, 8
    wg, wu = ((torch.randn(e, i, d, device="cuda", dtype=bf) * d ** -0.5) for _ in range(2))
    wd = torch.randn(e, d, i, device="cuda", dtype=bf) * i ** -0.5
    for frozen in (False, True):
        ws = [t.clone().requires_grad_(not frozen) for t in (wg, wu, wd)]
        for n_tok in (256, 4096):
            x = torch.randn(n_tok, d, device="cuda", dtype=bf, requires_grad=True)
            ids = torch.rand(n_tok, e, device="cuda").topk(k, -1).indices.sort(-1).values
            wt = torch.rand(n_tok, k, device="cuda")
            g = torch.randn(n_tok, d, device="cuda", dtype=bf)
            per_expert = [(ids == j).nonzero(as_tuple=True) for j in range(e)]

            def loop():
                out = torch.zeros(n_tok, d, device="cuda", dtype=torch.float32)
                for j, (tok, slot) in enumerate(per_expert):
                    xe = x[tok]
                    h = F.silu(xe @ ws[0][j].t()) * (xe @ ws[1][j].t())
                    out = out.index_add(0, tok, (h @ ws[2][j].t()).float() * wt[tok, slot][:, None])
                return out.to(bf)

            leaves = [x] + ([] if frozen else ws)
            t_t = time_eager(_fwd_bwd(loop, leaves, g), reps=3)
            t_o = time_eager(_fwd_bwd(lambda: tri.moe_experts(x, ids, wt, *ws), leaves, g), reps=3)
            label = f"tokens={n_tok} E={e} top-{k}" + (" frozen experts" if frozen else "")
            rows.append(("moe", label, f"{t_t * 1e3:.0f}", f"{t_o * 1e3:.0f}", f"{t_t / t_o:.2f}"))
            print("  row:", rows[-1], flush=True)
    h, c, r, width, s_len = 64, 512, 64, 2048, 8192
    for t_len in (256, 1024):
        kv, kr = (torch.randn(s_len, dim, device="cuda", dtype=bf, requires_grad=True) for dim in (c, r))
        ql, qr = (torch.randn(t_len, h, dim, device="cuda", dtype=bf, requires_grad=True) for dim in (c, r))
        idx = torch.stack([torch.randperm(s_len, device="cuda")[:width].sort().values for _ in range(t_len)])
        g = torch.randn(t_len, h, c, device="cuda", dtype=bf)
        scale = (c + r) ** -0.5
        leaves = (ql, qr, kv, kr)
        t_t = time_eager(_fwd_bwd(lambda: _dense_mla(ql, qr, kv, kr, idx, scale)[:, 0], leaves, g), reps=3)
        t_o = time_eager(_fwd_bwd(lambda: tri.sparse_mla(ql, qr, kv, kr, idx, scale)[0], leaves, g), reps=3)
        rows.append(("sparse_mla", f"T={t_len} context={s_len} topk={width}", f"{t_t * 1e3:.0f}", f"{t_o * 1e3:.0f}",
                     f"{t_t / t_o:.2f}"))
        print("  row:", rows[-1], flush=True)
    records += [dict(op=r[0], case=r[1], torch_us=float(r[2]), triton_us=float(r[3]), ratio=float(r[4])) for r in rows]
    return table("forward + backward, bf16, eager (torch = cuBLAS / per-expert loop / gather + SDPA under autograd)",
                 ("op", "case", "torch us", "Triton us", "ratio"), rows), records


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--sweep", action="store_true", help="fixed-config and ladder-rung sweeps instead")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    head = (f"{datetime.date.today()} | {props.name} ({props.multi_processor_count} SMs) | torch {torch.__version__}"
            f" | triton {triton.__version__}")
    print(head, flush=True)
    texts, records = [head], []
    sections = {"matmul": lambda: bench_matmul(torch.bfloat16),
                "matmul_fp32": lambda: bench_matmul(torch.float32, ((4096, 4096),), (1, 64, 1024, 4096)),
                "rowwise": bench_rowwise, "rowvariants": bench_row_variants, "topk": bench_topk, "mla": bench_mla, "moe": bench_moe,
                "train": bench_train}
    if args.sweep:
        sections = {"sweep_bf16": lambda: sweep(torch.bfloat16, SWEEP_BF16),
                    "sweep_fp32": lambda: sweep(torch.float32, SWEEP_FP32, ms=(64, 1024, 4096)),
                    "rungs_bf16": lambda: ladder_sweep(torch.bfloat16),
                    "rungs_fp32": lambda: ladder_sweep(torch.float32, ((4096, 4096),), (1, 64, 1024))}
    for name, fn in sections.items():
        if args.only and name not in args.only:
            continue
        text, recs = fn()
        texts.append(text)
        records += recs
        if args.out:  # rewritten after every section, so a run cut short still leaves its figures
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "triton_bench.md"), "w") as f:
                f.write("\n".join(texts) + "\n")
            with open(os.path.join(args.out, "triton_bench.json"), "w") as f:
                json.dump(dict(header=head, records=records), f, indent=1)


if __name__ == "__main__":
    main()
