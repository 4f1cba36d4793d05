"""Eager forward / forward+backward of one Triton linear vs F.linear, host time and a cProfile
of ten backward steps (H200 run, 2026-11-30).

    python benchmarks/eager_linear_profile.py
"""
import cProfile, pstats, time, torch, os, sys
sys.path.insert(0, os.getcwd())
import zmrl.batch_invariant.triton as tri
bf = torch.bfloat16
x = torch.randn(1024, 4096, device="cuda", dtype=bf, requires_grad=True)
w = (torch.randn(4096, 4096, device="cuda", dtype=bf) * 0.02).requires_grad_()
g = torch.randn(1024, 4096, device="cuda", dtype=bf)
def step():
    x.grad = w.grad = None
    tri.linear(x, w).backward(g)
for _ in range(3): step()
torch.cuda.synchronize()
for name, fn in (("fwd", lambda: tri.linear(x, w)), ("fwd+bwd", step), ("torch fwd+bwd", lambda: (setattr(x, "grad", None), torch.nn.functional.linear(x, w).backward(g)))):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20): fn()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"{name}: host {1e6*(t1-t0)/20:.0f} us/iter, host+gpu {1e6*(t2-t0)/20:.0f} us/iter", flush=True)
pr = cProfile.Profile(); pr.enable()
for _ in range(10): step()
torch.cuda.synchronize(); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
