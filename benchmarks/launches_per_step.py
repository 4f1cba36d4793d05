"""Where a trainer step's host time goes, by zmrl function: kernel launches and cProfile.

    python benchmarks/launches_per_step.py [--preset small] [--rows 45]

Builds a `zmrl bench train` preset model (bf16 on CUDA; fp32, 4 short sequences on a CPU), warms up,
times two unprofiled train steps and log-prob passes, then for one of each prints cProfile's top
functions (own time, and zmrl's by cumulative time) and the kernel launches attributed to the
innermost zmrl function on the stack: every aten op that launches work (views and allocations left
out) plus every Triton launch (through `kernel[grid]` or a launch plan). A step that is host-bound
spends its time in the functions that launch most. Diagnostic; `zmrl bench train` gives the figures
that count.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import time
import traceback

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from zmrl.batch_invariant.triton import _launch
from zmrl.bench.train_throughput import DEFAULT_RANK, bench_config, make_batch, random_weights
from zmrl.lora import LoraConfig
from zmrl.trainer.base import TrainBatch, UpdateSettings
from zmrl.trainer.megatron import MegatronTrainer

NO_LAUNCH = {"view", "t", "detach", "_unsafe_view", "slice", "select", "transpose", "unsqueeze", "expand", "split",
             "split_with_sizes", "as_strided", "empty", "alias", "squeeze", "chunk", "permute", "empty_like",
             "empty_strided", "unbind", "reshape", "_reshape_alias", "lift_fresh", "is_nonzero",
             "_local_scalar_dense"}
_launches: collections.Counter = collections.Counter()
_counting = False


def _where() -> str:
    """The innermost zmrl (or torch.optim) frame of the caller."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/zmrl/" in frame.filename:
            return frame.filename.split("/zmrl/")[-1] + ":" + frame.name
        if "torch/optim" in frame.filename:
            return frame.filename.split("/")[-1] + ":" + frame.name
    return "(autograd engine / other)"


class _CountOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in NO_LAUNCH:
            _launches[(_where(), func.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _count_triton_launches() -> None:
    plan_launch, jit_run = _launch.DirectKernel.launch, triton.runtime.jit.JITFunction.run

    def planned(self, *a, **k):
        if _counting:
            _launches[(_where(), "triton (plan)")] += 1
        return plan_launch(self, *a, **k)

    def jitted(self, *a, **k):
        if _counting:
            _launches[(_where(), "triton:" + self.fn.__name__)] += 1
        return jit_run(self, *a, **k)

    _launch.DirectKernel.launch, triton.runtime.jit.JITFunction.run = planned, jitted


def main() -> None:
    global _counting
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--rows", type=int, default=45, help="rows per table")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dtype_name = "bfloat16" if cuda else "float32"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = bench_config(args.preset, None, dtype_name)
    weights, _ = random_weights(cfg, getattr(torch, dtype_name), 0)
    prompts, completions = make_batch(cfg, 32 if cuda else 4, 290 if cuda else 40, 170 if cuda else 20, 0)
    rank = DEFAULT_RANK.get(args.preset, 8)
    trainer = MegatronTrainer(cfg, weights, LoraConfig(r=rank, lora_alpha=2.0 * rank), seed=0)
    old = trainer.logprobs(prompts, completions, temperature=1.0)
    batch = TrainBatch(prompts=prompts, completions=completions, old_logprobs=old,
                       advantages=torch.randn(len(prompts), generator=torch.Generator().manual_seed(1)))
    settings = UpdateSettings(lr=1e-6, num_minibatches=2, temperature=1.0)
    trainer.train_step(batch, settings, 0)  # warm-up: compilation, self-checks
    sync()
    passes = (("train step", lambda: trainer.train_step(batch, settings, 1)),
              ("log-probs", lambda: trainer.logprobs(prompts, completions, temperature=1.0)))
    for _ in range(2):
        for name, fn in passes:
            t0 = time.perf_counter()
            fn()
            sync()
            print(f"{name}: {time.perf_counter() - t0:.3f} s unprofiled")
    _count_triton_launches()
    for name, fn in passes:
        prof = cProfile.Profile()
        prof.enable()
        fn()
        sync()
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(args.rows)
        stats.sort_stats("cumtime").print_stats("zmrl", args.rows)
        print(f"\n## cProfile, {name}\n" + "\n".join(line for line in text.getvalue().splitlines() if line.strip()))
        _launches.clear()
        _counting = True
        with _CountOps():
            fn()
        _counting = False
        sync()
        by_function: collections.Counter = collections.Counter()
        for (where, _), n in _launches.items():
            by_function[where] += n
        print(f"\n## kernel launches, {name}: {sum(_launches.values())}")
        for where, n in by_function.most_common(args.rows):
            print(f"{n:7d}  {where}")
        print("-- by function and op")
        for (where, op), n in _launches.most_common(args.rows):
            print(f"{n:7d}  {where}  {op}")


if __name__ == "__main__":
    main()
