"""The trainer API the RL loop calls; every trainer backend (reference, megatron) implements it.

    trainer = ReferenceTrainer.from_dir("runs/tiny-model", LoraConfig(r=8), seed=0)
    lp = trainer.logprobs(prompts, completions, temperature=1.0)                 # policy (adapter on)
    ref = trainer.logprobs(prompts, completions, temperature=1.0, adapter=False)  # reference policy
    metrics = trainer.train_step(TrainBatch(prompts, completions, old_logprobs, advantages, ref),
                                 UpdateSettings(clip_eps=0.2, kl_coef=0.0), step=0)
    rollout_side_sync(trainer.adapter_tensors())     # keys: LoraAdapter.factors ("lora:" + key for VllmEngine)

Backends: module zmrl.trainer.<backend> exposes `TRAINER`, a Trainer subclass; the loop builds it with
`TRAINER.from_dir(model_dir, lora_config, seed=..., options=...)` (imported only when chosen).

Contract (what makes rollout/trainer KL exactly 0):
- `logprobs` follows zmrl.rollout.sample.token_logprobs' convention: log_softmax(logits.float() / T)
  [token] in fp32 through zmrl.batch_invariant, row i of the completion predicted by the full
  sequence's forward at position len(prompt) - 1 + i. The rollout reports the same bits.
- The adapter is the canonical unmerged LoRA (zmrl.lora) in the model's dtype; the optimizer keeps
  fp32 master copies and writes the rounded values back into the adapter after each step, so the
  tensors handed to the rollout are exactly the ones the trainer's forward uses.
- The first minibatch of the first epoch is scored by the trainer *before* any optimizer step of
  this train_step, so its importance ratio exp(new - old) is exactly 1 when old came from the rollout
  and there is no mismatch: `mismatch/ratio_first_minibatch_max_abs_dev` reports max |ratio - 1|.
- Deterministic: the same state, batch, settings and step give the same bits.

Metric keys returned by train_step (slash-namespaced, stable): loss/policy, loss/kl, loss/total,
policy/clip_frac, policy/approx_kl_old, policy/grad_norm, policy/lr,
mismatch/ratio_first_minibatch_max_abs_dev, train/num_minibatches, train/num_tokens.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

import torch

from zmrl.lora import LoraConfig
from zmrl.model.config import ModelConfig

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean")


@dataclass(kw_only=True)
class TrainBatch:
    """N sequences (prompt + completion) with their rollout log-probs and advantages."""

    prompts: list[list[int]]
    """N prompts' token ids."""
    completions: list[list[int]]
    """N completions' token ids (each non-empty)."""
    old_logprobs: list[torch.Tensor]
    """N fp32 [L_i]: the behaviour policy's log-probs (the rollout's; bitwise the trainer's)."""
    advantages: torch.Tensor
    """fp32 [N]: one advantage per sequence, broadcast over its tokens."""
    ref_logprobs: list[torch.Tensor] | None = None
    """N fp32 [L_i]: the reference policy's (adapter off); needed when kl_coef > 0."""

    def __post_init__(self):
        n = len(self.prompts)
        if not (len(self.completions) == len(self.old_logprobs) == n == int(self.advantages.numel())):
            raise ValueError(f"batch fields disagree in length: {n} prompts, {len(self.completions)} completions, "
                             f"{len(self.old_logprobs)} old_logprobs, {int(self.advantages.numel())} advantages")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"{len(self.ref_logprobs)} ref_logprobs for {n} sequences")
        for i, (c, lp) in enumerate(zip(self.completions, self.old_logprobs)):
            if not c or len(c) != lp.numel():
                raise ValueError(f"sequence {i}: {len(c)} completion tokens but {lp.numel()} old log-probs")
        for i, (c, lp) in enumerate(zip(self.completions, self.ref_logprobs or [])):
            if len(c) != lp.numel():
                raise ValueError(f"sequence {i}: {len(c)} completion tokens but {lp.numel()} reference log-probs")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completions)


