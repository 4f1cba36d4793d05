"""CPU benchmark of zmrl.batch_invariant against torch's default ops, measured in one run.

    zmrl bench kernels [--quick] [--out FILE.md] [--only linear] [--threads 1 --cpu-time]

For each op at model-like shapes it times the invariant CPU path and the torch default
(the baseline named in each row) on the same inputs, and prints ratio = baseline_time /
zmrl_time (1.0 = as fast as torch; the target for matmul/linear is >= 0.5 at M >= 64).
The "exact GEMM" rows time the fallback a machine takes where the BLAS tiles fail their
self-check (forced on here) against the BLAS tile path; a second table gives the self-check's
cost, once per (op, K, N, dtype, B layout, threads) and process.
On a machine shared with other jobs, wall times mostly measure the queue for a core; with
`--threads 1 --cpu-time` each call is timed by this process's CPU time instead (one torch
thread, so no OpenMP spin-waiting is counted), which the other jobs inflate far less.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import zmrl.batch_invariant as bi


def _time(fn, min_repeats=3, budget_s=0.5, clock=time.perf_counter) -> float:
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < min_repeats or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _linear_on(mode: str, x, w):
    with bi.use_cpu_gemm(mode):
        return bi.linear(x, w)


def _self_check_costs(quick: bool, clock=time.perf_counter) -> list[str]:
    """The first-use self-check of each shape, timed fresh (decisions forgotten first)."""
    from zmrl.batch_invariant import cpu_gemm
    from zmrl.batch_invariant._tiles import LARGE_ROW_TILES

    rows = ["| self-check | K | N | path | probe calls | seconds | in M=1 calls | large tiles | their checks s |",
            "|---|---|---|---|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in ((1024, 1024), (2048, 2048), (4096, 1024)) if not quick else ((1024, 1024),):
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(1, k, generator=g).to(dtype)
            cpu_gemm.reset_decisions()
            t0 = clock()
            with bi.use_cpu_gemm("auto"):
                bi.linear(x, w)
            seconds = clock() - t0
            (d,) = cpu_gemm.decisions()
            one = _time(lambda x=x, w=w: bi.linear(x, w), clock=clock)
            t0 = clock()
            with bi.use_cpu_gemm("auto"):
                large = cpu_gemm.large_tiles_for(w.t(), dtype, max(LARGE_ROW_TILES))  # checked at a first fit
            large_seconds = clock() - t0
            rows.append(f"| linear {d['dtype']} | {k} | {n} | {d['path']} | {d['probes']} | {seconds:.3f} | "
                        f"{seconds / one:.0f} | {','.join(map(str, large)) or '-'} | {large_seconds:.3f} |")
    cpu_gemm.reset_decisions()
    return rows


def _cases(quick: bool):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s, dtype=torch.float32: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    ms = (1, 8, 64, 128, 256, 1024) if not quick else (1, 64, 256)
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in ((1024, 1024), (2048, 2048), (4096, 1024)) if not quick else ((1024, 1024),):
            w = rnd(n, k, dtype=dtype)
            for m in ms:
                x = rnd(m, k, dtype=dtype)
                yield (f"linear {str(dtype)[6:]}", f"M={m} K={k} N={n}", "F.linear",
                       lambda x=x, w=w: bi.linear(x, w), lambda x=x, w=w: F.linear(x, w))
                yield (f"linear {str(dtype)[6:]} exact GEMM", f"M={m} K={k} N={n}", "zmrl BLAS tiles",
                       lambda x=x, w=w: _linear_on("exact", x, w), lambda x=x, w=w: _linear_on("tiles", x, w))
    for d in (2048, 4096):
        w = rnd(d)
        for m in (1, 64, 512):
            x = rnd(m, d)
            yield ("rms_norm fp32", f"M={m} D={d}", "F.rms_norm",
                   lambda x=x, w=w: bi.rms_norm(x, w, 1e-6), lambda x=x, w=w, d=d: F.rms_norm(x, (d,), w, 1e-6))
    for vocab in (32_000, 128_000) if not quick else (32_000,):
        for m in (1, 64):
            x = rnd(m, vocab)
            yield ("log_softmax fp32", f"M={m} V={vocab}", "torch.log_softmax",
                   lambda x=x: bi.log_softmax(x), lambda x=x: torch.log_softmax(x, -1))
            yield ("softmax fp32", f"M={m} V={vocab}", "torch.softmax",
                   lambda x=x: bi.softmax(x), lambda x=x: torch.softmax(x, -1))
    for s, k in ((1024, 64), (8192, 2048)) if not quick else ((1024, 64),):
        sc = rnd(64, s)
        yield ("topk", f"R=64 N={s} k={k}", "torch.topk (values+indices, no tie rule)",
               lambda sc=sc, k=k: bi.topk(sc, k), lambda sc=sc, k=k: torch.topk(sc, k))
    h, dd = 16, 64
    for t, s in ((1, 1024), (1, 8192), (256, 1024)) if not quick else ((1, 1024),):
        q, w, kk = rnd(t, h, dd), rnd(t, h), rnd(s, dd)
        qp, kp = torch.arange(s - t, s), torch.arange(s)

        def plain_indexer(q=q, w=w, kk=kk, qp=qp, kp=kp):
            dots = torch.einsum("thd,sd->ths", q, kk)
            return (torch.relu(dots) * w[..., None]).sum(1).masked_fill(kp[None] > qp[:, None], float("-inf"))

        yield ("indexer_scores", f"T={t} S={s} H={h} D={dd}", "einsum + relu + sum",
               lambda q=q, w=w, kk=kk, qp=qp, kp=kp: bi.indexer_scores(q, w, kk, qp, kp), plain_indexer)
    heads, c, r = 16, 512, 64
    for t, s, k in ((1, 4096, 512), (1, 8192, 2048), (64, 4096, 512)) if not quick else ((1, 4096, 512),):
        ql, qr, kv, kr = rnd(t, heads, c), rnd(t, heads, r), rnd(s, c), rnd(s, r)
        idx = torch.sort(torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)]), -1).values

        def dense(ql=ql, qr=qr, kv=kv, kr=kr, idx=idx):
            qf = torch.cat([ql, qr], -1)  # [T, H, C+R]
            keys = torch.cat([kv, kr], -1)[idx]  # [T, k, C+R]
            return F.scaled_dot_product_attention(qf, keys, kv[idx], scale=0.1)

        yield ("sparse_mla fp32", f"T={t} S={s} topk={k} H={heads}", "gather + SDPA",
               lambda ql=ql, qr=qr, kv=kv, kr=kr, idx=idx: bi.sparse_mla(ql, qr, kv, kr, idx, 0.1), dense)
    d, inter = 1024, 512
    for e, n in ((8, 256), (64, 1024)) if not quick else ((8, 256),):
        x = rnd(n, d)
        wg, wu, wd = rnd(e, inter, d) / 32, rnd(e, inter, d) / 32, rnd(e, d, inter) / 22
        weights, ids = bi.moe_route(x, rnd(e, d), None, 2)

        def loop(x=x, wg=wg, wu=wu, wd=wd, weights=weights, ids=ids, e=e):
            out = torch.zeros_like(x)
            for ex in range(e):
                tok, slot = (ids == ex).nonzero(as_tuple=True)
                if len(tok):
                    h_ = F.silu(x[tok] @ wg[ex].t()) * (x[tok] @ wu[ex].t())
                    out.index_add_(0, tok, (h_ @ wd[ex].t()) * weights[tok, slot, None])
            return out

        yield ("moe_experts fp32", f"N={n} E={e} top2 D={d} I={inter}", "per-expert torch.mm loop",
               lambda x=x, wg=wg, wu=wu, wd=wd, weights=weights, ids=ids: bi.moe_experts(x, ids, weights, wg, wu, wd),
               loop)


OPS = ("linear", "rms_norm", "log_softmax", "softmax", "topk", "indexer_scores", "sparse_mla", "moe_experts")
"""The op names of the table's rows (what --only matches the start of)."""


