"""`zmrl train RECIPE` with `run.orchestrator = "verl"`: a zmrl recipe run by verl's PPO trainer.

    zmrl train recipes/tiny_verl.toml

What it does, in order: create what the recipe asks for and is absent (the model, the dataset:
zmrl.rl.inputs, as `zmrl train` does), write the prompts as verl's parquet (RUN_DIR/verl/
train.parquet; each row's extra_info carries the dataset row and the reward function, which
zmrl.verl.rewards calls), map the recipe onto verl's Hydra keys (RUN_DIR/verl/overrides.txt,
one per line), then run

    python -m verl.trainer.main_ppo --config-path=<zmrl/verl/config> --config-name=zmrl_ppo <overrides>

with verl's metrics going to RUN_DIR/metrics.jsonl (verl's file logger: {"step", "data"} per
line) and, unless tracking.wandb = "disabled", to W&B. Its exit status: 0 done, 2 bad input,
3 the strict check stopped the run (zmrl.verl.strict.MismatchError), else verl's own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from zmrl.rl.inputs import RunError, Tokenizer, prepare_data, prepare_model

ADVANTAGES = {"grpo": ("grpo", True), "dr_grpo": ("grpo", False), "rloo": ("rloo", True)}
KL_TYPES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
LOSS_AGG = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean"}
MISMATCH_EXIT = 3


def verl_overrides(cfg, *, model_dir: str, train_file: str, max_prompt_len: int, run_dir: Path) -> list[str]:
    """The recipe as verl Hydra overrides (key=value), on top of zmrl_ppo.yaml."""
    from zmrl.lora import DEFAULT_TARGETS
    from zmrl.model.checkpoint import read_config

    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    if cfg.trainer.backend != "megatron" or r.backend != "vllm":
        raise RunError(f"run.orchestrator = \"verl\" runs zmrl's vLLM rollout and Megatron trainer: set "
                       f"rollout.backend = \"vllm\" and trainer.backend = \"megatron\" (got {r.backend!r}, "
                       f"{t.backend!r})")
    if cfg.run.prompts_per_step % a.num_minibatches:
        raise RunError(f"algorithm.num_minibatches={a.num_minibatches} must divide run.prompts_per_step="
                       f"{cfg.run.prompts_per_step} (verl splits a step's prompt groups evenly)")
    unknown = sorted(set(t.options) - {"tensor_parallel"})
    if unknown:
        raise RunError(f"trainer.options {unknown}: under verl only tensor_parallel is mapped")
    if cfg.lora.alpha != int(cfg.lora.alpha):
        raise RunError(f"lora.alpha={cfg.lora.alpha}: verl's model.lora_alpha is an integer")
    estimator, norm_std = ADVANTAGES[a.advantage]
    targets = list(cfg.lora.targets) if cfg.lora.targets is not None else list(DEFAULT_TARGETS)
    tp = int(t.options.get("tensor_parallel", 1))
    logger = ["console", "file"] + ([] if cfg.tracking.wandb == "disabled" else ["wandb"])
    out = {
        "data.train_files": train_file, "data.val_files": train_file,
        "data.train_batch_size": cfg.run.prompts_per_step, "data.shuffle": cfg.data.shuffle,
        "data.seed": cfg.run.seed,
        "data.max_prompt_length": max_prompt_len, "data.max_response_length": r.max_tokens,
        "actor_rollout_ref.model.path": model_dir,
        "actor_rollout_ref.model.lora_rank": cfg.lora.r, "actor_rollout_ref.model.lora_alpha": int(cfg.lora.alpha),
        "actor_rollout_ref.model.target_modules": "[" + ",".join(f"'{x}'" for x in targets) + "]",
        "actor_rollout_ref.actor.megatron.seed": cfg.lora.seed,
        # zmrl's trainer is tensor-parallel only: its ranks are the worker group, one per "GPU" slot
        "trainer.n_gpus_per_node": tp,
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": tp,
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size": tp,
        "actor_rollout_ref.actor.optim.lr": t.lr,
        "actor_rollout_ref.actor.optim.betas": f"[{t.betas[0]},{t.betas[1]}]",
        "actor_rollout_ref.actor.optim.weight_decay": t.weight_decay,
        "actor_rollout_ref.actor.optim.clip_grad": t.max_grad_norm,
        "actor_rollout_ref.actor.ppo_mini_batch_size": cfg.run.prompts_per_step // a.num_minibatches,
        "actor_rollout_ref.actor.ppo_epochs": a.epochs,
        # one micro-batch per mini-batch, one per log-prob pass (the trainer packs a call's sequences)
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": cfg.run.prompts_per_step * r.n // a.num_minibatches,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": cfg.run.prompts_per_step * r.n,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": cfg.run.prompts_per_step * r.n,
        "actor_rollout_ref.actor.clip_ratio_low": a.clip_eps,
        "actor_rollout_ref.actor.clip_ratio_high": a.clip_eps if a.clip_eps_high is None else a.clip_eps_high,
        "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG[a.loss_agg],
        "actor_rollout_ref.actor.use_kl_loss": a.kl_coef > 0,
        "actor_rollout_ref.actor.kl_loss_coef": a.kl_coef,
        "actor_rollout_ref.actor.kl_loss_type": KL_TYPES[a.kl_estimator],
        # the rollout serves the checkpoint's own dtype (verl's default bfloat16 is refused for fp32)
        "actor_rollout_ref.rollout.dtype": read_config(model_dir).torch_dtype,
        "actor_rollout_ref.rollout.n": r.n, "actor_rollout_ref.rollout.temperature": r.temperature,
        "actor_rollout_ref.rollout.prompt_length": max_prompt_len,
        "actor_rollout_ref.rollout.response_length": r.max_tokens,
        "actor_rollout_ref.rollout.max_num_seqs": r.max_num_seqs,
        "actor_rollout_ref.rollout.max_num_batched_tokens": r.max_num_batched_tokens,
        "actor_rollout_ref.rollout.seed": cfg.run.seed,
        "algorithm.adv_estimator": estimator, "algorithm.norm_adv_by_std_in_grpo": norm_std,
        "trainer.v1.trainer_mode": "zmrl_strict" if cfg.mismatch.strict else "sync",
        "trainer.total_training_steps": cfg.run.steps,
        "trainer.save_freq": cfg.run.checkpoint_every or -1,
        "trainer.max_actor_ckpt_to_keep": cfg.run.keep_checkpoints,
        "trainer.default_local_dir": str(run_dir / "checkpoints"),
        "trainer.project_name": cfg.tracking.project,
        "trainer.experiment_name": cfg.tracking.name or run_dir.name,
        "trainer.logger": "[" + ",".join(logger) + "]",
        # Hydra's own record of the run (.hydra/, main_ppo.log) goes in the run directory; by default
        # it writes outputs/<date>/<time>/ wherever the command was started
        "hydra.run.dir": str(run_dir / "verl" / "hydra"),
    }
    # rollout.extra: vLLM arguments, and zmrl's rollout options (batch_invariant), for verl's server
    extra = [f"++actor_rollout_ref.rollout.engine_kwargs.zmrl.{k}={_hydra_value(v)}" for k, v in r.extra.items()]
    return [f"{k}={_hydra_value(v)}" for k, v in out.items()] + extra


def _hydra_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def write_parquet(cfg, data, path: Path) -> None:
    """The prompts as verl's RL dataset: one chat message per row (zmrl_ppo.yaml's template
    turns it back into the prompt text), the row and reward function in extra_info."""
    import pandas as pd

    kwargs = json.dumps(cfg.reward.kwargs, sort_keys=True)
    rows = [{"data_source": "zmrl", "prompt": [{"role": "user", "content": text}],
             "reward_model": {"style": "rule", "ground_truth": str(row.get("answer", ""))},
             "extra_info": {"index": i, "zmrl_reward": cfg.reward.function, "zmrl_reward_kwargs": kwargs,
                            "zmrl_row": json.dumps(row, sort_keys=True, default=str)}}
            for i, (text, row) in enumerate(zip(data.texts, data.rows))]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pd.DataFrame(rows).to_parquet(tmp)
    os.replace(tmp, path)


def prepare(cfg) -> tuple[list[str], Path]:
    """Inputs created and checked, the parquet written -> (the overrides, RUN_DIR/verl)."""
    run_dir = Path(cfg.run.dir)
    model_dir = prepare_model(cfg)
    tokenizer = Tokenizer(model_dir)
    data = prepare_data(cfg, tokenizer)
    out = run_dir / "verl"
    write_parquet(cfg, data, out / "train.parquet")
    overrides = verl_overrides(cfg, model_dir=str(Path(model_dir).resolve()),
                               train_file=str((out / "train.parquet").resolve()),
                               max_prompt_len=data.max_len, run_dir=run_dir.resolve())
    (out / "overrides.txt").write_text("\n".join(overrides) + "\n")
    return overrides, out


def command(overrides: list[str]) -> list[str]:
    from zmrl.verl.config import DIR

    return [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={DIR}", "--config-name=zmrl_ppo",
            *overrides]


def run(cfg) -> int:
    import importlib.util

    missing = [m for m in ("verl", "ray") if importlib.util.find_spec(m) is None]
    if missing:
        raise RunError(f"run.orchestrator = \"verl\" needs {' and '.join(missing)} (bash scripts/setup.sh installs "
                       f"them; on a GPU machine: pip install 'zmrl[verl]')")
    overrides, out = prepare(cfg)
    run_dir = Path(cfg.run.dir).resolve()
    metrics = run_dir / "metrics.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics), "WANDB_DIR": str(run_dir),
           "WANDB_MODE": "offline" if cfg.tracking.wandb == "offline" else os.environ.get("WANDB_MODE", "online")}
    if cfg.run.num_threads:
        env["OMP_NUM_THREADS"] = str(cfg.run.num_threads)
    if "VERL_PLATFORM" not in env and cfg.run.device in ("cpu", "auto"):
        import torch

        if cfg.run.device == "cpu" or not torch.cuda.is_available():
            env["VERL_PLATFORM"] = "cpu"
    print(f"# verl: {' '.join(command(overrides))}", flush=True)
    proc = subprocess.Popen(command(overrides), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mismatch = None
    for line in proc.stdout:
        sys.stdout.write(line)
        if "MismatchError: step " in line:  # the exception's own line (not Ray's wrapper)
            mismatch = line.strip().split("MismatchError: ", 1)[1]
    code = proc.wait()
    if code and mismatch is not None:
        print(f"zmrl train: MISMATCH: {mismatch}", file=sys.stderr, flush=True)
        return MISMATCH_EXIT
    if code == 0:
        print(summary(metrics), flush=True)
    return code


def summary(metrics_file: Path) -> str:
    """One line from verl's metrics: steps, reward first -> last, the largest mismatch count."""
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    if not steps:
        return f"done: no step logged in {metrics_file}"
    first, last = steps[0]["data"], steps[-1]["data"]
    worst = max(s["data"].get("mismatch/tokens_different", float("nan")) for s in steps)
    return (f"done: steps {steps[0]['step']}..{steps[-1]['step']}; reward (critic/score/mean) "
            f"{first.get('critic/score/mean', float('nan')):.3f} -> {last.get('critic/score/mean', float('nan')):.3f}; "
            f"max mismatch/tokens_different {worst:g}; metrics: {metrics_file}")
