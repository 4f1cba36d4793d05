"""A tensor-parallel trainer as N processes, driven from the loop's process.

    trainer = TrainerRanks("megatron", model_dir, lora, seed=0, options={"tensor_parallel": 2})
    lp = trainer.logprobs(prompts, completions, temperature=1.0)      # every rank runs it; rank 0 answers
    trainer.close()

`zmrl train` uses this when `trainer.options` asks for tensor_parallel or expert_parallel > 1
(zmrl.rl.engines.build_trainer); it starts max(tensor_parallel, expert_parallel) ranks. Each rank is a
spawned process with its own torch.distributed group (gloo on CPU; on CUDA NCCL with one GPU per rank,
or gloo with ranks sharing GPUs when options.backend = "gloo"), so the loop's process (which may
hold an in-process vLLM engine, itself a torch.distributed world of one) never joins it. Every trainer call is sent to every rank over a pipe
and every rank answers; the ranks hold the same values (the trainer's canonical reductions), and
rank 0's answer is returned. A rank that raises, exits or does not answer within `timeout_s` ends the
run with TrainerRankError naming the rank and the call; the other ranks are terminated, never left
waiting in a collective (their own collectives time out after `timeout_s` too).
"""
from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

import torch

CALLS = ("logprobs", "train_step", "adapter_tensors", "adapter", "load_adapter_tensors", "state_dict",
         "load_state_dict", "save_adapter", "lora_grads", "hf_state_dict")
"""The trainer methods the ranks serve (the zmrl.trainer.base API and the tools' extras)."""


def world_size(options: dict) -> int:
    """The ranks a trainer's options ask for: max(tensor_parallel, expert_parallel), expert_parallel
    defaulting to tensor_parallel."""
    tp = int(options.get("tensor_parallel", 1))
    ep = options.get("expert_parallel")
    return max(tp, tp if ep is None else int(ep))


class TrainerRankError(RuntimeError):
    """A trainer rank failed, exited or hung; the message names it and the call."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, backend: str, model_dir: str, lora, seed: int, options: dict,
           num_threads: int, timeout_s: float, device: str, conn) -> None:
    """One rank: join the group, build the trainer, then run each call received until None."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(num_threads)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        cuda = torch.device(device).type == "cuda"
        pg_backend = options.get("backend") or ("nccl" if cuda else "gloo")
        if cuda:
            from zmrl.trainer.megatron.parallel import set_rank_device

            set_rank_device(rank, world, pg_backend)
        dist.init_process_group(pg_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        import importlib

        trainer = importlib.import_module(f"zmrl.trainer.{backend}").TRAINER.from_dir(
            model_dir, lora, seed=seed, options=options, device="cuda" if cuda else "cpu")
        conn.send(("ok", None))
    except BaseException as e:  # noqa: BLE001  (reported to the loop, which ends the run)
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        name, args, kwargs = msg
        try:
            out = getattr(trainer, name)(*args, **kwargs)
            conn.send(("ok", out if rank == 0 else None))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
            break
    dist.destroy_process_group()


class TrainerRanks:
    def __init__(self, backend: str, model_dir: str, lora, *, seed: int = 0, options: dict | None = None,
                 num_threads: int = 1, timeout_s: float = 600.0, device: str = "cpu"):
        import torch.multiprocessing as mp

        options = dict(options or {})
        self.world = world_size(options)
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        for rank in range(self.world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, daemon=True, name=f"zmrl-trainer-rank{rank}",
                               args=(rank, self.world, port, backend, str(model_dir), lora, seed, options,
                                     num_threads, timeout_s, device, theirs))
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)
        self._collect("building the trainer")

    def _collect(self, what: str):
        results, pending = [None] * self.world, set(range(self.world))
        deadline = time.monotonic() + self.timeout_s
        while pending:
            for r in sorted(pending):
                if self.conns[r].poll(0.05):
                    status, value = self.conns[r].recv()
                    if status == "error":
                        self.close()
                        raise TrainerRankError(f"trainer rank {r} of {self.world} failed in {what}: {value}")
                    results[r] = value
                    pending.discard(r)
                elif not self.procs[r].is_alive():
                    code = self.procs[r].exitcode
                    self.close()
                    raise TrainerRankError(f"trainer rank {r} of {self.world} exited (code {code}) during {what}")
            if pending and time.monotonic() > deadline:
                self.close()
                raise TrainerRankError(f"trainer ranks {sorted(pending)} of {self.world} did not finish {what} "
                                       f"within {self.timeout_s:.0f} s")
        return results[0]

    def _call(self, name: str, *args, **kwargs):
        if not self.procs:
            raise TrainerRankError(f"the trainer ranks are closed; cannot run {name}")
        for conn in self.conns:
            conn.send((name, args, kwargs))
        return self._collect(name)

    def __getattr__(self, name: str):
        if name in CALLS:
            return lambda *args, **kwargs: self._call(name, *args, **kwargs)
        raise AttributeError(name)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self.conns, self.procs = [], []

    def __del__(self):
        if getattr(self, "procs", None):
            self.close()
