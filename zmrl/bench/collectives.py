"""The cost of zmrl's canonical cross-rank reductions against an ordinary all-reduce, in one run.

    python -m zmrl.bench.collectives [--world 2] [--tokens 256] [--dims 1024,2048] [--leaves SHAPES]

Spawns `world` ranks (gloo on CPU; NCCL with one GPU per rank on CUDA) and times, on the same inputs:
  reduce    a [T, D] fp32 sum across ranks: canonical (all-gather of the ranks' subtrees, then the
            tree) vs torch.distributed.all_reduce;
  row       a row-parallel linear forward [T, D] x [D, D] (this rank's D / world input columns):
            one GEMM per canonical leaf + tree vs one local GEMM + all_reduce (Megatron's);
  column    a column-parallel linear forward + backward (the input gradient is the cross-rank sum).
Prints median ms per call (the two forms alternate call by call, so a drifting machine load weighs
on both alike) and ratio = ordinary / canonical (1.0 = as fast; below 1 = the canonical form is
slower) for each shape.

--leaves T:OUTxIN,... (or "default") also times, in this one process, what every host pays at TP = 1:
a row- or column-parallel GEMM run as its canonical leaves (8 GEMMs over IN/8 columns + the fp32
tree, or 8 GEMMs over OUT/8 rows) against one zmrl.batch_invariant.linear over the whole dimension,
same inputs, same run (ratio = one linear / leaves). --world 0 runs only that part.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch


REPEATS = 15


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _interleaved(fns: dict, barrier=None, repeats: int = REPEATS) -> dict[str, float]:
    """name -> median seconds per call. The candidates alternate call by call (after one warm-up
    call each), so a load that drifts during the run weighs on every candidate alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if barrier is not None:
                barrier()
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _bench(shards, tokens: int, dims: list[int]) -> list[dict]:
    import torch.distributed as dist

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
            def ordinary_fn(fn=fn):
                with ordinary_all_reduce():
                    fn()

            times = _interleaved({"canonical": fn, "ordinary": ordinary_fn},
                                 barrier=lambda: dist.barrier(group=shards.group))
            canonical, ordinary = times["canonical"], times["ordinary"]
            rows.append({"op": name, "T": tokens, "D": d, "canonical_ms": canonical * 1e3,
                         "ordinary_ms": ordinary * 1e3, "ratio": ordinary / canonical})
    return rows


LEAF_SHAPES = "256:1024x1024,256:1024x2048,256:1536x384,256:2048x1024,64:7168x12288"
"""T:OUTxIN: the small preset's o_proj, dense down_proj, q_b_proj and dense gate_proj, and K3.1's o_proj."""


def _leaf_bench(shapes: str) -> list[dict]:
    from zmrl.batch_invariant import linear
    from zmrl.batch_invariant.collectives import LOCAL, column_linear, num_leaves, row_linear

    dev = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    rows = []
    for spec in shapes.split(","):
        tokens, dims = spec.split(":")
        out_f, in_f = (int(v) for v in dims.split("x"))
        x = torch.randn(int(tokens), in_f, generator=gen).to(dev)
        w = (torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5).to(dev)
        times = _interleaved({"one": lambda: linear(x, w),
                              "row": lambda: row_linear(x, w, num_leaves(in_f), LOCAL),
                              "col": lambda: column_linear(x, w, num_leaves(out_f), LOCAL)})
        rows.append({"T": int(tokens), "OUT": out_f, "IN": in_f, "one_ms": times["one"] * 1e3,
                     "row_ms": times["row"] * 1e3, "col_ms": times["col"] * 1e3,
                     "row_ratio": times["one"] / times["row"], "col_ratio": times["one"] / times["col"]})
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--dims", default="1024,2048")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (and for --leaves)")
    p.add_argument("--leaves", default=None, help=f'T:OUTxIN,... or "default" ({LEAF_SHAPES})')
    args = p.parse_args(argv)
    if args.world < 0 or (args.world == 0 and not args.leaves):
        p.error("--world must be >= 1 (or 0 with --leaves)")
    if torch.cuda.is_available() and args.world > torch.cuda.device_count():
        p.error(f"NCCL needs one GPU per rank: --world {args.world}, {torch.cuda.device_count()} visible GPU(s)")
    if args.world:
        _ranks_table(args)
    if args.leaves:
        torch.set_num_threads(args.threads)
        rows = _leaf_bench(LEAF_SHAPES if args.leaves == "default" else args.leaves)
        where = (f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available()
                 else f"cpu, {args.threads} thread(s)")
        print(f"\none process, {where}, fp32, median of {REPEATS}; ratio = one linear's time / the leaves' "
              f"time (below 1 = the canonical leaves are slower)")
        print("| T | OUT | IN | one linear ms | row: 8 leaves + tree ms | ratio | column: 8 leaves ms | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['T']} | {r['OUT']} | {r['IN']} | {r['one_ms']:.2f} | {r['row_ms']:.2f} | "
                  f"{r['row_ratio']:.2f} | {r['col_ms']:.2f} | {r['col_ratio']:.2f} |")
    return 0


def _ranks_table(args) -> None:
    import torch.multiprocessing as mp

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
    print(f"world {args.world} ({backend}), fp32, median of {REPEATS}; "
          f"ratio = ordinary all-reduce time / canonical time")
    print("| op | T | D | canonical ms | ordinary ms | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['T']} | {r['D']} | {r['canonical_ms']:.2f} | {r['ordinary_ms']:.2f} | {r['ratio']:.2f} |")


if __name__ == "__main__":
    raise SystemExit(main())
