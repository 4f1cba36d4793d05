"""The reference trainer: the zmrl model functions (zmrl.model.packed.forward_packed) with the
canonical LoRA (zmrl.lora.LoraProjections), AdamW on fp32 master copies of the LoRA factors.

    from zmrl.lora import LoraConfig
    from zmrl.trainer.reference import ReferenceTrainer
    trainer = ReferenceTrainer.from_dir("runs/tiny-model", LoraConfig(r=8), seed=0)

It runs the very kernels the rollout engines run (zmrl.batch_invariant through zmrl/model), so
`logprobs` equals ReferenceEngine.score and VllmEngine's reported log-probs bit for bit. All the
sequences of a call are packed into one forward: the row-wise kernels are batch-invariant, so a
token's log-prob does not depend on which sequences share the forward.

Device: `from_dir(..., device=)` ("auto", the default: CUDA when present; "cpu"; "cuda") puts the
base weights, the adapter, the fp32 masters and AdamW's state on that device; `logprobs`,
`adapter_tensors` and `state_dict` hand back CPU tensors.
"""
from __future__ import annotations

from pathlib import Path

import torch

from zmrl.lora import LoraAdapter, LoraConfig, save_peft
from zmrl.model.checkpoint import load_checkpoint
from zmrl.model.config import ModelConfig
from zmrl.model.device import resolve_device
from zmrl.model.packed import forward_packed, split_layer_weights
from zmrl.model.logprobs import completion_logprobs, pack_sequences
from zmrl.trainer.base import TrainBatch, Trainer, UpdateSettings, check_trainer_state, lora_spec, state_to_cpu
from zmrl.trainer.ppo import adamw, ppo_update

STATE_FORMAT = "zmrl.trainer.reference/1"


class ReferenceTrainer(Trainer):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], lora: LoraConfig, *, seed: int = 0,
                 device: str | torch.device | None = None):
        """device None: where `weights` already are."""
        self.cfg, self.lora = cfg, lora
        self.device = weights["model.embed_tokens.weight"].device if device is None else resolve_device(device)
        self.weights = {k: v.detach().to(self.device).requires_grad_(False) for k, v in weights.items()}
        self.w_layers = split_layer_weights(cfg, self.weights)
        dtype = self.weights["model.embed_tokens.weight"].dtype
        # initialized on the CPU (one generator, the same factors on every device), then moved
        self.adapter = LoraAdapter(cfg, lora, seed=seed, dtype=dtype).to(self.device)
        self.names = list(self.adapter.factors.keys())
        # AdamW's moments and the accumulated update live in fp32 even for a bf16 adapter; after
        # each step the rounded masters are written into the adapter the forward (and rollout) use
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.adapter.factors.values()]
        self.optimizer = adamw(self.masters)
        self.num_steps = 0

    @classmethod
    def from_dir(cls, model_dir, lora: LoraConfig, *, seed: int = 0, options: dict | None = None,
                 device: str | torch.device = "auto") -> "ReferenceTrainer":
        if options:
            raise ValueError(f"the reference trainer takes no options, got {sorted(options)}")
        cfg, weights = load_checkpoint(model_dir, device=str(resolve_device(device)))
        return cls(cfg, weights, lora, seed=seed)

    # ------------------------------------------------------------------ log-probs
    def _logprobs(self, prompts, completions, temperature: float, adapter: bool) -> list[torch.Tensor]:
        seqs = pack_sequences(prompts, completions)
        projections = self.adapter.projections if adapter else None
        logits = forward_packed(self.cfg, self.weights, self.w_layers, seqs, None, projections)
        return completion_logprobs(logits, prompts, seqs, temperature)

    @torch.no_grad()
    def logprobs(self, prompts, completions, *, temperature: float, adapter: bool = True) -> list[torch.Tensor]:
        return [lp.cpu() for lp in self._logprobs(prompts, completions, temperature, adapter)]

    # ------------------------------------------------------------------ PPO
    def train_step(self, batch: TrainBatch, settings: UpdateSettings, step: int) -> dict[str, float]:
        params = list(self.adapter.factors.values())

        def zero_grads():
            for p in params:
                p.grad = None

        def write_masters():
            with torch.no_grad():
                torch._foreach_copy_(params, self.masters)  # rounds to the adapter's dtype once, here

        metrics, num_updates = ppo_update(
            batch, settings, step, optimizer=self.optimizer, masters=self.masters,
            logprobs=lambda prompts, completions: self._logprobs(prompts, completions, settings.temperature, True),
            zero_grads=zero_grads,
            master_grads=lambda: [torch.zeros_like(m) if p.grad is None else p.grad for m, p in zip(self.masters, params)],
            write_masters=write_masters)
        self.num_steps += num_updates
        return metrics

    # ------------------------------------------------------------------ weights and state
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().cpu() for k, p in self.adapter.factors.items()}

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "num_steps": self.num_steps, "lora": lora_spec(self.lora),
                "adapter": {k: p.detach().cpu().clone() for k, p in self.adapter.factors.items()},
                "masters": {k: m.detach().cpu().clone() for k, m in zip(self.names, self.masters)},
                "optimizer": state_to_cpu(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        check_trainer_state(state, STATE_FORMAT, self.lora,
                            {k: tuple(p.shape) for k, p in self.adapter.factors.items()})
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
