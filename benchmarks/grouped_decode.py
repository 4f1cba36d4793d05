"""The CPU decode step with and without its grouped GEMMs (zmrl/batch_invariant/cpu_grouped.py).

    python benchmarks/grouped_decode.py [--preset tiny] [--num-requests 8] [--prompt-len 64]
        [--steps 32] [--samples 7]

One process, one model: the same prefill and decode steps (`profile_paged_decode.Rollout`) with
invariance on in three variants (routed experts and canonical leaves each in one bmm, the experts
only, neither: the per-group `linear` calls) and with invariance off (the "torch" path), the four
interleaved sample by sample so that a noisy machine slows them alike. Prints the median time of a
decode step per variant and its ratio to invariance off. Diagnostic: `zmrl bench vllm` gives the
generation figures that count.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from profile_paged_decode import Rollout  # noqa: E402

from zmrl.batch_invariant import cpu_grouped, use_path  # noqa: E402
from zmrl.model.config import ModelConfig  # noqa: E402
from zmrl.model.presets import PRESETS  # noqa: E402


@contextlib.contextmanager
def grouping(leaves: bool, experts: bool):
    """The on path with the leaves' and/or the experts' grouping switched off (the per-group calls)."""
    real_leaves, real_fit = cpu_grouped.leaf_products, vars(cpu_grouped.ExpertTiles)["fit"]  # the classmethod itself
    if not leaves:
        cpu_grouped.leaf_products = lambda xs, weights: None
    if not experts:
        cpu_grouped.ExpertTiles.fit = staticmethod(lambda *args: None)
    try:
        yield
    finally:
        cpu_grouped.leaf_products = real_leaves
        cpu_grouped.ExpertTiles.fit = real_fit


VARIANTS = {
    "experts and leaves grouped": lambda: grouping(True, True),
    "experts grouped only": lambda: grouping(False, True),
    "neither grouped": lambda: grouping(False, False),
    "invariance off": lambda: use_path("torch"),
}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--samples", type=int, default=7)
    args = p.parse_args(argv)
    cfg = ModelConfig(**PRESETS[args.preset])
    roll = Rollout(cfg, args.num_requests, args.prompt_len + args.steps)
    prompts = torch.randint(2, cfg.vocab_size, (args.num_requests * args.prompt_len,),
                            generator=torch.Generator().manual_seed(0))

    def decode_ms() -> float:
        logits = roll.step(prompts, 0, args.prompt_len)
        t0 = time.perf_counter()
        for s in range(args.steps):
            logits = roll.step(logits.argmax(-1), args.prompt_len + s, 1)
        return (time.perf_counter() - t0) / args.steps * 1e3

    decode_ms()  # warm-up: the self-checks run at each shape's first call
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.samples):
        for name, variant in VARIANTS.items():
            with variant():
                times[name].append(decode_ms())
    medians = {name: statistics.median(v) for name, v in times.items()}
    print(f"{args.preset}: {args.num_requests} requests x {args.prompt_len} prompt tokens, {args.steps} decode "
          f"steps, {torch.get_num_threads()} threads, median of {args.samples} interleaved samples")
    for name, ms in medians.items():
        print(f"  {name:28s} {ms:7.2f} ms a decode step   / invariance off {ms / medians['invariance off']:.2f}")
    return medians


if __name__ == "__main__":
    main()
