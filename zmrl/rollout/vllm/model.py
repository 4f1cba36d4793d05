"""The zmrl model inside vLLM: vLLM schedules, pages and samples; zmrl computes.

`forward` hands the step's flat batch (prefill chunks and decode tokens of all running
requests together), the per-layer `LatentCache` blocks and the step's layout to
`zmrl.rollout.paged.paged_forward`, the vLLM-free function that runs zmrl/model over a paged
cache: it writes each new token's [latent | rope key | index key], scores each query against
its request's whole context of index keys and runs sparse MLA over the selected slots only,
all requests at once. A token's computation is the trainer's full-sequence one
(`zmrl.model.packed.forward_packed`), hence the same bits.

Weights live in plain dicts of tensors under their checkpoint names (no vLLM linear layers:
their kernels and LoRA punica paths are not zmrl's arithmetic). `update_weights` copies into
those tensors in place, which is what weight sync uses.

Invariance off (the control): forward and compute_logits run inside `use_path("torch")`, so
every zmrl op (projections, LoRA terms, norms, indexer, top-k, sparse MLA, MoE) takes torch's
default kernels. The switch is scoped here, around the calls vLLM makes, rather than set per
thread by the caller: vLLM may run the model in another thread (async scheduling) or process.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from zmrl.batch_invariant import use_path
from zmrl.model.config import ModelConfig
from zmrl.model.layers import check_weights, embed, final_logits
from zmrl.model.packed import split_layer_weights
from zmrl.model.projections import BASE, Projections
from zmrl.rollout.paged import entry_dim, paged_forward
from zmrl.rollout.vllm.paged_cache import LatentCache


LORA_PREFIX = "lora:"


class ZmrlVllmForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.cfg: ModelConfig = vllm_config.model_config.hf_config.to_model_config()
        self.dtype = vllm_config.model_config.dtype
        self.device = torch.device(vllm_config.device_config.device)
        self.caches = nn.ModuleList(
            LatentCache(entry_dim(self.cfg), self.dtype, f"model.layers.{i}.self_attn.latent_cache")
            for i in range(self.cfg.num_hidden_layers))
        self.weights: dict[str, torch.Tensor] = {}
        self.layer_weights: list[dict[str, torch.Tensor]] = []
        self.batch_invariant = True
        self.adapter = None  # a zmrl.lora.LoraAdapter, its factors updated in place by sync

    # ------------------------------------------------------------------ vLLM interface
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed(self.weights, input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None) -> torch.Tensor:
        """input_ids, positions [N] (flat; may be padded past the scheduled tokens) -> hidden [N, D]."""
        with self._kernels():
            return self._forward(input_ids, positions, inputs_embeds)

    def _forward(self, input_ids, positions, inputs_embeds) -> torch.Tensor:
        layout = self.caches[0].layout()
        n_in = input_ids.shape[0] if inputs_embeds is None else inputs_embeds.shape[0]
        if layout is None:  # vLLM's profiling / warm-up run: no requests, no cache
            return torch.zeros(n_in, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        n = layout.num_actual_tokens
        hidden = paged_forward(
            self.cfg, self.weights, self.layer_weights, [c.kv_cache for c in self.caches], layout.batch(positions),
            token_ids=None if inputs_embeds is not None else input_ids[:n],
            projections=self._projections,
            inputs_embeds=None if inputs_embeds is None else inputs_embeds[:n])
        if n < n_in:
            hidden = torch.cat([hidden, hidden.new_zeros(n_in - n, hidden.shape[1])])
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with self._kernels():
            return final_logits(self.cfg, self.weights, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = {name: t.to(device=self.device, dtype=self.dtype) for name, t in weights}
        check_weights(self.cfg, loaded, "the vLLM checkpoint")
        self.weights = loaded
        self.layer_weights = split_layer_weights(self.cfg, loaded)
        return set()  # names are vLLM parameter names; ours are checked above

    # ------------------------------------------------------------------ zmrl controls (worker extension)
    def _projections(self, layer: int) -> Projections:
        # the same objects in both modes: the adapter's terms follow the kernel path like the base GEMMs
        return self.adapter.projections(layer) if self.adapter is not None else BASE

    def _kernels(self):
        return contextlib.nullcontext() if self.batch_invariant else use_path("torch")

    def set_batch_invariant(self, on: bool) -> None:
        self.batch_invariant = on

    def set_adapter(self, lora: dict | None) -> None:
        """lora: LoraConfig fields (r, lora_alpha, targets), or None for the base model. The new
        adapter's B factors are zero (outputs unchanged) until a sync brings the trained ones."""
        if lora is None:
            self.adapter = None
            return
        from zmrl.lora import LoraAdapter, LoraConfig

        self.adapter = LoraAdapter(self.cfg, LoraConfig(**lora), dtype=self.dtype).to(self.device)
        self.adapter.requires_grad_(False)

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = dict(self.weights)
        if self.adapter is not None:  # adapter factors are addressed as "lora:" + their key
            out.update({LORA_PREFIX + k: v.data for k, v in self.adapter.factors.items()})
        return out

    def weight_names(self) -> dict[str, tuple[list[int], str]]:
        return {k: (list(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in self._tensors().items()}

    @torch.no_grad()
    def update_weights(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        own = self._tensors()
        unknown = sorted(set(tensors) - set(own))
        wrong = [f"{k} {tuple(t.shape)} (expected {tuple(own[k].shape)})"
                 for k, t in tensors.items() if k in own and t.shape != own[k].shape]
        if unknown or wrong:  # reject the whole update before touching anything
            raise ValueError(f"weight update does not fit the model: unknown {unknown[:8]}, wrong shapes {wrong[:8]}")
        for name, t in tensors.items():
            own[name].copy_(t)
        return sorted(tensors)
