"""zmrl's Megatron trainer behind verl's training-engine interface (actor and reference).

verl builds it for `actor_rollout_ref.model.model_type=zmrl` with `actor.strategy=megatron`
(verl's own Megatron engine needs Megatron-Bridge, which has no zmrl model; this one runs
zmrl.trainer.megatron.MegatronTrainer, the object `zmrl train` uses):

    python -m verl.trainer.main_ppo --config-path=$(python -c 'import zmrl.verl.config as c; print(c.DIR)') \
        --config-name=zmrl_ppo actor_rollout_ref.model.path=runs/models/tiny ...

What verl gets from it, and how each maps onto the trainer:
- log-probs (`infer_batch`, `forward_backward_batch`): every micro-batch's sequences go through
  the trainer's packed forward and zmrl.model.logprobs (log_softmax(logits / T)[token] through
  zmrl.batch_invariant), so the log-prob of each response token has the bits the rollout
  reported. verl's layout: one value per input position, position t scoring token t + 1 (the
  prompt's positions and the last one hold 0 and carry no loss).
- entropy (metrics, entropy bonus): plain torch over the same logits; no contract compares it.
- backward and optimizer step: verl's loss function (PPO-clip etc.) on those log-probs; the
  backward on torch's own kernels (gradients need determinism, not batch invariance), then the
  LoRA gradient in the canonical adapter layout, clipping and AdamW on fp32 masters, rounded once
  into the factors the forward multiplies by (as zmrl.trainer.ppo does).
- weights for the rollout (`get_per_tensor_param`), in the two kinds verl's hybrid worker sends:
  base_sync_done=False, the base weights under their checkpoint names; True, the adapter's
  factors under their PEFT names and layouts with the PEFT config (what verl's Megatron engine
  sends for a non-merged LoRA). zmrl's worker extension (zmrl.verl.worker) lands them in zmrl's
  own canonical LoraAdapter, never vLLM's native LoRA.
- reference policy: `disable_adapter()` (verl's ref-in-actor for LoRA) scores with the adapter off.

Parallelism: the trainer runs TP ranks only (world size = tensor_model_parallel_size, experts
split over the same ranks); data, pipeline and context parallelism are refused by name.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.workers.engine import BaseEngine, EngineRegistry
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from zmrl.batch_invariant import batch_invariant_mode
from zmrl.lora import DEFAULT_TARGETS, LoraConfig, peft_tensors
from zmrl.lora.peft_io import peft_config
from zmrl.model.logprobs import completion_logprobs
from zmrl.trainer.ppo import clip_onto_masters

RATIO_METRIC = "mismatch/ratio_first_minibatch_max_abs_dev"
"""Reported by the micro-batches of an update's first mini-batch (verl logs it as actor/...)."""
MODEL_TYPE = "zmrl"
"""actor_rollout_ref.model.model_type that selects this engine."""
STATE_FILE = "zmrl_trainer_state.pt"


class ZmrlEngineError(ValueError):
    """A verl setting this engine cannot honour; the message names it."""


def lora_config_of(model_config) -> LoraConfig:
    """verl's model.lora_rank / lora_alpha / target_modules -> zmrl's LoraConfig ("all-linear":
    every attention projection and expert, zmrl.lora.DEFAULT_TARGETS)."""
    rank = int(model_config.lora_rank or 0)
    if rank < 1:
        raise ZmrlEngineError("actor_rollout_ref.model.lora_rank must be >= 1: zmrl's engine trains a LoRA "
                              "(the base weights stay frozen)")
    targets = model_config.target_modules
    targets = list(DEFAULT_TARGETS) if targets in (None, "all-linear") else list(targets)
    try:
        return LoraConfig(r=rank, lora_alpha=float(model_config.lora_alpha), targets=targets)
    except ValueError as e:
        raise ZmrlEngineError(f"actor_rollout_ref.model LoRA settings: {e}") from None


def check_engine_config(engine_config, optimizer_config) -> None:
    """Refuse, by name, the settings of verl's Megatron engine config this engine does not implement."""
    for name in ("pipeline_model_parallel_size", "context_parallel_size"):
        if int(getattr(engine_config, name, 1) or 1) != 1:
            raise ZmrlEngineError(f"actor.megatron.{name}={getattr(engine_config, name)}: zmrl's trainer runs "
                                  f"tensor parallelism only (set it to 1)")
    ep = getattr(engine_config, "expert_model_parallel_size", 1)
    tp = int(engine_config.tensor_model_parallel_size)
    if ep not in (1, tp):
        raise ZmrlEngineError(f"actor.megatron.expert_model_parallel_size={ep}: zmrl splits the experts over the "
                              f"tensor-parallel ranks (leave it 1 or set it to {tp})")
    if engine_config.param_offload or engine_config.optimizer_offload:
        raise ZmrlEngineError("actor.megatron.param_offload / optimizer_offload: not supported by zmrl's engine")
    if optimizer_config is None:
        return
    if optimizer_config.optimizer not in ("adam", "adamw"):
        raise ZmrlEngineError(f"actor.optim.optimizer={optimizer_config.optimizer!r}: zmrl's trainer steps AdamW")
    warmup = (optimizer_config.lr_warmup_steps or 0) > 0 or (optimizer_config.lr_warmup_steps_ratio or 0) > 0
    if optimizer_config.lr_decay_style != "constant" or warmup:
        raise ZmrlEngineError("actor.optim: zmrl's engine keeps a constant learning rate (lr_decay_style=constant, "
                              "no warm-up)")


