"""Routed experts with LoRA on every expert: the grouped Triton path vs the per-expert loop, same run.

    python benchmarks/moe_lora.py                      # small preset's MoE dims, then one K3.1 layer
    python benchmarks/moe_lora.py --preset small --tokens 4096 --rank 32

For each preset: random bf16 expert weights (frozen) with rank-r LoRA factors on gate_up_proj
and down_proj of every expert (trainable), uniform random top-k routing, and per path the time
of `expert_slot_outputs` forward and forward + backward (dx and the factors' gradients), in
tokens/s; the ratio grouped / loop; the grouped forward compared bit for bit with the loop's; and
the grouped path's GEMM throughput as a fraction of the bf16 dense peak (--peak-tflops, H200: 989).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.getcwd())

from zmrl.batch_invariant import set_path  # noqa: E402
from zmrl.lora.adapter import LoraProjections  # noqa: E402
from zmrl.model.mlp import expert_slot_outputs  # noqa: E402
from zmrl.model.presets import PRESETS  # noqa: E402


class _Adapter:
    def __init__(self, pairs, scale):
        self.pairs, self.lcfg = pairs, SimpleNamespace(scale=scale)

    def pair(self, layer, name):
        return self.pairs.get(name)


class _Looped(LoraProjections):
    def grouped_experts(self, w):
        return None  # the per-expert expert_linear loop


def _setup(preset: str, tokens: int, rank: int, seed: int = 0):
    p = PRESETS[preset]
    e, k, d, i = p["n_routed_experts"], p["num_experts_per_tok"], p["hidden_size"], p["moe_intermediate_size"]
    torch.manual_seed(seed)
    dev, bf = ("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16

    def rnd(*shape, scale):
        return torch.empty(*shape, device=dev, dtype=bf).normal_(0, scale)

    w = {"mlp.experts.gate_up_proj": rnd(e, 2 * i, d, scale=d ** -0.5),
         "mlp.experts.down_proj": rnd(e, d, i, scale=i ** -0.5)}
    pairs = {"mlp.experts.gate_up_proj": (rnd(e, rank, d, scale=d ** -0.5).requires_grad_(),
                                          rnd(e, 2 * i, rank, scale=0.02).requires_grad_()),
             "mlp.experts.down_proj": (rnd(e, rank, i, scale=i ** -0.5).requires_grad_(),
                                       rnd(e, d, rank, scale=0.02).requires_grad_())}
    x = rnd(tokens, d, scale=1.0).requires_grad_()
    ids = torch.rand(tokens, e, device=dev).topk(k, dim=1).indices.sort(dim=1).values
    cfg = SimpleNamespace(moe_intermediate_size=i, n_routed_experts=e)
    grad = torch.randn(tokens, k, d, device=dev) * 1e-3
    return SimpleNamespace(cfg=cfg, w=w, pairs=pairs, x=x, ids=ids, grad=grad, dims=(e, k, d, i), scale=2.0)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, iters):
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t0) / iters


def _device_name() -> str:
    # without a GPU (a smoke run under TRITON_INTERPRET=1, --preset tiny) the Triton path is forced
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, Triton interpreter"


def bench(preset: str, tokens: int, rank: int, iters: int, loop_iters: int, peak_tflops: float) -> None:
    s = _setup(preset, tokens, rank)
    e, k, d, i = s.dims
    ad = _Adapter(s.pairs, s.scale)
    paths = {"grouped": LoraProjections(ad, 0), "loop": _Looped(ad, 0)}
    print(f"== {preset}: {e} experts top-{k}, hidden {d}, moe_intermediate {i}, rank-{rank} LoRA on every "
          f"expert, {tokens} tokens ({tokens * k} rows), bf16, {_device_name()}", flush=True)
    outs, res, grads = {}, {}, {}
    for name, proj in paths.items():
        n = iters if name == "grouped" else loop_iters

        def fwd():
            with torch.no_grad():
                return expert_slot_outputs(s.cfg, s.w, s.x, s.ids, proj)

        def fwd_bwd():
            s.x.grad = None
            for a, b in s.pairs.values():
                a.grad = b.grad = None
            expert_slot_outputs(s.cfg, s.w, s.x, s.ids, proj).backward(s.grad)

        outs[name] = fwd()
        res[name] = (_timed(fwd, n), _timed(fwd_bwd, n))
        grads[name] = [s.x.grad] + [t.grad for pair in s.pairs.values() for t in pair]
        print(f"{name:8s} forward {res[name][0] * 1e3:9.2f} ms  {tokens / res[name][0]:12.0f} tok/s   "
              f"fwd+bwd {res[name][1] * 1e3:9.2f} ms  {tokens / res[name][1]:12.0f} tok/s", flush=True)
    same = torch.equal(outs["grouped"], outs["loop"])
    print(f"grouped / loop speed: forward {res['loop'][0] / res['grouped'][0]:.1f}x, "
          f"fwd+bwd {res['loop'][1] / res['grouped'][1]:.1f}x; forward bitwise equal: {same}")
    rel = [float((g.double() - h.double()).norm() / h.double().norm().clamp_min(1e-30))
           for g, h in zip(grads["grouped"], grads["loop"])]
    print("gradients, grouped vs loop (relative norm of the difference; not bitwise by design): "
          + ", ".join(f"{n} {r:.1e}" for n, r in zip(["x", "A_gate_up", "B_gate_up", "A_down", "B_down"], rel)))
    rows = tokens * k
    base = 6 * d * i  # gate, up, down: 2 * (2I * D + D * I) flops per row
    lora = 2 * rank * (d + 2 * i) + 2 * rank * (i + d)
    fwd_flops = rows * (base + lora)
    bwd_flops = rows * (base + 2 * lora)  # dx and dh through the frozen weights, factor grads + inputs
    runs = (("forward", res["grouped"][0], fwd_flops), ("fwd+bwd", res["grouped"][1], fwd_flops + bwd_flops))
    for label, t, fl in runs:
        tf = fl / t / 1e12
        print(f"grouped {label}: {tf:.1f} TFLOP/s = {100 * tf / peak_tflops:.1f}% of the {peak_tflops:.0f} TFLOP/s "
              "bf16 peak")
    del s, outs, grads
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=[*PRESETS, "both"], default="both", help="both: small, then k31-layer")
    ap.add_argument("--tokens", type=int, default=None, help="default: 4096 (small and k31-layer)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--loop-iters", type=int, default=None, help="default: --iters (small), 2 (k31-layer)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        set_path("triton")
    for preset in (["small", "k31-layer"] if a.preset == "both" else [a.preset]):
        big = preset == "k31-layer"
        bench(preset, a.tokens or 4096, a.rank, a.iters if not big else min(a.iters, 3),
              a.loop_iters or (2 if big else a.iters), a.peak_tflops)


if __name__ == "__main__":
    main()
