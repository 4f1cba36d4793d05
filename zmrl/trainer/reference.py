"""The reference trainer: the zmrl model functions (zmrl.model.packed.forward_packed) with the
canonical LoRA (zmrl.lora.LoraProjections), AdamW on fp32 master copies of the LoRA factors.

    from zmrl.batch_invariant import batch_invariant_mode
from zmrl.lora import LoraConfig
    from zmrl.trainer.reference import ReferenceTrainer
    trainer = ReferenceTrainer.from_dir("runs/tiny-model", LoraConfig(r=8), seed=0)

It runs the very kernels the rollout engines run (zmrl.batch_invariant through zmrl/model), so
`logprobs` equals ReferenceEngine.score and VllmEngine's reported log-probs bit for bit. All the
sequences of a call are packed into one forward: the row-wise kernels are batch-invariant, so a
token's log-prob does not depend on which sequences share the forward.
"""
from __future__ import annotations

from pathlib import Path

import torch

from zmrl.batch_invariant import batch_invariant_mode
from zmrl.lora import LoraAdapter, LoraConfig, save_peft
from zmrl.model.checkpoint import load_checkpoint
from zmrl.model.config import ModelConfig
from zmrl.model.packed import forward_packed, split_layer_weights
from zmrl.model.logprobs import token_logprobs
from zmrl.trainer.base import TrainBatch, Trainer, UpdateSettings, minibatch_order
from zmrl.trainer.losses import aggregate, kl_estimate, ppo_clip_loss

STATE_FORMAT = "zmrl.trainer.reference/1"


