"""zmrl check --model DIR --prompts FILE.jsonl [--adapter DIR] [--rollout vllm|reference]
              [--trainer reference|megatron] [--n N] [--max-tokens T] [--temperature X] [--seed S]
              [--batch-invariant on|off] [--json]

Samples completions with the rollout engine, recomputes every sampled token's log-prob on the
trainer side (one full-sequence forward), and reports max |diff|, the number of differing
tokens, the total, and mean(lp_rollout - lp_trainer) over sampled tokens (the k1 KL estimate;
exactly 0.0 when every token matches). Exits 0 only when every token is bitwise equal.
Prompts file: one JSON object per line with a "prompt" string (tokenized with the model's
tokenizer.json). `--batch-invariant off` runs both sides on default torch kernels.
"""
from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("check", help="rollout vs trainer log-probs, bit for bit",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint dir (config.json, model.safetensors, tokenizer)")
    p.add_argument("--prompts", required=True, help='JSONL file, one {"prompt": "..."} per line')
    p.add_argument("--adapter", help="PEFT adapter dir (zmrl.lora format)")
    p.add_argument("--rollout", choices=["vllm", "reference"], default="vllm")
    p.add_argument("--trainer", choices=["reference", "megatron"], default="reference")
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-invariant", choices=["on", "off"], default="on")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def read_prompts(path: str) -> list[str]:
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise ValueError(f'{path}:{number}: expected an object with a non-empty "prompt" string')
            prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def compare(rollout_samples, trainer_scores) -> dict:
    """[prompt][n] Samples and matching [prompt][n] fp32 tensors -> the report."""
    import torch

    lp_r = torch.cat([s.logprobs for ss in rollout_samples for s in ss])
    lp_t = torch.cat([t for ts in trainer_scores for t in ts])
    diff = (lp_r.double() - lp_t.double())
    total = int(lp_r.numel())
    return {"total_tokens": total, "differing_tokens": int((lp_r != lp_t).sum()),
            "max_abs_diff": float(diff.abs().max()) if total else 0.0,
            "kl_k1": float(diff.mean()) if total else 0.0}


def run(args) -> int:
    from pathlib import Path

    try:
        if args.n < 1:
            raise ValueError(f"--n must be >= 1, got {args.n}")
        if args.trainer == "megatron":
            raise ValueError("--trainer megatron is not available yet (it arrives with the Megatron engine)")
        prompts = read_prompts(args.prompts)
        tok_file = Path(args.model) / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{args.model} has no tokenizer.json (create the model with `zmrl init-model`)")
        from tokenizers import Tokenizer

        import zmrl.batch_invariant as bi
        from zmrl.rollout.default_kernels import TorchProjections
        from zmrl.rollout.reference import ReferenceEngine

        tokenizer = Tokenizer.from_file(str(tok_file))
        ids = [tokenizer.encode(p).ids for p in prompts]
        if any(not i for i in ids):
            raise ValueError("a prompt tokenizes to nothing")
        trainer = ReferenceEngine.from_dir(args.model)
        adapter = None
        if args.adapter:
            from zmrl.lora import load_peft

            adapter = load_peft(args.adapter, trainer.cfg)
            trainer.projections = adapter.projections
        on = args.batch_invariant == "on"
        if not on:
            trainer.projections = lambda layer: TorchProjections()
    except (ValueError, FileNotFoundError) as e:
        print(f"zmrl check: {e}", file=sys.stderr)
        return 2

    sample_args = dict(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.rollout == "vllm":
        from zmrl.rollout.vllm import VllmEngine

        engine = VllmEngine(args.model, batch_invariant=on, max_model_len=trainer.cfg.max_position_embeddings)
        if adapter is not None:
            engine.set_adapter(adapter.lcfg)
            engine.sync_weights(adapter=adapter)
        samples = engine.generate(ids, **sample_args)
    else:
        rollout = ReferenceEngine(trainer.cfg, trainer.weights, trainer.projections)
        with bi.batch_invariant_mode(on):
            samples = rollout.generate(ids, **sample_args)
    with bi.batch_invariant_mode(on):
        scores = [[trainer.score(p, s.token_ids, args.temperature) for s in ss] for p, ss in zip(ids, samples)]
    report = {"rollout": args.rollout, "trainer": args.trainer, "batch_invariant": args.batch_invariant,
              **compare(samples, scores)}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"rollout={report['rollout']} trainer={report['trainer']} batch_invariant={report['batch_invariant']}")
        print(f"tokens {report['total_tokens']}  differing {report['differing_tokens']}  "
              f"max|diff| {report['max_abs_diff']:.3e}  kl_k1 {report['kl_k1']:.3e}")
    return 0 if report["differing_tokens"] == 0 else 1
