"""The loop's two sides, built from the config: a rollout (vllm | reference) and a trainer
(megatron | reference), each imported only when chosen, on the device `run.device` names
(`run_device`: auto = CUDA when present).

A rollout side holds its own copy of the adapter (same LoraConfig, factors synced from the
trainer after every update) and exposes generate / sync_adapter / sync_base_weights.
"""
from __future__ import annotations

import importlib
import os

import torch

from zmrl.lora import LoraAdapter, LoraConfig


class BackendError(RuntimeError):
    """A backend that is missing or not installed; the message says what to do."""


def lora_config(cfg) -> LoraConfig:
    from zmrl.lora import DEFAULT_TARGETS

    targets = list(cfg.lora.targets) if cfg.lora.targets is not None else list(DEFAULT_TARGETS)
    return LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, targets=targets)


def run_device(cfg) -> torch.device:
    """run.device resolved (auto: CUDA when present); a clear error when cuda is asked for and absent."""
    from zmrl.model.device import resolve_device

    try:
        return resolve_device(cfg.run.device)
    except ValueError as e:
        raise BackendError(f"run.device: {e}") from None


def build_trainer(cfg, model_dir: str, device: torch.device | None = None):
    device = run_device(cfg) if device is None else device
    backend = cfg.trainer.backend
    try:
        module = importlib.import_module(f"zmrl.trainer.{backend}")
        trainer_cls = module.TRAINER  # megatron imports megatron.core here, on first access
    except ModuleNotFoundError as e:
        if e.name == f"zmrl.trainer.{backend}":
            raise BackendError(f"trainer.backend = {backend!r}: there is no zmrl.trainer.{backend}; "
                               f"choose \"megatron\" or \"reference\"") from None
        if e.name and e.name.split(".")[0] == "megatron":
            raise BackendError(f"trainer.backend = {backend!r} needs megatron-core: pip install 'zmrl[cpu]' "
                               f"(or megatron-core==0.16.1)") from None
        raise
    options = dict(cfg.trainer.options)
    try:
        from zmrl.rl.launcher import TrainerRanks, world_size

        check = getattr(trainer_cls, "check_options", None)
        if check is not None:
            # checked here first, so a bad option fails before any process starts
            check(model_dir, options)
        if world_size(options) > 1:
            # one process per rank, driven from here (zmrl.rl.launcher)
            return TrainerRanks(backend, model_dir, lora_config(cfg), seed=cfg.lora.seed, options=options,
                                num_threads=cfg.run.num_threads, device=str(device or "cpu"))
        return trainer_cls.from_dir(model_dir, lora_config(cfg), seed=cfg.lora.seed, options=options, device=device)
    except ValueError as e:  # options or LoRA targets that do not fit the backend or the model
        raise BackendError(f"trainer.backend = {backend!r}: {e}") from None


class ReferenceRollout:
    """zmrl.rollout.reference.ReferenceEngine with its own adapter copy (the oracle; slow)."""

    def __init__(self, model_dir: str, lora: LoraConfig, device: torch.device | str = "cpu"):
        from zmrl.model.checkpoint import DTYPES
        from zmrl.rollout.reference import ReferenceEngine

        self.engine = ReferenceEngine.from_dir(model_dir, device=device)
        dtype = DTYPES[self.engine.cfg.torch_dtype]
        # seed is irrelevant: every factor is overwritten by the first sync
        self.adapter = LoraAdapter(self.engine.cfg, lora, dtype=dtype).requires_grad_(False).to(self.engine.device)
        self.engine.projections = self.adapter.projections

    def generate(self, prompts, *, n, max_tokens, temperature, seed):
        import zmrl.batch_invariant as bi

        # the sampler's softmax too (token choices, not the reported log-probs, depend on it)
        with bi.batch_invariant_mode(True):
            return self.engine.generate(prompts, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)

    def stats(self) -> dict[str, float]:
        return {}  # one sequence at a time: no batching, chunking or prefix cache to report

    @torch.no_grad()
    def sync_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        own = self.adapter.factors
        bad = sorted(set(tensors) ^ set(own.keys()))
        if bad:
            raise ValueError(f"adapter sync does not fit the rollout's adapter: {bad[:6]}")
        for k, t in tensors.items():
            own[k].copy_(t)

    def sync_base_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.engine.sync_weights(tensors)

    def base_weight(self, name: str) -> torch.Tensor:
        return self.engine.weights[name]

    def close(self) -> None:
        pass


class VllmRollout:
    """zmrl.rollout.vllm.VllmEngine serving the canonical LoRA, synced in place."""

    def __init__(self, model_dir: str, lora: LoraConfig, cfg, max_model_len: int):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the progress display readable
        try:
            from zmrl.rollout.vllm import VllmEngine
            from zmrl.rollout.vllm.engine import EngineConfig
        except ImportError as e:
            raise BackendError(f"rollout.backend = 'vllm' needs vllm: pip install 'zmrl[cpu]' ({e})") from None
        r = cfg.rollout
        # chunked prefill is always on, so a budget below max_model_len is valid: prompts are split
        engine_cfg = EngineConfig(max_model_len=max_model_len, max_num_seqs=r.max_num_seqs,
                                  max_num_batched_tokens=r.max_num_batched_tokens,
                                  kv_cache_gib=r.kv_cache_gib, num_threads=cfg.run.num_threads,
                                  seed=cfg.run.seed, extra=dict(r.extra))
        try:
            self.engine = VllmEngine(model_dir, engine_cfg)
        except ValueError as e:  # rollout.extra or the model dir, named before vLLM starts
            raise BackendError(f"rollout.backend = 'vllm': {e}") from None
        self.engine.set_adapter(lora)
        self._model_file = os.path.join(model_dir, "model.safetensors")

    def generate(self, prompts, *, n, max_tokens, temperature, seed):
        return self.engine.generate(prompts, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)

    def stats(self) -> dict[str, float]:
        """How vLLM scheduled the last generate call (shows the recipe exercises chunked prefill
        and the prefix cache)."""
        s = self.engine.last_stats
        return {"rollout/prefill_chunks": s["prefill_chunks"],
                "rollout/prefix_cache_hit_frac": s["prefix_cached_tokens"] / max(s["prompt_tokens"], 1)}

    def sync_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        self.engine.sync_weights({"lora:" + k: v for k, v in tensors.items()})

    def sync_base_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.engine.sync_weights(tensors)

    def base_weight(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        # the served copy lives in vLLM's model; the checkpoint holds the same bits
        with safe_open(self._model_file, "pt") as f:
            return f.get_tensor(name)

    def close(self) -> None:
        self.engine.shutdown()


def build_rollout(cfg, model_dir: str, max_model_len: int, device: torch.device | None = None):
    lora = lora_config(cfg)
    if cfg.rollout.backend == "reference":
        return ReferenceRollout(model_dir, lora, run_device(cfg) if device is None else device)
    return VllmRollout(model_dir, lora, cfg, max_model_len)
