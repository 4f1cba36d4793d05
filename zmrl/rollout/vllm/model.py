"""The zmrl model inside vLLM: vLLM schedules, pages and samples; zmrl/model computes.

Every layer runs `zmrl.model.layers.decoder_layer` on the flat batch of this step's tokens
(prefill chunks and decode tokens of all running requests together: the row-wise kernels are
batch-invariant). The host's `attend` writes the new tokens' [latent | rope key | index key]
into the layer's `LatentCache` (vLLM-managed blocks) and then, per request, runs
`mla_attend` over that request's entries 0..seq_len-1 read back through its block table, in
ascending position order: the same view, hence the same bits, as the trainer's full-sequence
forward (`zmrl.model.packed.forward_packed`). DSA top-k selection happens inside `mla_attend`
over the whole visible context; nothing is densified.

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
from zmrl.model.attention import CacheView, MlaQuery, NewKV, mla_attend
from zmrl.model.config import ModelConfig
from zmrl.model.layers import check_weights, decoder_layer, embed, final_logits
from zmrl.model.packed import split_layer_weights
from zmrl.model.projections import BASE, Projections
from zmrl.rollout.vllm.paged_cache import LatentCache, PagedBatch


LORA_PREFIX = "lora:"


class ZmrlVllmForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.cfg: ModelConfig = vllm_config.model_config.hf_config.to_model_config()
        self.dtype = vllm_config.model_config.dtype
        self.device = torch.device(vllm_config.device_config.device)
        c, r, di = self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim, self.cfg.index_head_dim
        self.split = (c, r, di)
        self.caches = nn.ModuleList(
            LatentCache(c + r + di, self.dtype, f"model.layers.{i}.self_attn.latent_cache")
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
        batch = self.caches[0].batch()
        n_in = input_ids.shape[0] if inputs_embeds is None else inputs_embeds.shape[0]
        if batch is None:  # vLLM's profiling / warm-up run: no requests, no cache
            return torch.zeros(n_in, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        n = batch.num_actual_tokens
        positions = positions[:n].long()
        hidden = inputs_embeds[:n] if inputs_embeds is not None else embed(self.weights, input_ids[:n].long())
        for layer in range(self.cfg.num_hidden_layers):
            def attend(query: MlaQuery, new: NewKV, layer=layer) -> torch.Tensor:
                return self._attend(self.caches[layer], batch, query, new)
            hidden = decoder_layer(self.cfg, layer, self.layer_weights[layer], hidden, positions, attend,
                                   self._projections(layer))
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

    # ------------------------------------------------------------------ attention over the paged cache
    def _attend(self, cache: LatentCache, batch: PagedBatch, query: MlaQuery, new: NewKV) -> torch.Tensor:
        c, r, _ = self.split
        parts = [new.latents, new.index_keys] if new.rope_keys is None else [new.latents, new.rope_keys,
                                                                              new.index_keys]
        cache.write(batch, torch.cat(parts, -1))  # write first: a query's own token is visible to it
        out = torch.empty_like(query.q_latent)
        starts = batch.query_start_loc.tolist()
        for req in range(batch.num_reqs):
            lo, hi = starts[req], starts[req + 1]
            if hi == lo:
                continue
            entries = cache.read(batch, req)
            view = CacheView(
                latents=entries[:, :c].contiguous(),
                rope_keys=entries[:, c:c + r].contiguous() if r else None,
                index_keys=entries[:, c + r:].contiguous(),
                positions=torch.arange(entries.shape[0], device=entries.device),
            )
            out[lo:hi] = mla_attend(self.cfg, query.rows(slice(lo, hi)), view)
        return out

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
