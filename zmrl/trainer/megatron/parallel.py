"""Process groups: torch.distributed (gloo on CPU, NCCL on CUDA) and megatron's parallel_state.

Layout: TP ranks split attention heads and the dense/shared MLPs as Megatron does (column- then
row-parallel), and the same ranks own whole routed experts (EP = TP, expert TP = 1), so an
expert's GEMMs have the same shapes at every TP size. PP = CP = 1 and DP = 1: world size = TP.

One process group per process: `init_parallel` reuses an initialized torch.distributed (e.g. one
that in-process vLLM created, world size 1) and an initialized parallel_state of the same shape.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from zmrl.model.config import ModelConfig
from zmrl.model.sharding import check_divisible  # noqa: F401  (the trainer's TP-size check; hosts share it)
from zmrl.trainer.megatron.compat import import_megatron


@dataclass(frozen=True)
class Parallel:
    tp: int
    """Tensor-parallel size (= expert-parallel size)."""
    rank: int
    """This process's rank in the TP group (= its EP rank)."""


def init_parallel(cfg: ModelConfig, tp: int = 1, backend: str | None = None) -> Parallel:
    """Initialize (or reuse) the process groups for TP = EP = tp. Single-process runs need no
    launcher; multi-process runs read RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun's).
    backend: "nccl" (CUDA) or "gloo" (CPU); None: nccl when CUDA is available."""
    check_divisible(cfg, tp)
    mcore = import_megatron()
    ps = mcore.parallel_state
    dist = torch.distributed
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if world == 1:
            # a private in-memory store: no port to pick, nothing to clash with another job
            store = dist.HashStore()
            kw = dict(store=store, rank=0, world_size=1)
        else:
            kw = dict(init_method="env://", rank=rank, world_size=world)
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend, **kw)
    world = dist.get_world_size()
    if world != tp:
        raise ValueError(f"world size {world} != tensor_parallel={tp}: the megatron trainer runs TP only "
                         f"(one process per TP rank; data/pipeline parallelism are not implemented)")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != (tp, tp):
            raise ValueError(f"megatron parallel_state is already initialized with (TP, EP) = {have}, "
                             f"not ({tp}, {tp})")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=tp,
                                     expert_tensor_parallel_size=1)
    return Parallel(tp=tp, rank=ps.get_tensor_model_parallel_rank())


def tp_group():
    return import_megatron().parallel_state.get_tensor_model_parallel_group()
