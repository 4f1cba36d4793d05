"""Run a function on N ranks of a fresh torch.distributed group (gloo on CPU; NCCL when asked and
there are N GPUs; gloo with CUDA tensors lets the ranks share GPUs: rank r uses GPU r modulo the
visible ones) and collect what each rank returns. For tests of cross-rank arithmetic.

    results = run_ranks(fn, world=2, args=(...,))    # fn(shards, *args) -> picklable; one result per rank

`fn` must be importable by name (a module-level function of a test module or of zmrl).
"""
from __future__ import annotations

import os
import socket
import tempfile

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, backend: str, fn, args, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    from zmrl.batch_invariant.collectives import Shards

    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(Shards(world, rank, dist.group.WORLD), *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, args: tuple = (), backend: str = "gloo") -> list:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(world, _free_port(), backend, fn, args, tmp), nprocs=world,
                           join=True, start_method="spawn")
        return [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(world)]
