"""The cost of zmrl's canonical cross-rank reductions against an ordinary all-reduce, in one run.

    python -m zmrl.bench.collectives [--world 2] [--tokens 256] [--dims 1024,2048]

Spawns `world` ranks (gloo on CPU; NCCL with one GPU per rank on CUDA) and times, on the same inputs:
  reduce    a [T, D] fp32 sum across ranks: canonical (all-gather of the ranks' subtrees, then the
            tree) vs torch.distributed.all_reduce;
  row       a row-parallel linear forward [T, D] x [D, D] (this rank's D / world input columns):
            one GEMM per canonical leaf + tree vs one local GEMM + all_reduce (Megatron's);
  column    a column-parallel linear forward + backward (the input gradient is the cross-rank sum).
Prints median ms per call and ratio = ordinary / canonical (1.0 = as fast; below 1 = the canonical
form is slower) for each shape.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch


def _time(fn, shards, repeats: int = 7) -> float:
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group=shards.group)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bench(shards, tokens: int, dims: list[int]) -> list[dict]:
    from zmrl.batch_invariant.collectives import column_linear, num_leaves, ordinary_all_reduce, reduce_across, \
        row_linear

    dev = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    rows = []
    for d in dims:
        local = d // shards.size
        x = torch.randn(tokens, d, generator=gen).to(dev)
        w = torch.randn(d, d, generator=gen).to(dev) * d ** -0.5
        x_local, w_row, w_col = x[:, :local].contiguous(), w[:, :local].contiguous(), w[:local].contiguous()
        leaves = num_leaves(d)

        def column_fwd_bwd():
            xi = x.clone().requires_grad_()
            column_linear(xi, w_col, leaves, shards).sum().backward()

        cases = {
            "reduce": lambda: reduce_across([x], shards),
            "row": lambda: row_linear(x_local, w_row, leaves, shards),
            "column fwd+bwd": column_fwd_bwd,
        }
        for name, fn in cases.items():
            canonical = _time(fn, shards)
            with ordinary_all_reduce():
                ordinary = _time(fn, shards)
            rows.append({"op": name, "T": tokens, "D": d, "canonical_ms": canonical * 1e3,
                         "ordinary_ms": ordinary * 1e3, "ratio": ordinary / canonical})
    return rows


def _rank(rank: int, world: int, port: int, tokens: int, dims: list[int], threads: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from zmrl.batch_invariant.collectives import Shards

    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    rows = _bench(Shards(world, rank, dist.group.WORLD), tokens, dims)
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--dims", default="1024,2048")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    dims = [int(d) for d in args.dims.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(args.world, port, args.tokens, dims, args.threads, out), nprocs=args.world,
                           join=True, start_method="spawn")
        rows = torch.load(out)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    print(f"world {args.world} ({backend}), fp32, median of 7; ratio = ordinary all-reduce time / canonical time")
    print("| op | T | D | canonical ms | ordinary ms | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['T']} | {r['D']} | {r['canonical_ms']:.2f} | {r['ordinary_ms']:.2f} | {r['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