def check_args(args: argparse.Namespace) -> None:
    from zmrl.bench import BenchInputError, check_out_file

    if args.threads is not None and args.threads < 1:
        raise BenchInputError(f"--threads must be >= 1, got {args.threads}")
    if args.only is not None and not any(op.startswith(args.only) for op in OPS):
        raise BenchInputError(f"--only {args.only!r} matches no op; the ops: {', '.join(OPS)}")
    check_out_file(args.out)


def run(args: argparse.Namespace) -> None:
    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_time = getattr(args, "cpu_time", False)
    clock = time.process_time if cpu_time else time.perf_counter
    header = (f"{datetime.date.today()} | {platform.processor() or platform.machine()} | "
              f"torch {torch.__version__} | {torch.get_num_threads()} threads | "
              f"{'process CPU time' if cpu_time else 'wall time'}")
    rows = ["| op | shape | baseline | zmrl ms | baseline ms | ratio |", "|---|---|---|---|---|---|"]
    only = getattr(args, "only", None)
    cases = [c for c in _cases(args.quick) if not only or c[0].startswith(only)]
    for op, shape, baseline, ours, theirs in tqdm(cases, desc="kernels", unit="case"):
        t_ours, t_base = _time(ours, clock=clock), _time(theirs, clock=clock)
        rows.append(f"| {op} | {shape} | {baseline} | {t_ours * 1e3:.3f} | {t_base * 1e3:.3f} | {t_base / t_ours:.2f} |")
    checks = _self_check_costs(args.quick, clock) if not only or "linear".startswith(only) else []
    table = "\n".join([header, "", *rows, "", *checks])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")

