"""The grouped expert kernels' launches, one call kind at a time, per warps / stages / tile shape.

    python benchmarks/grouped_launches.py [--preset small] [--tokens 14336] [--rank 8] [--sweep]
    python benchmarks/grouped_launches.py --preset k31-layer --experts 128 --tokens 1170 --rank 32

`--experts` routes over fewer experts than the preset has: a launch's speed follows the rows per
expert (tokens x top-k / experts) and the dims, and a K3.1 layer's 896 experts (78 GiB of bf16
weights) do not fit an 80 GB card beside the activations; 128 experts at 1,170 tokens give its
146 rows per expert of 8,192 tokens.

Builds a preset's routed experts (random bf16 weights, uniform random top-k routing, rank-r LoRA
factors on gate_up and down) and runs each grouped launch of a LoRA MoE layer's forward and
backward (zmrl/batch_invariant/triton/moe_lora.py) as the layer runs it. For each call kind it
prints the time of the launch as zmrl makes it ("current": grouped._warps_stages' and
grouped._program_order's choices; timed again after the other variants, "current again"), the
time of cuBLAS's dense GEMM with the same rows, columns and K in the same run (a roofline, not an
equivalent: the grouped GEMM also reads each row's expert), the time of the same launch with its
programs in each order forced (grouped.PROGRAM_ORDER), and with --sweep the fastest of the swept
variants: BLOCK_M 64 / 128 (the schedule's row tile), BLOCK_N 64 / 128, 4 / 8 warps, 3 / 4 stages.
BLOCK_K, the K order, is never swept: every variant's output is compared with the current launch's
(torch.equal) and printed as equal or DIFFERS. Times are graph-replayed (do_bench_cudagraph).

Needs a CUDA GPU (a Triton launch per variant; the interpreter would take hours at these sizes).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from zmrl.batch_invariant.triton import grouped  # noqa: E402
from zmrl.batch_invariant.triton._gemm_config import MMConfig  # noqa: E402
from zmrl.batch_invariant.triton.moe import Groups  # noqa: E402
from zmrl.model.presets import PRESETS  # noqa: E402

HEAVY_LAUNCHES = ((4, 4), (8, 4), (8, 3), (4, 3))  # (warps, stages)
LIGHT_LAUNCHES = ((4, 4), (8, 4), (4, 3))
ORDERS = {name: getattr(grouped, name) for name in ("COLUMN_TILE_MAJOR", "ROW_TILE_MAJOR", "EXPERT_MAJOR")}


def _layer(preset: str, tokens: int, rank: int, experts: int | None = None, seed: int = 0) -> dict:
    p = PRESETS[preset]
    e, k, d, i = p["n_routed_experts"], p["num_experts_per_tok"], p["hidden_size"], p["moe_intermediate_size"]
    e = experts or e
    if e < k:
        raise SystemExit(f"--experts {e}: fewer than the preset's top-{k}")
    torch.manual_seed(seed)
    bf = torch.bfloat16

    def rnd(*shape, s=0.02):
        return (torch.randn(*shape, device="cuda") * s).to(bf)

    ids = torch.randn(tokens, e, device="cuda").topk(k, dim=1).indices.sort(dim=1).values
    return dict(e=e, k=k, d=d, i=i, r=rank, ids=ids, x=rnd(tokens, d, s=1.0), gate_up=rnd(e, 2 * i, d),
                down=rnd(e, d, i), a_gu=rnd(e, rank, d), b_gu=rnd(e, 2 * i, rank), a_d=rnd(e, rank, i),
                b_d=rnd(e, d, rank), dy=rnd(tokens * k, d, s=1.0), scale=2.0)


def _calls(L: dict, groups: Groups) -> list[tuple[str, tuple[int, int, int], object]]:
    """(name, (rows, N, K) of the dense roofline, fn(groups)) for every grouped launch of a LoRA
    MoE layer's forward and backward, fed with the outputs of the launches before it."""
    rf, rb = grouped.rows_forward, grouped.rows_backward
    i, r, d, s = L["i"], L["r"], L["d"], L["scale"]
    xs = L["x"][groups.src_rows]
    rows = xs.shape[0]
    wg, wu = L["gate_up"][:, :i], L["gate_up"][:, i:]
    t1 = rf(xs, L["a_gu"], groups)
    d1 = rf(t1, L["b_gu"], groups)
    h, gu = rf(xs, wg, groups, w2=wu, delta=d1[:, :i], delta2=d1[:, i:], scale=s, store_gu=True)
    t2 = rf(h, L["a_d"], groups)
    d2 = rf(t2, L["b_d"], groups)
    dy = L["dy"]
    dt2 = rb(dy, L["b_d"], groups, alpha=s)
    dgu = rb(dy, L["down"], groups, a2=dt2, w2=L["a_d"], gu=gu)
    dt1 = rb(dgu, L["b_gu"], groups, alpha=s)
    return [
        ("fwd t1 = x A_gu", (rows, 2 * r, d), lambda g: rf(xs, L["a_gu"], g)),
        ("fwd d1 = t1 B_gu", (rows, 2 * i, r), lambda g: rf(t1, L["b_gu"], g)),
        ("fwd gated, deltas joined", (rows, 2 * i, d),
         lambda g: rf(xs, wg, g, w2=wu, delta=d1[:, :i], delta2=d1[:, i:], scale=s)),
        ("fwd gated, g u kept", (rows, 2 * i, d),
         lambda g: rf(xs, wg, g, w2=wu, delta=d1[:, :i], delta2=d1[:, i:], scale=s, store_gu=True)[0]),
        ("fwd t2 = h A_d", (rows, r, i), lambda g: rf(h, L["a_d"], g)),
        ("fwd d2 = t2 B_d", (rows, d, r), lambda g: rf(t2, L["b_d"], g)),
        ("fwd y, delta joined", (rows, d, i), lambda g: rf(h, L["down"], g, delta=d2, scale=s)),
        ("bwd dt2", (rows, r, d), lambda g: rb(dy, L["b_d"], g, alpha=s)),
        ("bwd dh, silu's backward", (rows, i, d), lambda g: rb(dy, L["down"], g, a2=dt2, w2=L["a_d"], gu=gu)),
        ("bwd dt1", (rows, r, 2 * i), lambda g: rb(dgu, L["b_gu"], g, alpha=s)),
        ("bwd dx (fp32)", (rows, d, 2 * i),
         lambda g: rb(dgu, L["gate_up"], g, a2=dt1, w2=L["a_gu"], out_dtype=torch.float32)),
    ]