class ReferenceTrainer(Trainer):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], lora: LoraConfig, *, seed: int = 0):
        self.cfg, self.lora = cfg, lora
        self.weights = {k: v.detach().requires_grad_(False) for k, v in weights.items()}
        self.w_layers = split_layer_weights(cfg, self.weights)
        dtype = self.weights["model.embed_tokens.weight"].dtype
        self.adapter = LoraAdapter(cfg, lora, seed=seed, dtype=dtype)
        self.names = list(self.adapter.factors.keys())
        # AdamW's moments and the accumulated update live in fp32 even for a bf16 adapter; after
        # each step the rounded masters are written into the adapter the forward (and rollout) use
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.adapter.factors.values()]
        self.optimizer = torch.optim.AdamW(self.masters, lr=1e-4, foreach=False)
        self.num_steps = 0

    @classmethod
    def from_dir(cls, model_dir, lora: LoraConfig, *, seed: int = 0, options: dict | None = None) -> "ReferenceTrainer":
        if options:
            raise ValueError(f"the reference trainer takes no options, got {sorted(options)}")
        cfg, weights = load_checkpoint(model_dir)
        return cls(cfg, weights, lora, seed=seed)

    # ------------------------------------------------------------------ log-probs
    def _logprobs(self, prompts, completions, temperature: float, adapter: bool) -> list[torch.Tensor]:
        seqs = []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            if not p or not c:
                raise ValueError(f"sequence {i}: empty prompt or completion")
            seqs.append(torch.tensor(list(p) + list(c), dtype=torch.long))
        projections = self.adapter.projections if adapter else None
        logits = forward_packed(self.cfg, self.weights, self.w_layers, seqs, None, projections)
        out = []
        for lg, p, seq in zip(logits, prompts, seqs):
            # row len(p) - 1 + j predicts completion token j (the rollout's convention)
            out.append(token_logprobs(lg[len(p) - 1:len(seq) - 1], seq[len(p):], temperature))
        return out

    @torch.no_grad()
    def logprobs(self, prompts, completions, *, temperature: float, adapter: bool = True) -> list[torch.Tensor]:
        return self._logprobs(prompts, completions, temperature, adapter)

    # ------------------------------------------------------------------ PPO
    def train_step(self, batch: TrainBatch, settings: UpdateSettings, step: int) -> dict[str, float]:
        if settings.kl_coef > 0 and batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the batch's ref_logprobs")
        for group in self.optimizer.param_groups:
            group.update(lr=settings.lr, betas=tuple(settings.betas), eps=settings.eps,
                         weight_decay=settings.weight_decay)
        clip_high = settings.clip_eps if settings.clip_eps_high is None else settings.clip_eps_high
        params = list(self.adapter.factors.values())
        sums = {"loss/policy": 0.0, "loss/kl": 0.0, "loss/total": 0.0, "policy/clip_frac": 0.0,
                "policy/approx_kl_old": 0.0, "policy/grad_norm": 0.0}
        ratio_dev, num_mb = None, 0
        for epoch_mbs in minibatch_order(len(batch), settings, step):
            for idx in epoch_mbs:
                for p in params:
                    p.grad = None
                lps = self._logprobs([batch.prompts[i] for i in idx], [batch.completions[i] for i in idx],
                                     settings.temperature, adapter=True)
                pol, kls, clipped, approx = [], [], [], []
                for lp, i in zip(lps, idx):
                    old = batch.old_logprobs[i]
                    loss, ratio, was_clipped = ppo_clip_loss(lp, old, batch.advantages[i].expand(lp.shape),
                                                             settings.clip_eps, clip_high)
                    pol.append(loss)
                    clipped.append(was_clipped.float())
                    approx.append(kl_estimate(old, lp.detach(), "k3"))
                    if settings.kl_coef > 0:
                        kls.append(kl_estimate(lp, batch.ref_logprobs[i], settings.kl_estimator))
                    if num_mb == 0:  # scored before this train_step's first optimizer step
                        ratio_dev = max(ratio_dev or 0.0, float((ratio.double() - 1.0).abs().max()))
                policy_loss = aggregate(pol, settings.loss_agg)
                kl_loss = aggregate(kls, settings.loss_agg) if kls else torch.zeros(())
                total = policy_loss + settings.kl_coef * kl_loss if kls else policy_loss
                # the backward runs with torch's own aten kernels even when an in-process vLLM has
                # switched the aten overrides on: gradients need no invariance (only the forward's
                # log-probs must match the rollout's), and this keeps the update's bits independent
                # of which rollout backend shares the process (before 7b226a0 the overrides also
                # rejected the float64 reference that sparse MLA's backward recomputes through)
                with batch_invariant_mode(False):
                    total.backward()
                for m, p in zip(self.masters, params):
                    m.grad = torch.zeros_like(m) if p.grad is None else p.grad.float()
                norm = torch.nn.utils.clip_grad_norm_(self.masters, settings.max_grad_norm or float("inf"),
                                                      foreach=False)
                self.optimizer.step()
                with torch.no_grad():
                    for m, p in zip(self.masters, params):
                        p.copy_(m)  # rounds to the adapter's dtype once, here
                    for p in params:
                        p.grad = None
                self.num_steps += 1
                num_mb += 1
                sums["loss/policy"] += float(policy_loss.detach())
                sums["loss/kl"] += float(kl_loss.detach())
                sums["loss/total"] += float(total.detach())
                sums["policy/clip_frac"] += float(aggregate(clipped, "token_mean"))
                sums["policy/approx_kl_old"] += float(aggregate(approx, "token_mean"))
                sums["policy/grad_norm"] += float(norm)
        out = {k: v / num_mb for k, v in sums.items()}
        out.update({"policy/lr": settings.lr, "mismatch/ratio_first_minibatch_max_abs_dev": ratio_dev,
                    "train/num_minibatches": num_mb, "train/num_tokens": batch.num_tokens})
        return out

    # ------------------------------------------------------------------ weights and state
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        return {k: p.detach() for k, p in self.adapter.factors.items()}

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "num_steps": self.num_steps,
                "lora": {"r": self.lora.r, "lora_alpha": self.lora.lora_alpha, "targets": list(self.lora.targets)},
                "adapter": {k: p.detach().clone() for k, p in self.adapter.factors.items()},
                "masters": {k: m.detach().clone() for k, m in zip(self.names, self.masters)},
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"trainer state has format {state.get('format')!r}, expected {STATE_FORMAT!r}")
        want = {"r": self.lora.r, "lora_alpha": self.lora.lora_alpha, "targets": list(self.lora.targets)}
        if state["lora"] != want:
            raise ValueError(f"trainer state was saved with LoRA {state['lora']}, this run uses {want}")
        for part in ("adapter", "masters"):
            own = dict(self.adapter.factors.items())
            got = state[part]
            bad = sorted(set(own) ^ set(got)) + [k for k in own if k in got and got[k].shape != own[k].shape]
            if bad:
                raise ValueError(f"trainer state {part} does not fit this adapter: {bad[:6]}")
        with torch.no_grad():
            for k, p in self.adapter.factors.items():
                p.copy_(state["adapter"][k])
            for k, m in zip(self.names, self.masters):
                m.copy_(state["masters"][k])
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_steps = int(state["num_steps"])

    def save_adapter(self, out: str | Path, base_model_name_or_path: str | None = None) -> Path:
        return save_peft(self.adapter, out, base_model_name_or_path)


TRAINER = ReferenceTrainer