class ZmrlMegatronEngine(BaseEngine):
    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__()
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        check_engine_config(engine_config, None if engine_config.forward_only else optimizer_config)
        self.lora = lora_config_of(model_config)
        self.trainer = None
        self.mode = None
        self._adapter_on = True
        self._dp_group = None
        self._before_first_step = False  # scored old log-probs, no optimizer step since

    # ------------------------------------------------------------------ set-up
    def initialize(self):
        from zmrl.trainer.megatron import MegatronTrainer

        device = get_device_name()
        options = {"tensor_parallel": int(self.engine_config.tensor_model_parallel_size)}
        try:
            self.trainer = MegatronTrainer.from_dir(self.model_config.local_path, self.lora,
                                                    seed=int(self.engine_config.seed), options=options,
                                                    device="cuda" if device == "cuda" else "cpu")
        except ValueError as e:
            raise ZmrlEngineError(f"zmrl engine for {self.model_config.local_path}: {e}") from None
        opt = self.optimizer_config
        if opt is not None and not self.engine_config.forward_only:
            for group in self.trainer.optimizer.param_groups:
                group.update(lr=float(opt.lr), betas=tuple(float(b) for b in opt.betas),
                             weight_decay=float(opt.weight_decay))
        world = torch.distributed.get_world_size()
        if world > 1:
            # DP = 1: every rank is its own data-parallel group (each new_group call is collective)
            groups = [torch.distributed.new_group([r]) for r in range(world)]
            self._dp_group = groups[torch.distributed.get_rank()]

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if model or optimizer:
            raise ZmrlEngineError(f"moving zmrl's trainer to {device!r}: offloading is not supported")

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_size(self):
        return 1

    def get_data_parallel_group(self):
        return self._dp_group

    def is_mp_src_rank_with_outputs(self):
        # asked before initialize(); the world is the TP group, whose rank 0 holds the outputs
        return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0

    @contextlib.contextmanager
    def disable_adapter(self):
        self._adapter_on = False
        try:
            yield
        finally:
            self._adapter_on = True

    # ------------------------------------------------------------------ forward / backward
    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False):
        mask = data["loss_mask"]
        tu.assign_non_tensor(data, batch_num_tokens=int((mask.values() if mask.is_nested else mask).sum()))
        tu.assign_non_tensor(data, dp_size=1)
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=self._dp_group, same_micro_num_in_dp=True)
        outputs = []
        for mb in micro_batches:
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                model_output = self._forward(mb)
                if loss_function is not None:
                    loss, metrics = loss_function(model_output=model_output, data=mb, dp_group=self._dp_group)
                else:
                    if not forward_only:
                        raise ZmrlEngineError("a training pass needs a loss function")
                    loss, metrics = torch.zeros(()), {}
            if forward_only and self._adapter_on:
                self._before_first_step = True
            if not forward_only and self._before_first_step and "old_log_probs" in mb.keys():
                from verl.utils.metric import AggregationType, Metric

                metrics = {**metrics, RATIO_METRIC: Metric(AggregationType.MAX, self._ratio_deviation(model_output, mb))}
            if not forward_only:
                # torch's own kernels for the backward, as zmrl.trainer.ppo runs it: the gradient
                # needs determinism only, and its bits then do not depend on the rollout backend
                with batch_invariant_mode(False):
                    loss.backward()
            outputs.append({"model_output": {k: v.detach() for k, v in model_output.items()},
                            "loss": float(loss.detach()), "metrics": metrics})
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    @staticmethod
    def _ratio_deviation(model_output, mb) -> float:
        """max |exp(new - old) - 1| over the micro-batch's response tokens: exactly 0 before the
        update's first optimizer step when the old log-probs are the trainer's own (verl's) or the
        rollout's (equal to them bit for bit)."""
        from verl.workers.utils.padding import response_from_nested

        new = response_from_nested(model_output["log_probs"].detach(), mb["response_mask"]).unbind()
        worst = 0.0
        for lp, old, m in zip(new, mb["old_log_probs"].unbind(), mb["response_mask"].unbind()):
            ratio = torch.exp(lp.double() - old.to(lp.device).double())[m.to(lp.device).bool()]
            if ratio.numel():
                worst = max(worst, float((ratio - 1.0).abs().max()))
        return worst

    def _forward(self, mb: TensorDict) -> dict[str, torch.Tensor]:
        """One micro-batch -> {"log_probs": nested [B, L_i], "entropy": nested [B, L_i] (when asked)}."""
        input_ids, responses = mb["input_ids"], mb["responses"]
        seqs = [s.to(self.trainer.device) for s in input_ids.unbind()]
        response_lens = [int(n) for n in (responses.offsets().diff() if responses.is_nested
                                          else torch.tensor([responses.shape[1]] * len(seqs)))]
        prompts = [s[: len(s) - n] for s, n in zip(seqs, response_lens)]
        if any(len(p) == 0 or n == 0 for p, n in zip(prompts, response_lens)):
            raise ZmrlEngineError("every sample needs a non-empty prompt and response")
        temperature = _one_temperature(mb["temperature"])
        logits = self.trainer.logits(seqs, adapter=self._adapter_on)
        lps = completion_logprobs(logits, prompts, seqs, temperature)
        device = lps[0].device
        full = [torch.cat([lp.new_zeros(len(p) - 1), lp, lp.new_zeros(1)]) for p, lp in zip(prompts, lps)]
        offsets = input_ids.offsets().to(device)
        out = {"log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(full), offsets=offsets)}
        if tu.get_non_tensor_data(mb, key="calculate_entropy", default=False):
            t = temperature if temperature > 0 else 1.0
            ent = []
            for lg in logits:
                x = lg.float() / t
                logp = torch.log_softmax(x, -1)
                ent.append(-(logp.exp() * logp).sum(-1))
            out["entropy"] = torch.nested.nested_tensor_from_jagged(torch.cat(ent).to(device), offsets=offsets)
        return out

    # ------------------------------------------------------------------ optimizer
    def optimizer_zero_grad(self):
        for p in self.trainer.params.values():
            p.grad = None

    def optimizer_step(self):
        # the trainer's own update pieces, in zmrl.trainer.ppo's order: the LoRA gradient in the
        # canonical adapter layout onto the fp32 masters, clip, AdamW, round once into the factors
        trainer = self.trainer
        clip = self.optimizer_config.clip_grad
        norm = clip_onto_masters(trainer.masters, trainer._master_grads(), float(clip) if clip else None)
        if not torch.isfinite(norm):
            raise FloatingPointError(f"the LoRA gradient norm is {float(norm)}: the update is not taken")
        trainer.optimizer.step()
        trainer._write_masters()
        trainer.num_steps += 1
        self._before_first_step = False
        self.optimizer_zero_grad()
        return float(norm)

    def lr_scheduler_step(self):
        return float(self.trainer.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ weights for the rollout
    def get_per_tensor_param(self, layered_summon: bool = False, base_sync_done: bool = False, **kwargs):
        config = peft_config(self.lora, self.model_config.local_path)
        if base_sync_done:
            tensors = peft_tensors(self.trainer.adapter())  # every TP rank takes part in the gather
        else:
            tensors = self.trainer.hf_state_dict()
        return iter(list(tensors.items())), config

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        if hdfs_path:
            raise ZmrlEngineError("checkpoint to HDFS: not supported by zmrl's engine")
        state = self.trainer.state_dict()  # every rank takes part in the gathers
        self.trainer.save_adapter(Path(local_path) / "lora_adapter", self.model_config.local_path)
        if self.trainer.layout.rank == 0:
            path = Path(local_path) / STATE_FILE
            tmp = path.with_name(path.name + ".tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)  # a crash mid-write never leaves a cut state file

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        path = Path(local_path) / STATE_FILE
        if not path.is_file():
            raise ZmrlEngineError(f"{local_path} holds no {STATE_FILE}: not a checkpoint of zmrl's engine")
        self.trainer.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))


def _one_temperature(value) -> float:
    """The batch's sampling temperature: one value (zmrl's log-prob convention divides by one T)."""
    if isinstance(value, torch.Tensor):
        flat = value.values() if value.is_nested else value.reshape(-1)
        if flat.numel() == 0 or not bool((flat == flat[0]).all()):
            raise ZmrlEngineError("the samples of one batch must share one temperature")
        return float(flat[0])
    return float(value)


class _ModeCtx:
    """verl's train/eval mode switch (no offloading: the trainer stays where it was built)."""

    def __init__(self, engine: ZmrlMegatronEngine, mode: str, **kwargs):
        self.engine, self.mode = engine, mode

    def __enter__(self):
        self.engine.mode = self.mode
        (self.engine.trainer.model.train if self.mode == "train" else self.engine.trainer.model.eval)()

    def __exit__(self, *exc):
        self.engine.trainer.model.eval()
        self.engine.mode = None


def register() -> None:
    """Register the engine with verl for CPU and CUDA (idempotent: verl loads plugins once per
    process, a test may call it again)."""
    registered = EngineRegistry._engines.get(MODEL_TYPE, {}).get("megatron", {})
    for device in ("cpu", "cuda"):
        if registered.get(device) is not ZmrlMegatronEngine:
            EngineRegistry.register(model_type=MODEL_TYPE, backend="megatron", device=device)(ZmrlMegatronEngine)


register()
