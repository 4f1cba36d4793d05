"""Host time per call of zmrl.batch_invariant.linear vs F.linear vs torch.mm, eager, on a GPU.

    python benchmarks/linear_host_overhead.py [--calls 200] [--quick]
    python benchmarks/linear_host_overhead.py --cpu-stub   # no GPU: the Python share alone

Host time per call = wall time of `--calls` back-to-back calls without any synchronization,
divided by the count (the GPU runs behind; the queue never fills at this count): what an eager
trainer pays before a GEMM's kernel even starts. GPU time per call = triton.testing.do_bench.
For every shape, dtype and M it prints:

    zmrl host | zmrl host with Triton's own launch (the direct launch and plans switched off,
    i.e. the path before launch plans) | F.linear host | torch.mm host | ratio zmrl / F.linear
    (target <= 1.5) | GPU us of zmrl, F.linear | bits: the planned call equals the first call

then a forward+backward (autograd) row per shape at M = 256, a cProfile of the planned call,
and the Triton launch status ("direct" or why not).

--cpu-stub runs on a machine without a GPU: CPU tensors take the planned path of a CUDA call
with Triton's C launcher and the tensor-map encoder replaced by no-ops, so it measures what the
planned call costs in Python and torch dispatch (plan key and lookup, the output's allocation,
the kept split-K workspace), i.e. everything but the launches themselves. It calls the Triton
entry point that the public `linear` hands a CUDA tensor to after one cheap test (a CPU tensor
would take the public function's CPU-side probes and checks instead). The stand-in
compiled kernels look to the plan machinery as Triton 3.6's do (the GEMM's launcher wrapped for
its descriptors, the split-K sum's not), so a shape whose kernels would get no plan says so.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())

import zmrl.batch_invariant as bi  # noqa: E402

mm = importlib.import_module("zmrl.batch_invariant.triton.matmul")
launch = importlib.import_module("zmrl.batch_invariant.triton._launch")
gemm_plan = importlib.import_module("zmrl.batch_invariant.triton._gemm_plan")
workspace = importlib.import_module("zmrl.batch_invariant.triton._workspace")

SHAPES = [(4096, 4096), (1536, 7168), (576, 7168), (24576, 1536), (32000, 4096)]  # (N, K)
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def host_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / calls


def gpu_us(fn) -> float:
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=10, rep=40)


def with_plans(enabled: bool) -> None:
    launch.ENABLED = enabled
    gemm_plan.clear()


def cpu_stub(calls: int) -> None:
    import functools
    import types

    ln = launch
    mm.check_runnable = lambda name, t: None
    gemm_plan.current_stream = lambda dev: 0
    gemm_plan.Plan.usable = lambda self: True
    workspace._may_keep = lambda device: True  # as a CUDA call outside a capture: the kept split-K workspace
    meta = [dict(elem_type=10, block_size=[16, 64], swizzle=3, elem_size=2, fp4_padded=False)] * 3
    c_launcher = functools.partial(lambda *a: None)  # Triton's C launcher is a builtin: no __code__

    def wrap(launcher):  # Triton wraps the C launcher to expand descriptors only for kernels that take one
        def inner(*args):
            return launcher(*args)
        return inner

    def compiled(descriptors: bool):
        run = types.SimpleNamespace(launch=wrap(c_launcher) if descriptors else c_launcher, global_scratch_size=0,
                                    profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False)
        # Triton 3.6: a kernel without descriptor arguments has tensordesc_meta == []
        return types.SimpleNamespace(run=run, metadata=types.SimpleNamespace(tensordesc_meta=meta if descriptors else []),
                                     function=0, packed_metadata=(4, 1, 0))

    gemm_kernel, sum_kernel = compiled(True), compiled(False)

    def tensor_map(self, i, ptr, shape, strides):  # the cache lookup as in DirectKernel, no encoder
        key = (ptr, shape, strides, self.desc_keys[i])
        tmap = ln._TMAPS.get(key)
        if tmap is None:
            tmap = ln._TMAPS[key] = object()
        return [tmap, *shape, *strides]

    ln.DirectKernel.tensor_map = tensor_map

    def launched_for(m: int, n: int, k: int, splits: int) -> gemm_plan.Launched:
        return gemm_plan.Launched(
            direct=True, main=gemm_kernel, total=sum_kernel if splits > 1 else None, device_index=0, splits=splits,
            progs=132, ints=(m, n, k, k, n, 1, m * n, n), consts=tuple(range(12)), pad_to=0,
            a_desc=((m, k), (k, 1)), b_desc=((n, k), (k, 1)), c_desc=((splits, m, n), (m * n, n, 1)),
            out_shape=(1, m, n))

    print(f"# --cpu-stub: planned zmrl.batch_invariant.linear with the launch stubbed, host us per call "
          f"over {calls * 10} calls, torch {torch.__version__}, {os.cpu_count()} CPUs")
    for n, k in SHAPES:
        for m in (1, 16, 256):
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(m, k).to(dtype)
                w = torch.randn(n, k).to(dtype)
                splits = mm.config_for(n, k, dtype).split_k
                key = mm._linear_key(x, w, None)
                gemm_plan.remember(key, launched_for(m, n, k, splits), dtype, x.device)
                if gemm_plan.PLANS[key] is None:
                    print(f"  {str(dtype)[6:]:>8} N={n:>6} K={k:>5} M={m:>4} split={splits}: NO PLAN (full path): "
                          f"{launch.direct_launch_status()}", flush=True)
                    continue
                with torch.no_grad(), bi.use_path("triton"):
                    t = host_cpu(lambda: mm.linear(x, w), calls * 10)
                    e = host_cpu(lambda: torch.empty((m, n), dtype=dtype), calls * 10)
                print(f"  {str(dtype)[6:]:>8} N={n:>6} K={k:>5} M={m:>4} split={splits}: linear {t:6.1f} us "
                      f"(of which the output's allocation ~{e:.1f} us)", flush=True)
    # the split-K plan's extra Python (the kept workspace's lookup, a second launch) against an unsplit
    # plan for the very same call, interleaved so that the shared machine's drift hits both
    n, k, bf16 = 1536, 7168, torch.bfloat16
    w = torch.randn(n, k).to(bf16)
    print(f"# N={n} K={k} bf16: split-K plan (4 splits) vs an unsplit plan for the same call, best of 5 interleaved rounds")
    for m in (1, 16, 256):
        x = torch.randn(m, k).to(bf16)
        key = mm._linear_key(x, w, None)
        plans = {}
        for splits in (4, 1):
            gemm_plan.remember(key, launched_for(m, n, k, splits), bf16, x.device)
            plans[splits] = gemm_plan.PLANS[key]
        if plans[4] is None:
            print(f"  M={m:>4}: NO PLAN for the split-K call (full path): {launch.direct_launch_status()}")
            continue
        best = {4: float("inf"), 1: float("inf")}
        with torch.no_grad(), bi.use_path("triton"):
            for _ in range(5):
                for splits in (4, 1):
                    gemm_plan.PLANS[key] = plans[splits]
                    best[splits] = min(best[splits], host_cpu(lambda: mm.linear(x, w), calls * 10))
        print(f"  M={m:>4}: split-K {best[4]:5.1f} us, unsplit {best[1]:5.1f} us, ratio {best[4] / best[1]:4.2f}",
              flush=True)
    gemm_plan.clear()
    x, w = torch.randn(16, 7168).to(torch.bfloat16), torch.randn(1536, 7168).to(torch.bfloat16)
    gemm_plan.remember(mm._linear_key(x, w, None), launched_for(16, 1536, 7168, 4), torch.bfloat16, x.device)
    print("# cProfile of the planned split-K call, N=1536 K=7168 M=16 bf16")
    prof = cProfile.Profile()
    with torch.no_grad(), bi.use_path("triton"):
        prof.enable()
        for _ in range(calls * 10):
            mm.linear(x, w)
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    print(buf.getvalue())


def host_cpu(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(3):  # best of three: the machine may be shared
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return 1e6 * best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="bf16 only, M in 1, 16, 256")
    ap.add_argument("--cpu-stub", action="store_true", help="no GPU: the planned call with the launch stubbed")
    args = ap.parse_args()
    if args.cpu_stub:
        cpu_stub(args.calls)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{importlib.import_module('triton').__version__}; host us per call over {args.calls} unsynchronized calls")
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float32]
    ms = (1, 16, 256) if args.quick else MS
    ratios = []
    print(f"{'dtype':>5} {'N':>6} {'K':>5} {'M':>4} | {'zmrl':>7} {'old':>7} {'F.lin':>7} {'mm':>7} | "
          f"{'zmrl/F.linear':>13} | {'gpu zmrl':>8} {'gpu F':>8} | bits")
    with torch.no_grad():
        for dtype in dtypes:
            for n, k in SHAPES:
                w = (torch.randn(n, k, device=dev) * k ** -0.5).to(dtype)
                for m in ms:
                    x = torch.randn(m, k, device=dev).to(dtype)
                    with_plans(False)
                    first = bi.linear(x, w)  # compiles; runs the ladder's self-check once for the shape
                    old = host_us(lambda: bi.linear(x, w), args.calls)
                    with_plans(True)
                    bi.linear(x, w)  # makes the plan
                    zmrl = host_us(lambda: bi.linear(x, w), args.calls)
                    same = torch.equal(bi.linear(x.clone(), w), first)
                    fl = host_us(lambda: F.linear(x, w), args.calls)
                    tm = host_us(lambda: torch.mm(x, w.t()), args.calls)
                    gz, gf = gpu_us(lambda: bi.linear(x, w)), gpu_us(lambda: F.linear(x, w))
                    ratios.append(zmrl / fl)
                    print(f"{str(dtype)[6:]:>5} {n:>6} {k:>5} {m:>4} | {zmrl:7.1f} {old:7.1f} {fl:7.1f} {tm:7.1f} | "
                          f"{zmrl / fl:13.2f} | {gz:8.1f} {gf:8.1f} | {'equal' if same else 'DIFFER'}", flush=True)
        print(f"# zmrl/F.linear host ratio: max {max(ratios):.2f}, median {sorted(ratios)[len(ratios) // 2]:.2f} "
              f"(target <= 1.5); {sum(r <= 1.5 for r in ratios)}/{len(ratios)} rows meet it")
    print(f"# launch status: {launch.direct_launch_status()}")

    # forward + backward with autograd (what an eager trainer step runs per linear)
    print("\n# forward+backward host us per call (autograd), bf16, M = 256")
    for n, k in SHAPES:
        w = (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16).requires_grad_()
        x = torch.randn(256, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(256, n, device=dev, dtype=torch.bfloat16)
        z = host_us(lambda: bi.linear(x, w).backward(g), max(20, args.calls // 4))
        t = host_us(lambda: F.linear(x, w).backward(g), max(20, args.calls // 4))
        print(f"  N={n:>6} K={k:>5}: zmrl {z:8.1f}  F.linear {t:8.1f}  ratio {z / t:5.2f}", flush=True)

    # where the planned call's remaining host time goes
    n, k = SHAPES[1]
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    x = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        bi.linear(x, w)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            bi.linear(x, w)
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    print(f"\n# cProfile of 2000 planned calls, N={n} K={k} M=16 bf16 (profiler overhead inflates the totals)")
    print(buf.getvalue())


if __name__ == "__main__":
    main()
