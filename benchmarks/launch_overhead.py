"""Host time per call of the Triton GEMM path vs a raw Triton launch and F.linear (H200 run, 2026-11-30).

    python benchmarks/launch_overhead.py

Prints microseconds of host (Python + launch) time per call, averaged over 200 calls; the GPU is
far from saturated, so these are the costs eager code pays per GEMM, whatever the shape.
"""
import time, torch, os, sys, importlib
sys.path.insert(0, os.getcwd())
mm = importlib.import_module("zmrl.batch_invariant.triton.matmul")
kern = importlib.import_module("zmrl.batch_invariant.triton._gemm_kernel")
from zmrl.batch_invariant.triton._common import make_desc
bf = torch.bfloat16
a = torch.randn(1024, 4096, device="cuda", dtype=bf); w = torch.randn(4096, 4096, device="cuda", dtype=bf)
b = w.t()[None]; cfg = mm.config_for(4096, 4096, bf)
out = torch.empty(1, 1024, 4096, device="cuda", dtype=bf)
ad = make_desc(a, [cfg.block_m, cfg.block_k]); bd = make_desc(w, [cfg.block_n, cfg.block_k]); cd = make_desc(out, [1, cfg.block_m, cfg.block_n])
kw = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, NUM_PROGS=132, B_KMAJOR=True, HAS_BIAS=False,
          PRECISION=None, UPCAST=False, FLATTEN=cfg.flatten, TMA_STORE=True, SPLIT_K=1, SPLIT_INLINE=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
def raw(): return kern._mm_kernel[(132,)](ad, bd, cd, out, out, 1024, 4096, 4096, 4096, 4096, 1, out.stride(0), out.stride(1), **kw)
ck = raw()
def host(name, fn, n=200):
    fn(); torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter(); torch.cuda.synchronize()
    print(f"{name}: {1e6*(t1-t0)/n:.1f} us host/call", flush=True)
host("gemm()", lambda: mm.gemm(a[None], b))
host("_select", lambda: mm._select(1024, 4096, 4096, bf, a.device, "k_major", b))
host("3x make_desc", lambda: (make_desc(a, [128, 64]), make_desc(w, [256, 64]), make_desc(out, [1, 128, 256])))
host("raw kernel[grid](...)", raw)
host("torch.empty", lambda: torch.empty(1, 1024, 4096, device="cuda", dtype=bf))
host("F.linear", lambda: torch.nn.functional.linear(a, w))
print(type(ck), [m for m in dir(ck) if not m.startswith("__")][:40])
