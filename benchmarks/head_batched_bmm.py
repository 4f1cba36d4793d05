"""The MLA's head-batched products (the absorbed kv_b_proj: heads are the batch of a bmm over views)
read in place through 3-D descriptors, against the same calls with their operands copied first
(how they ran before) and against cuBLAS (torch.bmm), in one run.

    python benchmarks/head_batched_bmm.py [--preset small|k31-layer] [--tokens T] [--rep 200]

Per product and dtype: the time per call eagerly (back-to-back calls, host work included, one
sync at the end) and replayed from a CUDA graph (the GPU work alone), for zmrl in place, zmrl with
copies, and torch.bmm; the in-place ratio against the copies; and whether the two zmrl versions
give the same bits (they must: the same tiles reach the same dot).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import zmrl.batch_invariant.triton as tri  # noqa: E402
from zmrl.bench.train_throughput import bench_config  # noqa: E402

gemm_kernel = importlib.import_module("zmrl.batch_invariant.triton._gemm_kernel")


def products(cfg, t: int, dtype):
    """(name, a, b) as zmrl.model.attention makes them: views of q, o_latent and kv_b_proj."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h, nope, rope, v, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                           cfg.kv_lora_rank)
    q = torch.randn(t, h, nope + rope, device="cuda", generator=g).to(dtype)
    kv_b = (torch.randn(h, nope + v, c, device="cuda", generator=g) * c ** -0.5).to(dtype)
    o_latent = torch.randn(t, h, c, device="cuda", generator=g).to(dtype)
    return [("absorb W_UK", q[..., :nope].transpose(0, 1), kv_b[:, :nope]),
            ("expand W_UV", o_latent.transpose(0, 1), kv_b[:, nope:].transpose(1, 2))]


def eager_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / iters


def graph_us(fn, rep: int) -> float:
    from triton.testing import do_bench_cudagraph

    return 1e3 * do_bench_cudagraph(fn, rep=rep)


def copied(a, b):
    """zmrl's bmm on compact copies of the operands (B kept in its own major order): the copies
    the 2-D descriptors needed, then the same launch."""
    b_compact = b.mT.contiguous().mT if gemm_kernel.b_layout(b) == "k_major" else b.contiguous()
    return tri.bmm(a.contiguous(), b_compact)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--tokens", type=int, default=14788, help="packed tokens (T): the bench batch's by default")
    p.add_argument("--rep", type=int, default=200, help="ms per graph timing")
    p.add_argument("--iters", type=int, default=50, help="eager calls per timing")
    args = p.parse_args()
    cfg = bench_config(args.preset, None, "bfloat16")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; preset {args.preset}, T = {args.tokens}")
    print("product, dtype: eager us per call (zmrl in place / copies / torch.bmm) | graph-replayed us | "
          "in place vs copies (eager, graph) | same bits")
    for dtype in (torch.bfloat16, torch.float32):
        for name, a, b in products(cfg, args.tokens, dtype):
            same = torch.equal(tri.bmm(a, b), copied(a, b))
            times = {}
            for label, fn in (("in place", lambda: tri.bmm(a, b)), ("copies", lambda: copied(a, b)),
                              ("torch", lambda: torch.bmm(a, b))):
                times[label] = (eager_us(fn, args.iters), graph_us(fn, args.rep))
            (ei, gi), (ec, gc), (et, gt) = times["in place"], times["copies"], times["torch"]
            print(f"{name} [{a.shape[0]}x{a.shape[1]}x{a.shape[2]} @ {b.shape[2]}], {str(dtype)[6:]}: "
                  f"{ei:.1f} / {ec:.1f} / {et:.1f} | {gi:.1f} / {gc:.1f} / {gt:.1f} | "
                  f"{ec / ei:.2f}x, {gc / gi:.2f}x | {'EQUAL' if same else 'DIFFERENT BITS'}", flush=True)


if __name__ == "__main__":
    main()
