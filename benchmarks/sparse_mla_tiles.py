"""Sparse-MLA forward tile configs on one GPU: time and whether each gives the default's bits.

    python benchmarks/sparse_mla_tiles.py [--shapes small-tp1,small-tp2,k31-tp1,k31-tp8]

Packed prefill (each query selects at most `topk` earlier tokens of its own sequence), bf16. For
each shape: the default config (`_config`), then candidates of 16- and 64-head tiles, each with its
time (`triton.testing.do_bench`, ms) and "== default" / "!= default" (bits of out and lse). A tile
height must not follow the heads a rank holds unless every height gives the same bits: this shows
whether they do. Diagnostic; the kernel's choice is documented in triton/sparse_mla.py.
"""
from __future__ import annotations

import argparse
import importlib

import torch
import triton

mla = importlib.import_module("zmrl.batch_invariant.triton.sparse_mla")

# name: heads on the rank, latent width, rope width, top-k, sequence lengths
SHAPES = {
    "small-tp1": (16, 256, 32, 256, [460] * 32),
    "small-tp2": (8, 256, 32, 256, [460] * 32),
    "k31-tp1": (96, 512, 0, 2048, [4096]),
    "k31-tp8": (12, 512, 0, 2048, [4096]),
}
CANDIDATES = [dict(BLOCK_H=16, BLOCK_CV=128, BLOCK_CK=64, num_warps=4, num_stages=1),
              dict(BLOCK_H=16, BLOCK_CV=256, BLOCK_CK=64, num_warps=4, num_stages=1),
              dict(BLOCK_H=16, BLOCK_CV=256, BLOCK_CK=64, num_warps=8, num_stages=1),
              dict(BLOCK_H=16, BLOCK_CV=256, BLOCK_CK=64, num_warps=4, num_stages=2),
              dict(BLOCK_H=64, BLOCK_CV=128, BLOCK_CK=64, num_warps=8, num_stages=2),
              dict(BLOCK_H=64, BLOCK_CV=256, BLOCK_CK=64, num_warps=8, num_stages=1)]


def packed_indices(lengths: list[int], topk: int) -> torch.Tensor:
    """[T, topk] int64: query i of a sequence selects all of its first i + 1 tokens while they fit,
    else a random ascending `topk` of them; -1 pads."""
    rows, start = [], 0
    for length in lengths:
        for i in range(length):
            n = i + 1
            if n <= topk:
                rows.append(torch.cat([torch.arange(start, start + n), torch.full((topk - n,), -1)]))
            else:
                rows.append(torch.rand(n).topk(topk).indices.sort().values + start)
        start += length
    return torch.stack(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    for name in args.shapes.split(","):
        heads, c, r, topk, lengths = SHAPES[name]
        torch.manual_seed(0)
        idx = packed_indices(lengths, topk).cuda()
        t = idx.shape[0]
        bf = dict(device="cuda", dtype=torch.bfloat16)
        ql, kv = torch.randn(t, heads, c, **bf), torch.randn(t, c, **bf)
        qr, kr = (torch.randn(t, heads, r, **bf), torch.randn(t, r, **bf)) if r else (None, None)
        scale = (c + r) ** -0.5
        default = mla.sparse_mla_forward(ql, qr, kv, kr, idx, scale, 64)
        print(f"## {name}: T={t} heads={heads} C={c} R={r} topk={topk}; default {mla._config(heads, c, torch.bfloat16)}")
        for cfg in [None, *CANDIDATES]:
            if cfg is not None and cfg["BLOCK_CV"] > c:
                continue
            out = mla.sparse_mla_forward(ql, qr, kv, kr, idx, scale, 64, cfg)
            same = torch.equal(out[0], default[0]) and torch.equal(out[1], default[1])
            ms = triton.testing.do_bench(lambda: mla.sparse_mla_forward(ql, qr, kv, kr, idx, scale, 64, cfg),
                                         warmup=5, rep=30)
            print(f"{'default' if cfg is None else cfg}: {ms:.3f} ms, {'==' if same else '!='} default", flush=True)


if __name__ == "__main__":
    main()
