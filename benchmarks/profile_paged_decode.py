"""Where a rollout step over the paged cache spends its time, invariance on vs off, without vLLM.

    python benchmarks/profile_paged_decode.py [--preset tiny] [--num-requests 8] [--prompt-len 300]
        [--steps 16] [--repeats 3] [--threads N] [--profile on|off] [--rows 30]

Builds a preset model (random weights), prefills --num-requests prompts in one step, then runs
--steps decode steps (one new token per request per step) through `zmrl.rollout.paged.paged_forward`
and the logits, alternating invariance on / off each repeat. Prints wall and CPU (process) time per
prefill and per decode step and their on/off ratios; CPU time is less disturbed than wall time by
other processes on a shared machine. --profile MODE adds a cProfile of MODE's
--phase (decode steps or the prefill) (top
functions by own time). Diagnostic only: `zmrl bench vllm` gives the figures that count.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import time

import torch

from zmrl.batch_invariant import use_path
from zmrl.model.config import ModelConfig
from zmrl.model.layers import final_logits, init_weights
from zmrl.model.packed import split_layer_weights
from zmrl.model.presets import PRESETS
from zmrl.rollout.paged import PagedBatch, entry_dim, paged_forward

BLOCK_SIZE = 16


class Rollout:
    """Requests laid out in contiguous blocks of one cache per layer (block 0: the null block)."""

    def __init__(self, cfg: ModelConfig, num_requests: int, max_len: int):
        self.cfg = cfg
        self.weights = init_weights(cfg, seed=0, dtype=torch.float32)
        self.w_layers = split_layer_weights(cfg, self.weights)
        self.per_req = -(-max_len // BLOCK_SIZE)
        blocks = 1 + num_requests * self.per_req
        self.caches = [torch.zeros(blocks, BLOCK_SIZE, entry_dim(cfg)) for _ in range(cfg.num_hidden_layers)]
        self.table = 1 + torch.arange(num_requests * self.per_req).view(num_requests, self.per_req)
        self.num_requests = num_requests

    def step(self, tokens: torch.Tensor, start: int, new: int) -> torch.Tensor:
        """Every request feeds `new` tokens at positions start..start+new-1 -> logits of its last."""
        r = self.num_requests
        pos = torch.arange(start, start + new).repeat(r)
        req = torch.arange(r).repeat_interleave(new)
        slots = self.table[req, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        batch = PagedBatch(query_start_loc=torch.arange(r + 1) * new, seq_lens=torch.full((r,), start + new),
                           block_table=self.table, slot_mapping=slots, positions=pos, max_seq_len=start + new)
        with torch.inference_mode():
            hidden = paged_forward(self.cfg, self.weights, self.w_layers, self.caches, batch, tokens)
            return final_logits(self.cfg, self.weights, hidden[new - 1::new])


def _mode(mode: str):
    return contextlib.nullcontext() if mode == "on" else use_path("torch")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--profile", choices=["on", "off"])
    p.add_argument("--phase", choices=["prefill", "decode"], default="decode", help="what --profile covers")
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(**PRESETS[args.preset])
    roll = Rollout(cfg, args.num_requests, args.prompt_len + args.steps)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, cfg.vocab_size, (args.num_requests * args.prompt_len,), generator=gen)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}

    def run(mode: str, profiler: cProfile.Profile | None = None) -> None:
        with _mode(mode):
            if profiler and args.phase == "prefill":
                profiler.enable()
            w0, c0 = time.perf_counter(), time.process_time()
            logits = roll.step(prompts, 0, args.prompt_len)
            times.setdefault((mode, "prefill"), []).append((time.perf_counter() - w0, time.process_time() - c0))
            if profiler:
                profiler.enable() if args.phase == "decode" else profiler.disable()
            w0, c0 = time.perf_counter(), time.process_time()
            for s in range(args.steps):
                logits = roll.step(logits.argmax(-1), args.prompt_len + s, 1)
            times.setdefault((mode, "decode"), []).append(
                ((time.perf_counter() - w0) / args.steps, (time.process_time() - c0) / args.steps))
            if profiler:
                profiler.disable()

    run("on")  # warm-up: the CPU GEMM self-checks run at first use of each shape
    times.clear()
    for rep in range(args.repeats):
        for mode in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            run(mode)
    print(f"{args.preset}: {args.num_requests} requests x {args.prompt_len} prompt tokens, {args.steps} decode steps, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    for phase in ("prefill", "decode"):
        on = [statistics.median(t[i] for t in times[("on", phase)]) for i in (0, 1)]
        off = [statistics.median(t[i] for t in times[("off", phase)]) for i in (0, 1)]
        print(f"  {phase:8s} wall on {on[0] * 1e3:8.2f} ms off {off[0] * 1e3:8.2f} ms (on/off time {on[0] / off[0]:.2f})"
              f" | cpu on {on[1] * 1e3:8.2f} ms off {off[1] * 1e3:8.2f} ms (on/off time {on[1] / off[1]:.2f})")
    if args.profile:
        prof = cProfile.Profile()
        run(args.profile, prof)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(args.sort).print_stats(args.rows)
        print(out.getvalue())


if __name__ == "__main__":
    main()
