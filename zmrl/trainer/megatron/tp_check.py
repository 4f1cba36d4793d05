"""TP=N against TP=1: the same sequences, adapter and PPO step under both, compared bit for bit.

    python -m zmrl.trainer.megatron.tp_check --model runs/tiny-model --tp 2 4 [--json]
    python -m zmrl.trainer.megatron.tp_check --model runs/tiny-model --tp 2 --ordinary   # the control

Runs TP=1 in this process and each TP=N in N spawned processes (gloo on CPU, NCCL on GPU), over
sequences longer than index_topk of mixed lengths, with a seeded nonzero adapter. Reports, for
the base model's and the adapted model's log-probs, the LoRA gradient and the adapter after one
train_step: whether TP=N equals TP=1 bitwise, the max |diff| and the count of differing values.
--ordinary runs the TP=N ranks with zmrl.batch_invariant.collectives.ordinary_all_reduce() (one GEMM
or sum per rank, then torch.distributed.all_reduce, as Megatron does): the negative control.
Exit status 0 when every TP=N run is bitwise equal to TP=1 (with --ordinary: when one differs).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch

import zmrl.batch_invariant as bi


def workload(model_dir: str, tp: int, seed: int = 0) -> dict:
    from zmrl.lora import LoraConfig
    from zmrl.trainer.base import TrainBatch, UpdateSettings
    from zmrl.trainer.megatron.trainer import MegatronTrainer

    t0 = time.perf_counter()
    trainer = MegatronTrainer.from_dir(model_dir, LoraConfig(r=4), seed=seed, options={"tensor_parallel": tp})
    built = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(seed)
    vocab, topk = trainer.cfg.vocab_size, trainer.cfg.index_topk
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, topk + 5, 2 * topk + 8)]
    completions = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (topk + 2, 7, topk)]
    adapter = {k: torch.randn(t.shape, generator=gen).to(t.dtype) * 0.05 for k, t in trainer.adapter_tensors().items()}
    trainer.load_adapter_tensors(adapter)
    t0 = time.perf_counter()
    out = {"base": trainer.logprobs(prompts, completions, temperature=1.0, adapter=False),
           "lora": trainer.logprobs(prompts, completions, temperature=0.7)}
    forward = time.perf_counter() - t0
    lps = trainer._logprobs(prompts, completions, 1.0, True)
    with bi.batch_invariant_mode(False):  # as train_step's backward
        torch.stack([lp.sum() for lp in lps]).sum().backward()
    out["grad"] = trainer.lora_grads()
    for p in trainer.params.values():
        p.grad = None
    batch = TrainBatch(prompts=prompts, completions=completions, old_logprobs=out["lora"],
                       advantages=torch.tensor([1.0, -0.5, 0.25]))
    t0 = time.perf_counter()
    out["metrics"] = trainer.train_step(batch, UpdateSettings(lr=1e-3, temperature=0.7), step=0)
    out["step_s"] = time.perf_counter() - t0
    out["adapter_after_step"] = trainer.adapter_tensors()
    out["build_s"], out["forward_s"] = built, forward
    return out


def _worker(rank: int, tp: int, port: int, model_dir: str, out_file: str, ordinary: bool) -> None:
    from zmrl.batch_invariant.collectives import ordinary_all_reduce

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    with ordinary_all_reduce(ordinary):
        result = workload(model_dir, tp)
    if rank == 0:
        torch.save(result, out_file)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _diff(a, b) -> dict:
    if isinstance(a, dict):
        parts = [_diff(a[k], b[k]) for k in a]
    else:
        parts = [_diff_t(x, y) for x, y in zip(a, b, strict=True)]
    return {"equal": all(p["equal"] for p in parts), "max_abs_diff": max(p["max_abs_diff"] for p in parts),
            "differing": sum(p["differing"] for p in parts), "total": sum(p["total"] for p in parts)}


def _diff_t(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.double() - b.double()).abs()
    return {"equal": torch.equal(a, b), "max_abs_diff": float(d.max()) if d.numel() else 0.0,
            "differing": int((a != b).sum()), "total": a.numel()}


KEYS = ("base", "lora", "grad", "adapter_after_step")


def run_tp(model_dir: str, tp: int, ordinary: bool = False) -> tuple[dict, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "tp.pt")
        t0 = time.perf_counter()
        mp.start_processes(_worker, args=(tp, _free_port(), model_dir, out_file, ordinary), nprocs=tp, join=True,
                           start_method="spawn")
        return torch.load(out_file), time.perf_counter() - t0


def compare(model_dir: str, tps: list[int], ordinary: bool = False) -> dict:
    """-> {"tp1": timings, "tp<N>": {key: diff vs TP=1, "wall_s": ..., "timings_s": ...}}."""
    report = {}
    many = {tp: run_tp(model_dir, tp, ordinary) for tp in tps}
    torch.set_num_threads(1)
    one = workload(model_dir, 1)
    report["tp1"] = {"timings_s": {k: round(one[k], 3) for k in ("build_s", "forward_s", "step_s")}}
    for tp, (result, wall) in many.items():
        entry = {key: _diff(result[key], one[key]) for key in KEYS}
        entry["wall_s"] = round(wall, 1)
        entry["timings_s"] = {k: round(result[k], 3) for k in ("build_s", "forward_s", "step_s")}
        report[f"tp{tp}"] = entry
    report["ordinary"] = ordinary
    report["all_equal"] = all(report[f"tp{tp}"][key]["equal"] for tp in tps for key in KEYS)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, nargs="+", default=[2])
    p.add_argument("--ordinary", action="store_true", help="ordinary all-reduce on the TP=N ranks (control)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    report = compare(args.model, args.tp, args.ordinary)
    if args.json:
        print(json.dumps(report))
    else:
        for tp in args.tp:
            r = report[f"tp{tp}"]
            print(f"TP={tp}{' (ordinary all-reduce)' if args.ordinary else ''} vs TP=1, wall incl. spawn {r['wall_s']} s")
            for key in KEYS:
                d = r[key]
                print(f"  {key:20s} bitwise_equal={d['equal']}  max|diff|={d['max_abs_diff']:.3e}  "
                      f"differing={d['differing']}/{d['total']}")
            print(f"  timings TP={tp} {r['timings_s']}  TP=1 {report['tp1']['timings_s']}")
    return 0 if report["all_equal"] != args.ordinary else 1


if __name__ == "__main__":
    sys.exit(main())
