"""TP=N / EP=M against TP=1: the same sequences, adapter and PPO step under both, compared bit for bit.

    python -m zmrl.trainer.megatron.tp_check --model runs/tiny-model --tp 2 4 [--json]
    python -m zmrl.trainer.megatron.tp_check --model runs/tiny-model --tp 1 2 --ep 2    # expert parallel
    python -m zmrl.trainer.megatron.tp_check --model runs/tiny-model --tp 1 2 --ep 2 1  # EP per layout
    python -m zmrl.trainer.megatron.tp_check --model runs/tiny-model --tp 2 --ordinary   # the control only
    python -m zmrl.trainer.megatron.tp_check --model runs/tiny-model --tp 2 --control    # both, one verdict
    python -m zmrl.trainer.megatron.tp_check --model DIR --device cuda --backend gloo --tp 2 --control
                                                                      # two ranks sharing one GPU

Runs TP=1 (EP=1) in this process and each parallel layout in max(TP, EP) spawned processes (--ep
unset: EP = TP; one value: every layout's EP; one per --tp value: each layout's), over sequences
longer than index_topk of mixed lengths, with a seeded nonzero adapter. Reports, for the base
model's and the adapted model's log-probs, the LoRA gradient and the adapter after one train_step:
whether the layout equals TP=1 bitwise, the max |diff| and the count of differing values.
--ordinary runs the ranks with zmrl.batch_invariant.collectives.ordinary_all_reduce() (one GEMM or sum
per rank, then torch.distributed.all_reduce, as Megatron does; the expert combine likewise): the
negative control. --control runs both the canonical and the ordinary form of every layout.
--device cuda --backend nccl: one GPU per rank; --backend gloo: the ranks may share GPUs (rank r
on GPU r modulo the visible ones; the collectives copy through host memory).
Exit status 0 when every canonical run is bitwise equal to TP=1 and (with --ordinary or --control)
every ordinary run differs from it somewhere.
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


def workload(model_dir: str, tp: int, ep: int | None = None, seed: int = 0, device: str = "auto",
             backend: str | None = None) -> dict:
    from zmrl.lora import LoraConfig
    from zmrl.trainer.base import TrainBatch, UpdateSettings
    from zmrl.trainer.megatron.trainer import MegatronTrainer

    t0 = time.perf_counter()
    # eager minibatches at every layout: a CUDA graph pads its minibatch and sums the loss in another
    # order (zmrl.trainer.megatron.graphs), and only one rank captures, so TP = 1 would take a
    # different step from the parallel layouts it is compared with
    trainer = MegatronTrainer.from_dir(model_dir, LoraConfig(r=4), seed=seed, device=device,
                                       options={"tensor_parallel": tp, "expert_parallel": ep, "backend": backend,
                                                "cuda_graphs": False})
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
    out = {k: ({n: t.cpu() for n, t in v.items()} if isinstance(v, dict) and k != "metrics"
               else [t.cpu() for t in v] if isinstance(v, list) else v) for k, v in out.items()}
    out["build_s"], out["forward_s"] = built, forward
    return out


def _worker(rank: int, world: int, tp: int, ep: int, port: int, model_dir: str, out_file: str, ordinary: bool,
            device: str, backend: str | None) -> None:
    from zmrl.batch_invariant.collectives import ordinary_all_reduce

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    with ordinary_all_reduce(ordinary):
        result = workload(model_dir, tp, ep, device=device, backend=backend)
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


def run_parallel(model_dir: str, tp: int, ep: int, ordinary: bool = False, device: str = "auto",
                 backend: str | None = None) -> tuple[dict, float]:
    import torch.multiprocessing as mp

    world = max(tp, ep)
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "tp.pt")
        t0 = time.perf_counter()
        mp.start_processes(_worker, args=(world, tp, ep, _free_port(), model_dir, out_file, ordinary, device, backend),
                           nprocs=world, join=True, start_method="spawn")
        return torch.load(out_file), time.perf_counter() - t0


def layout_name(tp: int, ep: int) -> str:
    return f"tp{tp}" if ep == tp else f"tp{tp}_ep{ep}"


def layouts_of(tps: list[int], eps: list[int] | None) -> list[tuple[int, int]]:
    """--tp and --ep -> [(TP, EP)]: EP = TP when eps is None, one EP for all, or one per TP."""
    if eps is None:
        return [(tp, tp) for tp in tps]
    if len(eps) == 1:
        return [(tp, eps[0]) for tp in tps]
    if len(eps) != len(tps):
        raise ValueError(f"--ep takes one size or one per --tp size ({len(tps)}), got {len(eps)}")
    return list(zip(tps, eps))


def compare(model_dir: str, tps: list[int], ordinary: bool = False, ep: list[int] | None = None, device: str = "auto",
            backend: str | None = None, control: bool = False) -> dict:
    """-> {"tp1": timings, "<layout>": {key: diff vs TP=1, "wall_s", "timings_s"}, ...}; a layout is
    "tp<N>" (EP = TP) or "tp<N>_ep<M>"; with control, also "<layout>_ordinary" for each."""
    layouts = layouts_of(tps, ep)
    modes = [False, True] if control else [ordinary]
    runs = {(t, e, o): run_parallel(model_dir, t, e, o, device, backend) for t, e in layouts for o in modes}
    torch.set_num_threads(1)
    one = workload(model_dir, 1, 1, device=device, backend=backend)
    report = {"tp1": {"timings_s": {k: round(one[k], 3) for k in ("build_s", "forward_s", "step_s")}}}
    for (t, e, o), (result, wall) in runs.items():
        entry = {key: _diff(result[key], one[key]) for key in KEYS}
        entry["wall_s"] = round(wall, 1)
        entry["timings_s"] = {k: round(result[k], 3) for k in ("build_s", "forward_s", "step_s")}
        entry["equal"] = all(entry[key]["equal"] for key in KEYS)
        entry["ordinary"] = o
        report[layout_name(t, e) + ("_ordinary" if o and control else "")] = entry
    canonical = [v for k, v in report.items() if k != "tp1" and not v["ordinary"]]
    controls = [v for k, v in report.items() if k != "tp1" and v["ordinary"]]
    report["ordinary"], report["control"], report["device"] = ordinary, control, str(device)
    report["all_equal"] = all(v["equal"] for v in canonical) if canonical else None
    report["controls_differ"] = all(not v["equal"] for v in controls) if controls else None
    report["ok"] = report["all_equal"] is not False and report["controls_differ"] is not False
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, nargs="+", default=[2])
    p.add_argument("--ep", type=int, nargs="+", default=None,
                   help="expert-parallel size: one for every layout, or one per --tp size (default: = TP)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--ordinary", action="store_true", help="ordinary all-reduce on the ranks (the control only)")
    group.add_argument("--control", action="store_true", help="run the canonical and the ordinary form of each layout")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--backend", default=None, choices=("nccl", "gloo"),
                   help="default: nccl on CUDA (one GPU per rank), gloo on CPU; gloo on CUDA shares GPUs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        layouts = layouts_of(args.tp, args.ep)
    except ValueError as e:
        p.error(str(e))
    if any(t < 1 or e < 1 for t, e in layouts) or (1, 1) in layouts:
        p.error(f"every layout needs TP > 1 or EP > 1 (sizes >= 1), got (TP, EP) = {layouts}")
    report = compare(args.model, args.tp, args.ordinary, args.ep, args.device, args.backend, args.control)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"device {args.device}, backend {args.backend or 'default'}")
        for name, r in report.items():
            if not isinstance(r, dict) or name == "tp1":
                continue
            control = " (ordinary all-reduce)" if r["ordinary"] else ""
            print(f"{name}{control} vs TP=1, wall incl. spawn {r['wall_s']} s")
            for key in KEYS:
                d = r[key]
                print(f"  {key:20s} bitwise_equal={d['equal']}  max|diff|={d['max_abs_diff']:.3e}  "
                      f"differing={d['differing']}/{d['total']}")
            print(f"  timings {r['timings_s']}  TP=1 {report['tp1']['timings_s']}")
        print(f"canonical all bitwise equal: {report['all_equal']}; ordinary controls all differ: "
              f"{report['controls_differ']}; {'OK' if report['ok'] else 'FAILED'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
