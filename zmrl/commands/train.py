"""zmrl train RECIPE.toml [--set KEY=VALUE ...] [--resume RUN_DIR] [--dry-run]

    zmrl train recipes/tiny_cpu.toml                                   # the main job (CPU, ~minutes)
    zmrl train recipes/tiny_cpu.toml --set run.steps=4 --set run.dir=runs/quick
    zmrl train recipes/tiny_cpu.toml --resume runs/tiny_cpu --set run.steps=60
    zmrl train recipes/k31_lora_gpu.toml --dry-run                     # validate a recipe anywhere

Runs on-policy RL (GRPO/RLOO advantages, PPO-clip on LoRA parameters) with the rollout/trainer
mismatch checked bit for bit at every step: mismatch/logprob_abs_diff_max, mismatch/tokens_different,
mismatch/kl and mismatch/ratio_first_minibatch_max_abs_dev are exactly 0; in strict mode (default) a
non-zero value stops the run naming step, sequence and token. Writes RUN_DIR/config.toml (the
resolved config), metrics.jsonl, checkpoints/ and wandb/ (offline). `--set` overrides are dotted
recipe keys with TOML values, type-checked. `--dry-run` validates the recipe, prints the resolved
config and what the run would read or create, and starts nothing.

A run dir is locked while a run uses it (a second run into it is refused; the lock of a killed
run is taken over). A run that stopped before its first checkpoint is started over by a plain
`zmrl train` (or by --resume); --resume continues from the newest intact checkpoint, naming any
damaged one it skips, and refuses a base model whose weights differ from the run's.

Exit status: 0 done, 2 bad input or an environment problem (recipe, files, run dir, disk full; one
line, the run dir left resumable), 3 mismatch (strict), 4 reward function error, 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="run RL on a recipe (rollout/trainer KL checked == 0 every step)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe TOML file (recipes/*.toml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set trainer.lr=1e-4 (repeatable)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved config; run nothing")
    return p


def dry_run(cfg, resume: bool = False) -> tuple[list[str], str | None]:
    """What the run would read or create, one line each (nothing written), and the reason the real
    run would refuse to start (None if it would start)."""
    from pathlib import Path

    from zmrl.data.rewards import RewardError, resolve

    lines, refusal = [], None
    model = Path(cfg.model.path)
    if (model / "config.json").is_file():
        from zmrl.model.checkpoint import read_config

        try:
            model_cfg = read_config(model)
        except (ValueError, TypeError) as e:
            return lines, f"model.path: {model / 'config.json'} is not a valid model config: {e}"
        if (model / "model.safetensors").is_file():
            from zmrl.model.checkpoint import check_model_dir

            try:
                check_model_dir(model)
            except (ValueError, FileNotFoundError) as e:
                return lines, f"model.path: {e}"
        tok = "with tokenizer.json" if (model / "tokenizer.json").is_file() else "WITHOUT tokenizer.json (needed)"
        lines.append(f"model: {model} found, {tok}")
        from zmrl.lora.adapter import factor_shapes
        from zmrl.rl.engines import lora_config

        shapes = factor_shapes(model_cfg, lora_config(cfg))
        count = sum(a[0] * a[1] * (a[2] if len(a) > 2 else 1) + b[0] * b[1] * (b[2] if len(b) > 2 else 1)
                    for a, b in shapes.values())
        lines.append(f"lora: rank {cfg.lora.r} on {len(shapes)} weights in {model_cfg.num_hidden_layers} layer(s) "
                     f"({model_cfg.n_routed_experts} routed experts each), {count:,} trainable parameters")
    elif cfg.model.init_preset:
        lines.append(f"model: {model} absent; would be created by `zmrl init-model --preset {cfg.model.init_preset}`")
    else:
        lines.append(f"model: {model} not found on this machine (needed at run time)")
    data = Path(cfg.data.path)
    if data.is_file():
        lines.append(f"data: {data} found")
    elif cfg.data.generate:
        lines.append(f"data: {data} absent; would be generated ({cfg.data.generate}, {cfg.data.generate_size} rows)")
    else:
        lines.append(f"data: {data} not found on this machine (needed at run time, or a hub name when online)")
    try:
        resolve(cfg.reward.function)
        lines.append(f"reward: {cfg.reward.function} resolves")
    except RewardError as e:
        lines.append(f"reward: {e}")
    import importlib.util

    for side, module in (("rollout", f"zmrl.rollout.{cfg.rollout.backend}"), ("trainer", f"zmrl.trainer.{cfg.trainer.backend}")):
        found = importlib.util.find_spec(module) is not None
        lines.append(f"{side}: {module} {'present' if found else 'NOT present in this install'}")
    lines.append(f"device: {cfg.run.device} (resolved at start-up; cuda must be present then)")
    batch = cfg.run.prompts_per_step * cfg.rollout.n
    lines.append(f"steps: {cfg.run.steps} x {cfg.run.prompts_per_step} prompts x {cfg.rollout.n} samples = "
                 f"{batch} sequences per step, {cfg.algorithm.num_minibatches} minibatch(es) x {cfg.algorithm.epochs} epoch(s)")
    run_dir = Path(cfg.run.dir)
    if resume or run_dir.exists():
        from zmrl.rl.inputs import RunError
        from zmrl.rl.rundir import check_run_dir

        try:
            if resume and not run_dir.is_dir():
                raise RunError(f"--resume {run_dir}: no such run dir")
            state, _ = check_run_dir(run_dir, resume, cfg.to_dict(), cfg.run.steps)
        except RunError as e:
            return lines, str(e)
        lines.append(f"run dir: {run_dir} " + (f"resumes from {state['path'].name}" if state else "starts at step 1"))
    else:
        lines.append(f"run dir: {run_dir} would be created")
    return lines, refusal


def run(args) -> int:
    from zmrl.config import RecipeError, dump_toml, load_recipe

    overrides = list(args.overrides)
    if args.resume:
        overrides.append(f"run.dir={_toml_string(args.resume)}")
    try:
        cfg = load_recipe(args.recipe, overrides)
    except RecipeError as e:
        return _fail(e)
    print(f"# resolved config ({args.recipe})\n{dump_toml(cfg)}", flush=True)
    if args.dry_run:
        lines, refusal = dry_run(cfg, bool(args.resume))
        for line in lines:
            print(f"# {line}")
        if refusal:
            print(f"# dry run: the run would be refused: {refusal}")
            return _fail(f"the run would be refused: {refusal}")
        print("# dry run: recipe valid, nothing started")
        return 0

    if cfg.run.orchestrator == "verl":
        return _run_verl(cfg, args)

    from zmrl.data.rewards import RewardError
    from zmrl.rl.engines import BackendError
    from zmrl.rl.inputs import RunError
    from zmrl.rl.loop import MismatchError, RLRun

    rl = None
    try:
        rl = RLRun(cfg, resume=bool(args.resume))
        metrics = rl.run()
    except (RunError, BackendError) as e:
        return _fail(e)
    except MismatchError as e:
        return _fail(f"MISMATCH: {e}", 3)
    except RewardError as e:
        return _fail(e, 2 if rl is None else 4)
    except OSError as e:
        return _fail(_os_error(e, rl, cfg.run.dir))
    except KeyboardInterrupt:
        where = "during start-up" if rl is None else f"during {rl.phase}"
        return _fail(f"interrupted {where}; {_resume_hint(cfg.run.dir)}", 130)
    if metrics:
        first, last = metrics[0], metrics[-1]
        print(f"done: steps {rl.step_done - len(metrics) + 1}..{rl.step_done} in {cfg.run.dir}; reward/mean "
              f"{first['reward/mean']:.3f} -> {last['reward/mean']:.3f}; max mismatch/tokens_different "
              f"{max(m['mismatch/tokens_different'] for m in metrics)}; plots: zmrl report {cfg.run.dir}")
    return 0


def _run_verl(cfg, args) -> int:
    """verl's PPO trainer on Ray runs the recipe (zmrl.verl.launch); no zmrl run-dir checkpoints."""
    from zmrl.data.rewards import RewardError
    from zmrl.rl.inputs import RunError

    if args.resume:
        return _fail("--resume: a verl run resumes through verl (trainer.resume_mode), not zmrl's checkpoints")
    try:
        from zmrl.verl.launch import run
    except ImportError as e:
        return _fail(f"run.orchestrator = \"verl\" needs verl and ray (bash scripts/setup.sh installs them): {e}")
    try:
        return run(cfg)
    except (RunError, RewardError) as e:
        return _fail(e)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _fail(message, code: int = 2) -> int:
    print(f"zmrl train: {message}", file=sys.stderr, flush=True)
    return code


def _resume_hint(run_dir: str) -> str:
    from pathlib import Path

    from zmrl.rl import checkpoint

    found = checkpoint.checkpoint_dirs(Path(run_dir))
    if not found:
        return "no checkpoint yet: `zmrl train` starts the run over"
    return f"the latest checkpoint is {found[-1].name}: continue with --resume {run_dir}"


def _os_error(e: OSError, rl, run_dir: str) -> str:
    import errno

    what = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    where = f" writing {e.filename}" if e.filename else ""
    during = f" during {rl.phase}" if rl is not None else ""
    return f"{what}{where}{during}; {_resume_hint(run_dir)}"


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
