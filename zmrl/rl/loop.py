"""The RL loop (docs/design.md, "The RL step"). One step:

    prompts (data cursor) -> rollout: n completions per prompt with per-token log-probs
    -> rewards -> group advantages (GRPO / RLOO)
    -> trainer recomputes the sampled tokens' log-probs (adapter on) and the reference policy's (off)
    -> mismatch check: rollout vs trainer, bit for bit (strict: stop before the update)
    -> PPO-clip update of the LoRA factors -> the new factors synced into the rollout in place
    -> metrics (metrics.jsonl, W&B, progress bar) -> checkpoint every run.checkpoint_every steps

    run = RLRun(load_recipe("recipes/tiny_cpu.toml"), resume=False)
    run.run()

Steps count from 1; step s samples with seed f(run.seed, s), so a run resumed from the checkpoint
of step k repeats steps k+1.. exactly (the data cursor, the trainer's adapter / fp32 masters / AdamW
state and the RNG states are in the checkpoint; the rollout gets the adapter by sync).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from zmrl.batch_invariant import raise_failed_checks
from zmrl.config import RunConfig, dump_toml
from zmrl.data.prompts import PromptStream
from zmrl.data.rewards import RewardFn
from zmrl.model.checkpoint import check_model_dir
from zmrl.rl import checkpoint, rundir
from zmrl.rl.checkpoint import write_atomic
from zmrl.rl.engines import build_rollout, build_trainer, run_device
from zmrl.rl.inputs import RunError, Tokenizer, prepare_data, prepare_model
from zmrl.rl.tracking import Tracker, truncate_metrics
from zmrl.trainer.base import TrainBatch, UpdateSettings
from zmrl.trainer.losses import ADVANTAGES, exact_mismatch


class MismatchError(RuntimeError):
    """Rollout and trainer log-probs differ (strict mode); the message names step, sequence, token."""


def step_seed(seed: int, step: int) -> int:
    return (seed * 100_003 + step) % (2**31 - 1)


class RLRun:
    def __init__(self, cfg: RunConfig, *, resume: bool = False):
        self.cfg, self.run_dir = cfg, Path(cfg.run.dir)
        self.config_dict = cfg.to_dict()
        self.tracker = self.trainer = self.rollout = None
        self.phase = "start-up"
        # the device first, so that a missing GPU is reported before anything is created
        self.device = run_device(cfg)
        # 1. the run dir: locked for the run's life before anything is built, then decided
        self.lock = None
        if resume and not self.run_dir.is_dir():
            raise RunError(f"--resume {self.run_dir}: no such run dir")
        self.lock = rundir.RunDirLock.acquire(self.run_dir)
        try:
            self._prepare(resume)
        except BaseException:  # Ctrl-C too: leave the run dir as it was found
            self.close()
            raise

    def _prepare(self, resume: bool) -> None:
        cfg = self.cfg
        if self.lock.stale:
            rundir.say(f"run dir {self.run_dir}: taking over the lock of pid {self.lock.stale.get('pid')}, "
                       f"which is no longer running")
        state, damaged = rundir.check_run_dir(self.run_dir, resume, self.config_dict, cfg.run.steps)
        # 2. inputs (may create the model / dataset the recipe asks for; never touches RUN_DIR)
        self.model_dir = prepare_model(cfg, device=self.device)
        try:
            check_model_dir(self.model_dir)
        except (ValueError, FileNotFoundError) as e:
            raise RunError(f"model.path: {e}") from None
        self.base_fingerprint = rundir.fingerprint(self.model_dir)
        if state is not None and state.get("base_model") is None:
            rundir.say(f"{state['path'].name} records no base-model fingerprint (an older checkpoint): the base "
                       f"weights cannot be verified")
        if state is not None and state.get("base_model") not in (None, self.base_fingerprint):
            raise RunError(f"--resume {self.run_dir}: model.path {self.model_dir} holds other weights than the "
                           f"run started from (base model fingerprint {state['base_model'][:12]} in "
                           f"{state['path'].name}, {self.base_fingerprint[:12]} now); restore that model or "
                           f"start a new run")
        self.tokenizer = Tokenizer(self.model_dir)
        self.data = prepare_data(cfg, self.tokenizer)
        self.reward_fn = RewardFn(cfg.reward.function, cfg.reward.kwargs)
        rundir.check_writable(self.run_dir, "run dir")
        rundir.check_writable(self.run_dir / "checkpoints", "checkpoints dir")
        if cfg.tracking.wandb != "disabled":
            rundir.check_writable(self.run_dir / "wandb", "W&B directory")
        self._set_aside(damaged, state)  # every refusal is behind us: the first change to RUN_DIR
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        # 3. the two sides, on one device
        self.trainer = build_trainer(cfg, self.model_dir, self.device)
        max_len = self.data.max_len + cfg.rollout.max_tokens
        self.rollout = build_rollout(cfg, self.model_dir, max_model_len=-(-max_len // 16) * 16, device=self.device)
        # 4. state
        self.step_done = 0
        cursor = None
        if state is not None:
            self.trainer.load_state_dict(state["trainer"])
            checkpoint.set_rng_states(state["rng"])
            cursor, self.step_done = state["cursor"], int(state["step"])
        self.resume_from = None if state is None else state["path"]
        self.stream = PromptStream(len(self.data.ids), seed=cfg.run.seed, shuffle=cfg.data.shuffle, cursor=cursor)
        self.rollout.sync_adapter(self.trainer.adapter_tensors())
        self.settings = UpdateSettings(
            lr=cfg.trainer.lr, betas=tuple(cfg.trainer.betas), weight_decay=cfg.trainer.weight_decay,
            max_grad_norm=cfg.trainer.max_grad_norm or None, clip_eps=cfg.algorithm.clip_eps,
            clip_eps_high=cfg.algorithm.clip_eps_high, kl_coef=cfg.algorithm.kl_coef,
            kl_estimator=cfg.algorithm.kl_estimator, num_minibatches=cfg.algorithm.num_minibatches,
            epochs=cfg.algorithm.epochs, loss_agg=cfg.algorithm.loss_agg, temperature=cfg.rollout.temperature,
            seed=cfg.run.seed)

    def _set_aside(self, damaged: list[str], state: dict | None) -> None:
        """Damaged checkpoints newer than the one resumed from move to checkpoints/damaged_step_*
        (kept, never deleted; no longer in the way of the checkpoints this run writes)."""
        for line in damaged:
            name = line.split(":")[0]
            aside, n = self.run_dir / "checkpoints" / f"damaged_{name}", 1
            while aside.exists():
                aside, n = aside.with_name(f"damaged_{name}.{n}"), n + 1
            (self.run_dir / "checkpoints" / name).rename(aside)
            rundir.say(f"checkpoint {line}; moved aside to {aside}")
        if state is not None and damaged:
            rundir.say(f"resuming from the newest intact checkpoint, {state['path'].name}")

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        cfg = self.cfg
        n = cfg.rollout.n
        rows = self.stream.take(cfg.run.prompts_per_step)
        prompt_ids = [self.data.ids[r] for r in rows]

        t0 = time.perf_counter()
        samples = self.rollout.generate(prompt_ids, n=n, max_tokens=cfg.rollout.max_tokens,
                                        temperature=cfg.rollout.temperature, seed=step_seed(cfg.run.seed, step))
        t_rollout = time.perf_counter() - t0
        # value checks on a GPU are deferred (no host sync per op): a bad value found while
        # generating must stop the step here, before anything is trained or written
        raise_failed_checks()

        flat = [(i, j, s) for i, group in enumerate(samples) for j, s in enumerate(group)]
        prompts = [prompt_ids[i] for i, _, _ in flat]
        completions = [list(s.token_ids) for _, _, s in flat]
        rollout_lp = [s.logprobs for _, _, s in flat]
        texts = [self.tokenizer.decode(c) for c in completions]
        rewards = torch.tensor([self.reward_fn(t, self.data.rows[rows[i]]) for (i, _, _), t in zip(flat, texts)],
                               dtype=torch.float32).view(len(rows), n)
        advantages = ADVANTAGES[cfg.algorithm.advantage](rewards).view(-1)

        t1 = time.perf_counter()
        temperature = cfg.rollout.temperature
        train_lp = self.trainer.logprobs(prompts, completions, temperature=temperature)
        ref_lp = self.trainer.logprobs(prompts, completions, temperature=temperature, adapter=False)
        mm = exact_mismatch(rollout_lp, train_lp)
        metrics = {"mismatch/logprob_abs_diff_max": mm["logprob_abs_diff_max"],
                   "mismatch/tokens_different": mm["tokens_different"], "mismatch/kl": mm["kl"]}
        if mm["tokens_different"] and cfg.mismatch.strict:
            raise MismatchError(self._report(step, mm, flat, rows, completions))

        batch = TrainBatch(prompts=prompts, completions=completions, old_logprobs=rollout_lp,
                           advantages=advantages, ref_logprobs=ref_lp)
        update = self.trainer.train_step(batch, self.settings, step)
        self.rollout.sync_adapter(self.trainer.adapter_tensors())
        raise_failed_checks()  # before the step's metrics and checkpoint are written
        t_train = time.perf_counter() - t1
        ratio_dev = update.pop("mismatch/ratio_first_minibatch_max_abs_dev")
        metrics["mismatch/ratio_first_minibatch_max_abs_dev"] = ratio_dev
        if ratio_dev and cfg.mismatch.strict:
            raise MismatchError(f"step {step}: the importance ratio of the first minibatch deviates from 1 by "
                                f"{ratio_dev:.3e} although the log-probs matched: the trainer's training "
                                f"forward differs from its scoring forward")

        lp_policy, lp_ref = torch.cat(train_lp).double(), torch.cat(ref_lp).double()
        num_tokens = sum(len(c) for c in completions)
        metrics.update({
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "reward/full_credit_frac": float((rewards >= 1.0).float().mean()),
            "policy/kl_ref": float((lp_policy - lp_ref).mean()),
            **update,
            "response/length_mean": num_tokens / len(completions),
            "response/stop_frac": sum(s.finish_reason == "stop" for _, _, s in flat) / len(flat),
            **self.rollout.stats(),
            "time/rollout_s": t_rollout, "time/train_s": t_train,
            "throughput/tokens_per_s": num_tokens / max(t_rollout + t_train, 1e-9),
        })
        self.last_texts = [(self.data.texts[rows[i]], t, float(r)) for (i, _, _), t, r in
                           zip(flat, texts, rewards.view(-1))]
        return metrics

    def _report(self, step, mm, flat, rows, completions) -> str:
        seq, tok, a, b = mm["first"]
        i, j, _ = flat[seq]
        token_id = completions[seq][tok]
        return (f"step {step}: rollout and trainer log-probs differ at {mm['tokens_different']} of "
                f"{mm['num_tokens']} tokens (max |diff| {mm['logprob_abs_diff_max']:.3e}, kl {mm['kl']:.3e}); "
                f"first at sequence {seq} (prompt {i} = dataset row {rows[i]} {self.data.texts[rows[i]]!r}, "
                f"sample {j}), completion token {tok} (id {token_id} {self.tokenizer.decode([token_id])!r}): "
                f"rollout {a!r} vs trainer {b!r}. Stopped before the update; the checkpoints in "
                f"{self.run_dir} are untouched (mismatch.strict = false logs and continues).")

    # ------------------------------------------------------------------ the run
    def _open(self) -> None:
        write_atomic(self.run_dir / "config.toml", dump_toml(self.cfg))
        # steps after the checkpoint (or all of them, restarting) are about to be run again
        truncate_metrics(self.run_dir, self.step_done)
        t = self.cfg.tracking
        self.tracker = Tracker(self.run_dir, self.config_dict, wandb_mode=t.wandb, project=t.project, name=t.name,
                               total_steps=self.cfg.run.steps, first_step=self.step_done,
                               progress=self.cfg.run.progress)

    def save(self, step: int) -> Path:
        return checkpoint.save(self.run_dir, step, self.trainer, self.stream.cursor, self.config_dict,
                               keep=self.cfg.run.keep_checkpoints, base_model=self.model_dir,
                               base_fingerprint=self.base_fingerprint)

    def run(self) -> list[dict]:
        """Runs steps step_done+1 .. run.steps; -> their metrics."""
        self._open()
        every, last = self.cfg.run.checkpoint_every, self.cfg.run.steps
        out = []
        try:
            for step in range(self.step_done + 1, last + 1):
                self.phase = f"step {step}"  # for an error message (disk full, Ctrl-C)
                metrics = self.step(step)
                self.tracker.log(step, metrics)
                out.append(metrics)
                self.step_done = step
                if step == last or (every and step % every == 0):
                    self.phase = f"the checkpoint of step {step}"
                    self.save(step)
        finally:
            self.close()
        return out

    def close(self) -> None:
        try:
            if self.tracker is not None:
                self.tracker.close()
                self.tracker = None
            if self.rollout is not None:
                self.rollout.close()
                self.rollout = None
            close_trainer = getattr(self.trainer, "close", None)  # trainer ranks in their own processes
            if close_trainer is not None:
                close_trainer()
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None
