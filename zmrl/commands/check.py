"""zmrl check --model DIR --prompts FILE.jsonl [--adapter DIR] [--rollout vllm|reference]
              [--trainer reference|megatron] [--n N] [--max-tokens T] [--temperature X] [--seed S]
              [--batch-invariant on|off] [--rollout-tp N] [--trainer-tp N] [--json]

Samples completions with the rollout engine, recomputes every sampled token's log-prob on the
trainer side (one full-sequence forward), and reports max |diff|, the number of differing
tokens, the total, and mean(lp_rollout - lp_trainer) over sampled tokens (the k1 KL estimate;
exactly 0.0 when every token matches). Exits 0 only when every token is bitwise equal.
Prompts file: one JSON object per line with a "prompt" string (tokenized with the model's
tokenizer.json). `--batch-invariant off` runs both sides on default torch kernels: every zmrl op
on the "torch" path of zmrl.batch_invariant and torch's own aten kernels (vLLM's sampler included).
`--rollout-tp N` serves the model on N vLLM workers (vLLM's tensor_parallel_size), `--trainer-tp N`
runs the Megatron trainer as N ranks (tensor_parallel, experts split over the same ranks); both
shard the model the same way and reduce across ranks by the canonical tree, so any pair of sizes
gives the TP = 1 bits. N must be 1, 2, 4 or 8 and divide the canonical leaves of every split
dimension (checked before anything starts).
Exit codes: 0 all tokens equal, 1 some differ, 2 bad input (nothing was run), 3 the check stopped
on an error (its traceback is printed; nothing was compared).

From Python (tests, the loop) `check(...)` takes an already running VllmEngine:

    from zmrl.commands.check import check
    report = check("runs/tiny", ["What is 2 + 2?"], engine=engine, n=2, batch_invariant=False)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path


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
    p.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor_parallel_size (--rollout vllm)")
    p.add_argument("--trainer-tp", type=int, default=1, help="Megatron tensor_parallel ranks (--trainer megatron)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def read_prompts(path: str) -> list[str]:
    prompts = []
    if Path(path).is_dir():
        raise ValueError(f"--prompts {path} is a directory, not a JSONL file")
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"--prompts {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    for number, line in enumerate(text.splitlines(), 1):
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


def check(model_dir: str | Path, prompts: list[str], *, adapter_dir: str | Path | None = None,
          rollout: str = "vllm", trainer: str = "reference", n: int = 2, max_tokens: int = 16,
          temperature: float = 1.0, seed: int = 0, batch_invariant: bool = True, engine=None,
          rollout_tp: int = 1, trainer_tp: int = 1, progress: bool = False) -> dict:
    """Sample with the rollout side, rescore with the trainer side -> the report (see compare).

    `engine`: a running VllmEngine over `model_dir` to use instead of starting one (its
    invariance switch is restored afterwards; with an adapter it is left serving the base
    model). rollout_tp / trainer_tp: tensor-parallel sizes of a vLLM engine started here and of the
    Megatron trainer. `progress`: a line on stderr as each phase starts and ends (minutes at
    realistic sizes). Bad inputs raise ValueError / FileNotFoundError before anything is generated."""
    import torch

    import zmrl.batch_invariant as bi
    from zmrl.rollout.reference import ReferenceEngine
    from zmrl.rollout.sample import check_sampling

    check_sampling(n, max_tokens, temperature, ("--n", "--max-tokens", "--temperature"))
    if rollout not in ("vllm", "reference"):
        raise ValueError(f"--rollout must be vllm or reference, got {rollout!r}")
    if trainer not in ("reference", "megatron"):
        raise ValueError(f"--trainer must be reference or megatron, got {trainer!r}")
    if not prompts:
        raise ValueError("no prompts")
    if engine is not None and Path(engine.model_dir).resolve() != Path(model_dir).resolve():
        raise ValueError(f"the engine serves {engine.model_dir}, not {model_dir}")
    from zmrl.model.checkpoint import check_model_dir

    model_cfg = check_model_dir(model_dir)  # names a cut or foreign config.json / model.safetensors
    _check_tp(model_cfg, rollout, trainer, rollout_tp, trainer_tp, engine)
    tok_file = Path(model_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json (create the model with `zmrl init-model`)")
    from tokenizers import Tokenizer

    scorer = ReferenceEngine.from_dir(model_dir)  # checks config, tokenizer size and every tensor
    ids = [Tokenizer.from_file(str(tok_file)).encode(p).ids for p in prompts]
    if any(not i for i in ids):
        raise ValueError("a prompt tokenizes to nothing")
    limit = scorer.cfg.max_position_embeddings
    for number, prompt_ids in enumerate(ids, 1):
        if len(prompt_ids) + max_tokens > limit:  # vLLM would refuse it mid-run, the trainer's RoPE too
            raise ValueError(f"prompt {number} is {len(prompt_ids)} tokens; with --max-tokens {max_tokens} it "
                             f"passes the model's max_position_embeddings ({limit})")
    adapter = None
    if adapter_dir is not None:
        from zmrl.lora import load_peft

        adapter = load_peft(adapter_dir, scorer.cfg)  # raises naming every factor that does not fit
        scorer.projections = adapter.projections

    @contextlib.contextmanager
    def kernels():
        # off: torch's aten kernels and every zmrl op on the torch path (the two go together:
        # the torch path calls plain torch ops, which enable() would route back into zmrl)
        with bi.batch_invariant_mode(batch_invariant):
            with contextlib.nullcontext() if batch_invariant else bi.use_path("torch"):
                yield

    sample_args = dict(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
    with _phase(progress, f"sampling {len(ids)} prompt(s) x {n} with {rollout} (TP {rollout_tp}), "
                          f"{sum(map(len, ids))} prompt tokens"):
        if rollout == "vllm":
            samples = _vllm_samples(model_dir, engine, ids, adapter, batch_invariant, scorer.cfg, sample_args,
                                    rollout_tp)
        else:
            with kernels():
                samples = ReferenceEngine(scorer.cfg, scorer.weights, scorer.projections).generate(ids, **sample_args)
    with _phase(progress, f"scoring {sum(map(len, samples))} sequence(s) with {trainer} (TP {trainer_tp})"):
        if trainer == "megatron":
            scores = _megatron_scores(model_dir, adapter, ids, samples, temperature, batch_invariant, trainer_tp)
        else:
            with kernels(), torch.no_grad():
                scores = [[scorer.score(p, s.token_ids, temperature) for s in ss] for p, ss in zip(ids, samples)]
    return {"rollout": rollout, "trainer": trainer, "batch_invariant": "on" if batch_invariant else "off",
            "rollout_tp": rollout_tp if engine is None else engine.tensor_parallel_size, "trainer_tp": trainer_tp,
            **compare(samples, scores)}


@contextlib.contextmanager
def _phase(progress: bool, what: str):
    if not progress:
        yield
        return
    import time

    print(f"zmrl check: {what} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"zmrl check: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _check_tp(model_cfg, rollout: str, trainer: str, rollout_tp: int, trainer_tp: int, engine) -> None:
    from zmrl.model.sharding import check_divisible

    check_divisible(model_cfg, rollout_tp, "--rollout-tp")
    check_divisible(model_cfg, trainer_tp, "--trainer-tp")
    if rollout_tp > 1 and (rollout != "vllm" or engine is not None):
        raise ValueError("--rollout-tp > 1 needs --rollout vllm (and an engine started by the check)")
    if trainer_tp > 1 and trainer != "megatron":
        raise ValueError("--trainer-tp > 1 needs --trainer megatron")


def _megatron_scores(model_dir, adapter, ids, samples, temperature, batch_invariant, tp: int = 1):
    """The Megatron trainer's log-probs of the samples (TP = 1: this process; TP > 1: tp spawned
    ranks, zmrl.rl.launcher), adapter loaded when given."""
    from zmrl.lora import LoraConfig

    lcfg = adapter.lcfg if adapter is not None else LoraConfig()
    options = {"batch_invariant": batch_invariant, "tensor_parallel": tp}
    if tp > 1:
        from zmrl.rl.launcher import TrainerRanks

        trainer = TrainerRanks("megatron", str(model_dir), lcfg, options=options)
    else:
        from zmrl.trainer.megatron import MegatronTrainer

        trainer = MegatronTrainer.from_dir(model_dir, lcfg, options=options)
    try:
        if adapter is not None:
            trainer.load_adapter_tensors({k: v.detach() for k, v in adapter.factors.items()})
        prompts = [p for p, ss in zip(ids, samples) for _ in ss]
        flat = trainer.logprobs(prompts, [s.token_ids for ss in samples for s in ss], temperature=temperature,
                                adapter=adapter is not None)
    finally:
        if tp > 1:
            trainer.close()
    it = iter(flat)
    return [[next(it) for _ in ss] for ss in samples]


def _vllm_samples(model_dir, engine, ids, adapter, batch_invariant, cfg, sample_args, tp: int = 1):
    own = engine is None
    if own:
        from zmrl.rollout.vllm import VllmEngine

        # vLLM's workers each take one thread when there are several
        engine = VllmEngine(model_dir, batch_invariant=batch_invariant, max_model_len=cfg.max_position_embeddings,
                            **({"extra": {"tensor_parallel_size": tp}, "num_threads": 1} if tp > 1 else {}))
    was = engine.config.batch_invariant
    try:
        engine.set_batch_invariant(batch_invariant)
        if adapter is not None:
            engine.set_adapter(adapter.lcfg)
            engine.sync_weights(adapter=adapter)
        return engine.generate(ids, **sample_args)
    finally:
        if own:
            engine.shutdown()
        else:
            if adapter is not None:
                engine.set_adapter(None)
            engine.set_batch_invariant(was)


def run(args) -> int:
    # --json: stdout is exactly one JSON object, so everything else written to fd 1 while the engines
    # run (vLLM's and Megatron's logging, native prints, child processes) goes to stderr
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        try:
            report = check(args.model, read_prompts(args.prompts), adapter_dir=args.adapter, rollout=args.rollout,
                           trainer=args.trainer, n=args.n, max_tokens=args.max_tokens,
                           temperature=args.temperature, seed=args.seed, batch_invariant=args.batch_invariant == "on",
                           rollout_tp=args.rollout_tp, trainer_tp=args.trainer_tp, progress=True)
        except (ValueError, FileNotFoundError) as e:  # bad input: nothing was compared
            print(f"zmrl check: {e}", file=sys.stderr)
            return 2
        except Exception:  # not 1, which a script reads as "some tokens differ"
            traceback.print_exc()
            print("zmrl check: stopped by the error above; nothing was compared", file=sys.stderr)
            return 3
    if args.json:
        print(json.dumps(report))
    else:
        print(f"rollout={report['rollout']} (TP {report['rollout_tp']}) trainer={report['trainer']} "
              f"(TP {report['trainer_tp']}) batch_invariant={report['batch_invariant']}")
        print(f"tokens {report['total_tokens']}  differing {report['differing_tokens']}  "
              f"max|diff| {report['max_abs_diff']:.3e}  kl_k1 {report['kl_k1']:.3e}")
    return 0 if report["differing_tokens"] == 0 else 1


@contextlib.contextmanager
def _stdout_to_stderr():
    import os

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
