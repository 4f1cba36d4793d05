"""Packed attention (one indexer / top-k / sparse-MLA call for all sequences) vs a call per sequence.

    python benchmarks/packed_attention.py [--preset tiny] [--num-seqs 32] [--len 96] [--repeats 3]

Same inputs, same process, alternating the two forms; prints the median seconds of a forward
and of a forward + backward per form and their ratio (per-sequence time / packed time), and
checks the outputs are bitwise equal. Runs on the current device (CUDA if visible).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from zmrl.model.attention import CacheView, mla_attend, mla_attend_packed, mla_project  # noqa: E402
from zmrl.model.config import ModelConfig  # noqa: E402
from zmrl.model.layers import init_weights  # noqa: E402
from zmrl.model.presets import PRESETS  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--len", type=int, default=96, help="mean sequence length (+-25%%)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = ModelConfig(**{**PRESETS[args.preset], "num_hidden_layers": 2})
    w = {k[len("model.layers.1."):]: v.to(dev, dtype) for k, v in init_weights(cfg, seed=0).items()
         if k.startswith("model.layers.1.")}
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(int(args.len * 0.75), int(args.len * 1.25) + 1, (args.num_seqs,), generator=g).tolist()
    cu = torch.tensor([0, *lengths]).cumsum(0)
    x = torch.randn(sum(lengths), cfg.hidden_size, generator=g).to(dev, dtype)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(dev)

    def run(packed: bool, backward: bool):
        xi = x.detach().requires_grad_(backward)
        query, new = mla_project(cfg, w, xi, pos)
        if packed:
            out = mla_attend_packed(cfg, query, new, cu)
        else:
            outs = []
            for b in range(len(lengths)):
                r = slice(int(cu[b]), int(cu[b + 1]))
                view = CacheView(new.latents[r], None if new.rope_keys is None else new.rope_keys[r],
                                 new.index_keys[r], pos[r])
                outs.append(mla_attend(cfg, query.rows(r), view))
            out = torch.cat(outs)
        if backward:
            out.float().sum().backward()
            return xi.grad
        return out

    def timed(fn):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    print(f"{args.preset} dims, {dev}, {dtype}, {args.num_seqs} sequences, {sum(lengths)} tokens, "
          f"load average {os.getloadavg()[0]:.2f}")
    for backward in (False, True):
        with torch.set_grad_enabled(backward):
            run(True, backward), run(False, backward)  # warm-up
            times = {True: [], False: []}
            for _ in range(args.repeats):
                for packed in (False, True):
                    t, out = timed(lambda: run(packed, backward))
                    times[packed].append(t)
                    if packed:
                        same = torch.equal(out, ref)
                    else:
                        ref = out
            loop, one = statistics.median(times[False]), statistics.median(times[True])
            what = "forward + backward (input grad)" if backward else "forward"
            print(f"{what}: per sequence {loop:.3f} s, packed {one:.3f} s, ratio {loop / one:.2f}x, "
                  f"bitwise equal: {same}")


if __name__ == "__main__":
    main()
