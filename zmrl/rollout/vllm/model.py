"""The zmrl model inside vLLM: vLLM schedules, pages and samples; zmrl computes.

`forward` hands the step's flat batch (prefill chunks and decode tokens of all running
requests together), the per-layer `LatentCache` blocks and the step's layout to
`zmrl.rollout.paged.paged_forward`, the vLLM-free function that runs zmrl/model over a paged
cache: it writes each new token's [latent | rope key | index key], scores each query against
its request's whole context of index keys and runs sparse MLA over the selected slots only,
all requests at once. A token's computation is the trainer's full-sequence one
(`zmrl.model.packed.forward_packed`), hence the same bits.

Weights live in plain dicts of tensors under their checkpoint names (no vLLM linear layers:
their kernels and LoRA punica paths are not zmrl's arithmetic), held by a
`zmrl.rollout.sharded.ShardedWeights`. `update_weights` copies into those tensors in place,
which is what weight sync uses.

Tensor parallel (`tensor_parallel_size` > 1): each vLLM worker holds the shard the trainer's TP
rank of the same index holds (zmrl.model.sharding: heads, dense MLP, vocabulary split; routed
experts whole per rank, EP = TP; the rest replicated) and every cross-rank sum runs through
zmrl.batch_invariant.collectives over vLLM's TP group (its gloo group on CPU), so TP = 1, 2, 4
and 8 serve the same bits. Every worker is fed the same step and holds the same whole cache
entries and the whole logits (gathered). Weight sync sends whole tensors to every worker, and
each copies in its own shard.

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
from zmrl.batch_invariant.collectives import LOCAL, Shards
from zmrl.model.config import ModelConfig
from zmrl.model.layers import embed, final_logits
from zmrl.model.sharding import check_divisible
from zmrl.rollout.paged import entry_dim, paged_forward
from zmrl.rollout.sharded import LORA_PREFIX, ShardedWeights
from zmrl.rollout.vllm.paged_cache import LatentCache

__all__ = ["LORA_PREFIX", "ZmrlVllmForCausalLM", "tp_shards"]


def tp_shards(device: torch.device) -> Shards:
    """This worker's place in vLLM's tensor-parallel group (gloo on CPU, the device group else)."""
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    if tp.world_size == 1:
        return LOCAL
    return Shards(tp.world_size, tp.rank_in_group, tp.cpu_group if device.type == "cpu" else tp.device_group)


class ZmrlVllmForCausalLM(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.cfg: ModelConfig = vllm_config.model_config.hf_config.to_model_config()
        self.dtype = vllm_config.model_config.dtype
        self.device = torch.device(vllm_config.device_config.device)
        self.shards = tp_shards(self.device)
        check_divisible(self.cfg, self.shards.size, "tensor_parallel_size")
        self.caches = nn.ModuleList(
            LatentCache(entry_dim(self.cfg), self.dtype, f"model.layers.{i}.self_attn.latent_cache")
            for i in range(self.cfg.num_hidden_layers))
        self.shard = ShardedWeights(self.cfg, self.shards, self.dtype, self.device)
        self.batch_invariant = True

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """This worker's tensors under checkpoint names (its shards under TP)."""
        return self.shard.model

    @property
    def adapter(self):
        """The served zmrl.lora.LoraAdapter (this worker's factors), or None."""
        return self.shard.adapter

    # ------------------------------------------------------------------ vLLM interface
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed(self.weights, input_ids, self.shards)

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
            self.cfg, self.weights, self.shard.layers, [c.kv_cache for c in self.caches], layout.batch(positions),
            token_ids=None if inputs_embeds is not None else input_ids[:n],
            projections=self.shard.projections,
            inputs_embeds=None if inputs_embeds is None else inputs_embeds[:n], shards=self.shards)
        if n < n_in:
            hidden = torch.cat([hidden, hidden.new_zeros(n_in - n, hidden.shape[1])])
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with self._kernels():
            return final_logits(self.cfg, self.weights, hidden_states, self.shards)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.shard.load(weights, "the vLLM checkpoint")
        return set()  # names are vLLM parameter names; ours are checked by the load

    # ------------------------------------------------------------------ zmrl controls (worker extension)
    def _kernels(self):
        # the same Projections objects in both modes: the adapter's terms follow the kernel path
        # like the base GEMMs
        return contextlib.nullcontext() if self.batch_invariant else use_path("torch")

    def set_batch_invariant(self, on: bool) -> None:
        self.batch_invariant = on

    def set_adapter(self, lora: dict | None) -> None:
        """lora: LoraConfig fields (r, lora_alpha, targets), or None for the base model. The new
        adapter's B factors are zero (outputs unchanged) until a sync brings the trained ones."""
        self.shard.set_adapter(lora)

    def weight_names(self) -> dict[str, tuple[list[int], str]]:
        """name -> (whole shape, dtype) of every tensor update_weights accepts."""
        return self.shard.names()

    def update_weights(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Whole tensors -> this worker's shards, in place (the update is checked first, whole)."""
        return self.shard.update(tensors)