@contextlib.contextmanager
def _patched(**values):
    """grouped's module attributes set to these values inside the block, restored after it."""
    saved = {name: getattr(grouped, name) for name in values}
    for name, value in values.items():
        setattr(grouped, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(grouped, name, value)


def _launch(block_n: int, warps: int, stages: int):
    """Every grouped launch inside the block at this BLOCK_N, warps and stages (BLOCK_K unchanged)."""
    config_for = grouped.config_for

    def variant(n, k, dtype):
        base = config_for(n, k, dtype)
        return MMConfig(base.block_m, block_n, base.block_k, num_warps=warps, num_stages=stages)

    return _patched(config_for=variant, _warps_stages=lambda base, bm, bn, live: (warps, stages))


def _with(patch, fn, groups: Groups):
    """fn(groups) run inside `patch` (a fresh context manager per call)."""
    with patch():
        return fn(groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=14336, help="tokens routed (the small preset's log-prob pass: 14,336)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--experts", type=int, help="route over this many experts (default: the preset's)")
    ap.add_argument("--sweep", action="store_true", help="also sweep BLOCK_M, BLOCK_N, warps and stages")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("grouped_launches.py needs a CUDA GPU")
    from triton.testing import do_bench_cudagraph

    def bench(fn):
        return do_bench_cudagraph(fn, rep=25) * 1e3  # us

    L = _layer(args.preset, args.tokens, args.rank, args.experts)
    row_tile = grouped.config_for(L["i"], L["d"], torch.bfloat16).block_m  # the schedule moe_lora.py builds
    groups = {bm: Groups(L["ids"], L["e"], bm) for bm in (64, 128)}
    groups.setdefault(row_tile, Groups(L["ids"], L["e"], row_tile))
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | preset {args.preset}: {args.tokens} tokens "
          f"x top-{L['k']} = {args.tokens * L['k']} rows, {L['e']} experts, D {L['d']}, I {L['i']}, rank {L['r']}, "
          f"bf16; the layer's row tile {row_tile}; 'current': grouped._program_order's order")
    print("| launch | cuBLAS dense (us) | current (us) | dense / current | "
          + " | ".join(f"{o.lower().replace('_', '-')} (us) | bits" for o in ORDERS)
          + " | current again (us) | best swept (us) | best: BM, BN, warps, stages | bits |")
    print("|---|---|---|---|" + "---|---|" * len(ORDERS) + "---|---|---|---|")
    for name, (m, n, k), fn in _calls(L, groups[row_tile]):
        g = groups[row_tile]
        ref = fn(g)
        a, b = torch.randn(m, k, device="cuda").bfloat16(), torch.randn(k, n, device="cuda").bfloat16()
        t_dense, t_cur = bench(lambda: a @ b), bench(lambda: fn(g))
        by_order = ""
        for o in ORDERS:
            order = functools.partial(_patched, PROGRAM_ORDER=ORDERS[o])
            bits = "equal" if torch.equal(_with(order, fn, g), ref) else "**DIFFERS**"
            by_order += f"{bench(lambda: _with(order, fn, g)):.1f} | {bits} | "
        # the current launch once more, after the variants: how far a reading moves within one row
        by_order += f"{bench(lambda: fn(g)):.1f} | "
        swept = "|  |  |  |"
        if args.sweep:
            heavy = min(n, k) > 64
            results, differing = [], 0
            for bm, bn, (w, s) in itertools.product((64, 128), (64, 128) if heavy else (128,),
                                                    HEAVY_LAUNCHES if heavy else LIGHT_LAUNCHES):
                launch = functools.partial(_launch, bn, w, s)
                differing += not torch.equal(_with(launch, fn, groups[bm]), ref)
                results.append((bench(lambda: _with(launch, fn, groups[bm])), bm, bn, w, s))
            t, bm, bn, w, s = min(results)
            bits = "all equal" if not differing else f"**{differing} of {len(results)} DIFFER**"
            swept = f"| {t:.1f} | {bm}, {bn}, {w}, {s} | {bits} |"
        print(f"| {name} | {t_dense:.1f} | {t_cur:.1f} | {t_dense / t_cur:.2f} | {by_order}{swept[2:]}",
              flush=True)


if __name__ == "__main__":
    main()
