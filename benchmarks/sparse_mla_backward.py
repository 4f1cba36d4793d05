"""Sparse MLA over head leaves on one GPU: the forward as one launch for every head vs a launch per
head leaf, and forward + backward with the Triton backward kernels vs the torch backward they
replaced (gathers, einsums and a sorted index_put_ per block of query rows), and the key gradients
by the key-major kernel over sorted pairs vs the sequence-tiled kernel (a packing given), in one run.

    python benchmarks/sparse_mla_backward.py                  # small and k31-layer dims, bf16
    python benchmarks/sparse_mla_backward.py --dims small --repeats 5
    TRITON_INTERPRET=1 python benchmarks/sparse_mla_backward.py --smoke   # tiny dims on a CPU

Inputs as a trainer's packed batch: sequences end to end, each query's index list its own
sequence's tokens up to itself (random top-k, ascending, -1 padded), the latents and rope keys
fanned out per leaf by zmrl.batch_invariant.collectives.fan_out (as zmrl.model.attention does).
Prints the median milliseconds (CUDA events, eager: the old backward syncs on the host) and
ratio = old / new (above 1 the new path is faster); checks that the forward bits are equal and
reports the old and new gradients' relative difference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import zmrl.batch_invariant.triton as tri  # noqa: E402
from zmrl.batch_invariant import Packing  # noqa: E402
from zmrl.batch_invariant.collectives import fan_out, num_leaves  # noqa: E402
from zmrl.batch_invariant.triton.sparse_mla import sparse_mla_forward  # noqa: E402
from zmrl.model.presets import PRESETS  # noqa: E402

DIMS = {  # name -> (preset, packed sequence lengths)
    "small": ("small", [456 + (i * 37) % 61 - 30 for i in range(32)]),  # ~14.6k tokens in 32 sequences
    "k31-layer": ("k31-layer", [4096, 4096]),
}


# ----------------------------------------------------------------------------- the replaced backward
def _torch_backward_block(q, qr, kv, kr, idx, out, lse, d_out, d_lse, scale):
    valid = idx >= 0
    g = kv[idx.clamp(min=0)].float()
    s = torch.einsum("thc,tkc->thk", q.float(), g)
    gr = None
    if qr is not None:
        gr = kr[idx.clamp(min=0)].float()
        s = s + torch.einsum("thr,tkr->thk", qr.float(), gr)
    s = (s * scale).masked_fill(~valid[:, None, :], float("-inf"))
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, 0.0)[..., None]).masked_fill(~valid[:, None, :], 0.0)
    p = p * finite[..., None]
    do = d_out.float()
    dp = torch.einsum("thc,tkc->thk", do, g)
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True) + d_lse.float()[..., None])
    dq = torch.einsum("thk,tkc->thc", ds, g) * scale
    dkv = torch.einsum("thk,thc->tkc", ds, q.float()) * scale + torch.einsum("thk,thc->tkc", p, do)
    dqr = dkr = None
    if qr is not None:
        dqr = torch.einsum("thk,tkr->thr", ds, gr) * scale
        dkr = torch.einsum("thk,thr->tkr", ds, qr.float()) * scale
    return dq, dqr, dkv, dkr


class _OldSparseMla(torch.autograd.Function):
    """The previous Triton-forward / torch-backward autograd function, one call per head leaf."""

    @staticmethod
    def forward(ctx, q, qr, kv, kr, idx, scale):
        out, lse = sparse_mla_forward(q, qr, kv, kr, idx, scale, 64)
        ctx.save_for_backward(q, qr, kv, kr, idx, out, lse)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, qr, kv, kr, idx, out, lse = ctx.saved_tensors
        d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
        block = max(1, (1 << 26) // (max(idx.shape[1], 1) * max(q.shape[2], q.shape[1])))
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dqr = torch.empty(qr.shape, dtype=torch.float32, device=q.device) if qr is not None else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        dkr = torch.zeros(kr.shape, dtype=torch.float32, device=q.device) if kr is not None else None
        for start in range(0, q.shape[0], block):
            sl = slice(start, start + block)
            rows = idx[sl]
            gq, gqr, gkv, gkr = _torch_backward_block(q[sl], qr[sl] if qr is not None else None, kv, kr, rows,
                                                      out[sl], lse[sl], d_out[sl], d_lse[sl], ctx.scale)
            dq[sl] = gq
            valid = rows >= 0
            dkv.index_put_((rows[valid],), gkv[valid], accumulate=True)
            if qr is not None:
                dqr[sl] = gqr
                dkr.index_put_((rows[valid],), gkr[valid], accumulate=True)
        return (dq.to(q.dtype), dqr.to(qr.dtype) if qr is not None else None, dkv.to(kv.dtype),
                dkr.to(kr.dtype) if kr is not None else None, None, None)


def old_attention(ql, qr, kv, kr, idx, scale, leaves, forward_only=False):
    """A call per head leaf (what zmrl.model.attention ran before): -> (out, lse)."""
    kvs = fan_out(kv, leaves)
    krs = [None] * leaves if kr is None else fan_out(kr, leaves)
    qls = [q.contiguous() for q in ql.chunk(leaves, 1)]
    qrs = [None] * leaves if qr is None else [q.contiguous() for q in qr.chunk(leaves, 1)]
    if forward_only:
        parts = [sparse_mla_forward(*a, idx, scale, 64) for a in zip(qls, qrs, kvs, krs)]
    else:
        parts = [_OldSparseMla.apply(*a, idx, scale) for a in zip(qls, qrs, kvs, krs)]
    return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 1)


def new_attention(ql, qr, kv, kr, idx, scale, leaves, packing=None):
    return tri.sparse_mla_leaves(ql, qr, fan_out(kv, leaves), None if kr is None else fan_out(kr, leaves), idx, scale,
                                 packing=packing)


# ----------------------------------------------------------------------------- inputs and timing
def packed_indices(lengths, width, device, seed=0):
    """[T, width]: each query's own sequence's tokens up to itself, a random top-`width`, ascending."""
    g = torch.Generator(device=device).manual_seed(seed)
    big = torch.iinfo(torch.int64).max
    rows, start = [], 0
    for n in lengths:
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        scores = torch.rand(n, n, generator=g, device=device).masked_fill(~causal, -1.0)
        k = min(width, n)
        top = scores.topk(k, -1)
        picked = torch.where(top.values >= 0, top.indices + start, big).sort(-1).values
        picked = torch.where(picked == big, -1, picked)
        rows.append(torch.cat([picked, picked.new_full((n, width - k), -1)], 1))
        start += n
    return torch.cat(rows)


def median_ms(fn, repeats: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel_diff(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run(name, heads, c, r, width, lengths, scale, dtype, device, repeats, old=True):
    t = sum(lengths)
    packing = Packing.from_bounds([sum(lengths[:i]) for i in range(len(lengths) + 1)], device)
    leaves = num_leaves(heads)
    g = torch.Generator().manual_seed(0)
    ql = torch.randn(t, heads, c, generator=g).to(device, dtype)
    qr = torch.randn(t, heads, r, generator=g).to(device, dtype) if r else None
    kv = torch.randn(t, c, generator=g).to(device, dtype)
    kr = torch.randn(t, r, generator=g).to(device, dtype) if r else None
    idx = packed_indices(lengths, width, device)
    d_out = torch.randn(t, heads, c, generator=g).to(device, dtype)
    print(f"\n{name}: T={t} in {len(lengths)} sequences, H={heads} in {leaves} leaves, C={c}, R={r}, "
          f"top-k={width}, {str(dtype).split('.')[-1]}", flush=True)

    with torch.no_grad():
        old_out, old_lse = old_attention(ql, qr, kv, kr, idx, scale, leaves, forward_only=True)
        new_out, new_lse = new_attention(ql, qr, kv, kr, idx, scale, leaves)
    same = torch.equal(old_out, new_out) and torch.equal(old_lse, new_lse)
    print(f"  forward bits equal (out and lse, all heads at once vs a call per leaf): {same}", flush=True)
    with torch.no_grad():
        t_old = median_ms(lambda: old_attention(ql, qr, kv, kr, idx, scale, leaves, forward_only=True), repeats)
        t_new = median_ms(lambda: new_attention(ql, qr, kv, kr, idx, scale, leaves), repeats)
    print(f"  forward           per leaf {t_old:9.2f} ms   all heads {t_new:9.2f} ms   ratio {t_old / t_new:6.2f}",
          flush=True)

    inputs = [x for x in (ql, qr, kv, kr) if x is not None]

    def step(attend):
        leaf_inputs = [x.detach().requires_grad_() for x in inputs]
        args = leaf_inputs if r else [leaf_inputs[0], None, leaf_inputs[1], None]
        out, _ = attend(*args, idx, scale, leaves)
        return torch.autograd.grad(out, leaf_inputs, d_out)

    def tiled_attention(*args):
        return new_attention(*args, packing=packing)

    names = ("dq", "dq_rope", "dkv", "dk_rope") if r else ("dq", "dkv")
    new_grads, tiled_grads = step(new_attention), step(tiled_attention)
    if old:
        old_grads = step(old_attention)
        diffs = ", ".join(f"{n} {rel_diff(a, b):.1e}" for n, a, b in zip(names, new_grads, old_grads))
        print(f"  gradients, new vs old, relative difference: {diffs}", flush=True)
        del old_grads
    diffs = ", ".join(f"{n} {rel_diff(a, b):.1e}" for n, a, b in zip(names, tiled_grads, new_grads))
    print(f"  gradients, sequence-tiled key kernel vs key-major pairs, relative difference: {diffs}", flush=True)
    del new_grads, tiled_grads
    t_new = median_ms(lambda: step(new_attention), repeats)
    if old:
        t_old = median_ms(lambda: step(old_attention), repeats)
        print(f"  forward+backward  torch bwd {t_old:9.2f} ms   Triton bwd {t_new:9.2f} ms   "
              f"ratio {t_old / t_new:6.2f}", flush=True)
    t_tiled = median_ms(lambda: step(tiled_attention), repeats)
    print(f"  forward+backward  key-major pairs {t_new:9.2f} ms   sequence-tiled {t_tiled:9.2f} ms   "
          f"ratio {t_new / t_tiled:6.2f}", flush=True)
    return same


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", nargs="*", default=list(DIMS), choices=list(DIMS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny dims (runs under TRITON_INTERPRET=1 on a CPU)")
    ap.add_argument("--skip-old", action="store_true", help="leave out the torch backward (slow at k31 dims)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    if device == "cuda":
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {when}")
    ok = True
    if args.smoke:
        ok &= run("smoke", 16, 32, 16, 8, [9, 1, 14], 0.1, dtype, device, 1, not args.skip_old)
    else:
        for name in args.dims:
            preset, lengths = DIMS[name]
            p = PRESETS[preset]
            scale = (p["qk_nope_head_dim"] + p["qk_rope_head_dim"]) ** -0.5
            ok &= run(name, p["num_attention_heads"], p["kv_lora_rank"], p["qk_rope_head_dim"], p["index_topk"],
                      lengths, scale, dtype, device, args.repeats, not args.skip_old)
    if not ok:
        raise SystemExit("the forward bits differ between one launch for all heads and a launch per leaf")


if __name__ == "__main__":
    main()
