"""Where a trainer step spends its time: torch.profiler over one Megatron train step and one
log-prob pass of a `zmrl bench train` preset model (after a warm-up), the top ops by host (self
CPU) time and by device time, and the number of kernel launches.

    python benchmarks/profile_train_step.py [--preset small] [--layers N] [--num-seqs 32]
        [--mode on|off] [--rows 25] [--trace out.json] [--python]

`--python` adds cProfile's view of the same calls: the Python functions by self time, which names
the host work torch.profiler shows only as time between launches.

Diagnostic only: `zmrl bench train` gives the figures that count (ratios against a baseline).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from zmrl.bench.train_throughput import DEFAULT_RANK, bench_config, make_batch, random_weights
from zmrl.lora import LoraConfig
from zmrl.trainer.base import TrainBatch, UpdateSettings
from zmrl.trainer.megatron import MegatronTrainer


def print_python_profile(name: str, fn, sync, rows: int) -> None:
    """cProfile one more call of `fn`: the Python functions by self time, then by cumulative time."""
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    fn()
    sync()
    profiler.disable()
    print(f"\n## {name}: Python functions (cProfile, {time.perf_counter() - t0:.3f} s wall under it)")
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int)
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--mode", default="on", choices=["on", "off"], help="batch invariance on or off")
    p.add_argument("--rows", type=int, default=25, help="rows per table")
    p.add_argument("--trace", help="also write a Chrome trace of the train step here")
    p.add_argument("--python", action="store_true", help="also profile the Python functions (cProfile)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dtype_name = "bfloat16" if cuda else "float32"
    cfg = bench_config(args.preset, args.layers, dtype_name)
    weights, _ = random_weights(cfg, getattr(torch, dtype_name), 0)
    prompts, completions = make_batch(cfg, args.num_seqs, 290, 170, 0)
    rank = DEFAULT_RANK.get(args.preset, 8)
    trainer = MegatronTrainer(cfg, weights, LoraConfig(r=rank, lora_alpha=2.0 * rank), seed=0)
    trainer.invariant = args.mode == "on"
    old = trainer.logprobs(prompts, completions, temperature=1.0)
    batch = TrainBatch(prompts=prompts, completions=completions, old_logprobs=old,
                       advantages=torch.randn(len(prompts), generator=torch.Generator().manual_seed(1)))
    settings = UpdateSettings(lr=1e-6, num_minibatches=2, temperature=1.0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    trainer.train_step(batch, settings, 0)  # warm-up: compilation, autotuning, self-checks
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, fn in (("train step", lambda: trainer.train_step(batch, settings, 1)),
                     ("log-probs", lambda: trainer.logprobs(prompts, completions, temperature=1.0))):
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            fn()
            sync()
        wall = time.perf_counter() - t0
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        print(f"\n## {name} (invariance {args.mode}, preset {args.preset}): {wall:.3f} s wall under the profiler, "
              f"{launches} kernel launches")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        if cuda:
            print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        if args.trace and name == "train step":
            prof.export_chrome_trace(args.trace)
        if args.python:
            print_python_profile(name, fn, sync, args.rows)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