@dataclass(kw_only=True)
class UpdateSettings:
    """PPO-clip hyperparameters for one train_step (the loop maps its config onto these)."""

    lr: float = 1e-4
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    """Ratio clip range [1 - clip_eps, 1 + clip_eps]."""
    clip_eps_high: float | None = None
    """Upper clip (DAPO's clip-higher); None: same as clip_eps."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference penalty in the loss (0: off; ref_logprobs not needed)."""
    kl_estimator: str = "k3"
    """k1 (log r), k2 (0.5 log^2 r) or k3 (r - 1 - log r, r = p_ref / p), per token."""
    num_minibatches: int = 1
    """Optimizer steps per epoch; the batch's sequences are split into this many contiguous groups."""
    epochs: int = 1
    """Passes over the batch; epochs after the first visit minibatches in a seeded shuffled order."""
    max_grad_norm: float | None = 1.0
    """Clip the adapter gradient's global L2 norm (None: no clipping)."""
    loss_agg: str = "token_mean"
    """token_mean: mean over all tokens of the minibatch; seq_mean_token_mean: mean over sequences
    of each sequence's token mean."""
    temperature: float = 1.0
    """Sampling temperature of the rollout (log-probs are of logits / T)."""
    seed: int = 0
    """Seeds the minibatch order of epochs after the first (mixed with the step number)."""

    @property
    def clip_high(self) -> float:
        """The upper clip range: clip_eps_high, or clip_eps where that is None."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    def __post_init__(self):
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {self.loss_agg!r}")
        if self.num_minibatches < 1 or self.epochs < 1:
            raise ValueError(f"num_minibatches and epochs must be >= 1, got {self.num_minibatches}, {self.epochs}")
        if not self.clip_eps > 0 or (self.clip_eps_high is not None and not self.clip_eps_high > 0):
            raise ValueError("clip_eps (and clip_eps_high) must be > 0")


def minibatch_order(num_sequences: int, settings: UpdateSettings, step: int) -> list[list[list[int]]]:
    """[epoch][minibatch] -> sequence indices. Epoch 0 is in batch order (so the first minibatch is
    the one the mismatch metric reports on); later epochs are shuffled by a generator seeded from
    (settings.seed, step, epoch). Every backend must use this order, so backends agree."""
    if settings.num_minibatches > num_sequences:
        raise ValueError(f"num_minibatches={settings.num_minibatches} exceeds the batch's {num_sequences} sequences")
    out = []
    for epoch in range(settings.epochs):
        if epoch == 0:
            perm = list(range(num_sequences))
        else:
            gen = torch.Generator().manual_seed((settings.seed * 1_000_003 + step * 1009 + epoch) % (2**31 - 1))
            perm = torch.randperm(num_sequences, generator=gen).tolist()
        bounds = [num_sequences * k // settings.num_minibatches for k in range(settings.num_minibatches + 1)]
        out.append([perm[bounds[k]:bounds[k + 1]] for k in range(settings.num_minibatches)])
    return out


class Trainer(abc.ABC):
    """A policy = frozen base model + trainable canonical LoRA, with AdamW over the LoRA factors."""

    cfg: ModelConfig
    lora: LoraConfig

    @classmethod
    @abc.abstractmethod
    def from_dir(cls, model_dir: str | Path, lora: LoraConfig, *, seed: int = 0,
                 options: dict | None = None) -> "Trainer":
        """Load the base checkpoint (zmrl.model.checkpoint layout) and create a fresh adapter,
        initialized exactly as zmrl.lora.LoraAdapter(cfg, lora, seed=seed, dtype=<checkpoint dtype>)
        (so every backend starts from the same bits). options: backend-specific settings (the loop
        passes the recipe's [trainer.options] table); unknown keys must raise naming the key.
        The loop constructs backend "X" as zmrl.trainer.X.TRAINER.from_dir(...)."""

    @abc.abstractmethod
    def logprobs(self, prompts: list[list[int]], completions: list[list[int]], *, temperature: float,
                 adapter: bool = True) -> list[torch.Tensor]:
        """-> one fp32 [len(completion)] tensor per sequence, no gradient. adapter=False: the
        reference policy (the base model, adapter disabled)."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, settings: UpdateSettings, step: int) -> dict[str, float]:
        """PPO-clip over settings.epochs x settings.num_minibatches optimizer steps (order from
        `minibatch_order`); -> the metrics listed in this module's docstring (means over minibatches,
        except mismatch/ratio_first_minibatch_max_abs_dev, from the very first minibatch)."""

    @abc.abstractmethod
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's factors in the model dtype, keyed as zmrl.lora.LoraAdapter.factors
        ("layers_{i}__{target with . -> __}__{A|B}"): what rollout engines sync in place
        (VllmEngine.sync_weights sends them as "lora:" + key). Detached; may alias live tensors."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Everything needed to continue bitwise: adapter factors, fp32 masters, AdamW state,
        number of optimizer steps taken. Tensors on CPU; torch.save-able."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore from state_dict(); raises naming any tensor that does not fit."""

    @abc.abstractmethod
    def save_adapter(self, out: str | Path, base_model_name_or_path: str | None = None) -> Path:
        """Write the adapter in PEFT format (adapter_config.json + adapter_model.safetensors)."""


def state_to_cpu(obj):
    """A state (nested dicts / lists of tensors, e.g. an optimizer's state_dict) with every tensor
    copied to the CPU, so a checkpoint written on a GPU loads anywhere."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: state_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [state_to_cpu(v) for v in obj]
    return obj


def lora_spec(lora: LoraConfig) -> dict:
    """What a saved trainer state records of its adapter's configuration."""
    return {"r": lora.r, "lora_alpha": lora.lora_alpha, "targets": list(lora.targets)}


def check_trainer_state(state: dict, state_format: str, lora: LoraConfig,
                        shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise naming what does not fit before anything is restored: the format, the LoRA
    configuration, and every adapter / master tensor missing, extra or of another shape."""
    if state.get("format") != state_format:
        raise ValueError(f"trainer state has format {state.get('format')!r}, expected {state_format!r}")
    want = lora_spec(lora)
    if state["lora"] != want:
        raise ValueError(f"trainer state was saved with LoRA {state['lora']}, this run uses {want}")
    for part in ("adapter", "masters"):
        got = state[part]
        bad = sorted(set(shapes) ^ set(got)) + [k for k in shapes if k in got and
                                                tuple(got[k].shape) != tuple(shapes[k])]
        if bad:
            raise ValueError(f"trainer state {part} does not fit this adapter: {bad[:6]}")
