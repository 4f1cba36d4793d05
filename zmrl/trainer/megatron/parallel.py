"""Process groups: torch.distributed (gloo on CPU, NCCL on CUDA) and megatron's parallel_state.

Layout: TP ranks split attention heads and the dense MLP as Megatron does (column- then
row-parallel); EP ranks own whole routed experts (expert TP = 1), so an expert's GEMMs have the
same shapes at every size. TP and EP are independent powers of two dividing 8, so one divides the
other and the world is max(TP, EP) processes: Megatron's initialize_model_parallel (0.16.1, order
tp-cp-ep-dp-pp) then makes the dense part data-parallel over world / TP replicas and the experts
over world / EP replicas. Here every replica computes the same batch (there is no data
parallelism): a replica is a copy, never a partial sum, so nothing is reduced over it.
Global rank r has TP rank r % TP and EP rank r % EP. PP = CP = 1.

Backends: NCCL needs one GPU per rank. gloo runs on CPU, and on CUDA it lets several ranks share
one GPU (zmrl.batch_invariant.collectives stages CUDA tensors through host memory on gloo).

One process group per process: `init_parallel` reuses an initialized torch.distributed (e.g. one
that in-process vLLM created, world size 1, or one a launcher made) and an initialized
parallel_state of the same shape. A group it opened itself it also closes, when the process exits.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch

from zmrl.model import sharding
from zmrl.model.config import ModelConfig
from zmrl.trainer.megatron.compat import import_megatron

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class Parallel:
    tp: int
    """Tensor-parallel size."""
    rank: int
    """This process's rank in its TP group."""
    ep: int
    """Expert-parallel size."""
    ep_rank: int
    """This process's rank in its EP group."""

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)


def check_divisible(cfg: ModelConfig, tp: int, ep: int | None = None) -> None:
    """The trainer's sizes, checked before any process group or module exists: TP over the heads,
    the dense MLP and the vocabulary, EP (None: EP = TP) over the routed experts' canonical leaves
    (zmrl.model.sharding.check_divisible, which the rollout's TP check shares)."""
    sharding.check_divisible(cfg, tp, ep=tp if ep is None else ep)


def init_parallel(cfg: ModelConfig, tp: int = 1, ep: int | None = None, backend: str | None = None) -> Parallel:
    """Initialize (or reuse) the process groups for TP = tp and EP = ep (None: EP = TP) over
    max(tp, ep) processes. Single-process runs need no launcher; multi-process runs read
    RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (torchrun's). backend: "nccl" (CUDA, one GPU
    per rank) or "gloo" (CPU; or CUDA ranks sharing GPUs); None: nccl when CUDA is available.
    The CUDA device (NCCL and gloo alike) is LOCAL_RANK modulo the visible GPUs."""
    ep = tp if ep is None else ep
    check_divisible(cfg, tp, ep)
    want = max(tp, ep)
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
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
        if torch.cuda.is_available():
            set_rank_device(int(os.environ.get("LOCAL_RANK", rank)), world, backend)
        dist.init_process_group(backend, **kw)
        # the group is this process's to close: NCCL warns at exit about (and may leak) a group
        # left open, and a launcher that closes it first leaves nothing for this to do
        atexit.register(_close_own_group)
    world = dist.get_world_size()
    if world != want:
        raise ValueError(f"world size {world} != max(tensor_parallel={tp}, expert_parallel={ep}) = {want}: the "
                         f"megatron trainer runs one process per rank of the larger of the two (data and "
                         f"pipeline parallelism are not implemented)")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != (tp, ep):
            raise ValueError(f"megatron parallel_state is already initialized with (TP, EP) = {have}, "
                             f"not ({tp}, {ep})")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1)
    par = Parallel(tp=tp, rank=ps.get_tensor_model_parallel_rank(), ep=ep,
                   ep_rank=ps.get_expert_model_parallel_rank())
    me = dist.get_rank()
    if (par.rank, par.ep_rank) != rank_coords(me, tp, ep):
        # the trainer's gathers lay every rank out by this rule (Megatron's order tp-cp-ep-dp-pp)
        raise RuntimeError(f"megatron placed global rank {me} at (TP rank, EP rank) = ({par.rank}, {par.ep_rank}), "
                           f"not {rank_coords(me, tp, ep)}")
    return par


def _close_own_group() -> None:
    if torch.distributed.is_initialized():
        import_megatron().parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def rank_coords(rank: int, tp: int, ep: int) -> tuple[int, int]:
    """Global rank -> (TP rank, EP rank) in Megatron's default order (TP and EP vary fastest)."""
    return rank % tp, rank % ep


def set_rank_device(local_rank: int, world: int, backend: str) -> int:
    """Put this rank on GPU local_rank modulo the visible GPUs (NCCL: one GPU per rank, or raise)."""
    count = torch.cuda.device_count()
    if backend == "nccl" and world > count:
        raise ValueError(f"NCCL needs one GPU per rank: {world} ranks, {count} visible GPU(s); "
                         f"use the gloo backend to share GPUs")
    index = local_rank % count
    torch.cuda.set_device(index)
    return index
