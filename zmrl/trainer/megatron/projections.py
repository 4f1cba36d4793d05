"""zmrl's Projections hook over Megatron modules: how zmrl/model's layer functions reach them.

The layer functions (mla_project, mla_output, dense_mlp, moe_mlp) name the checkpoint weight they
apply, e.g. "self_attn.q_b_proj.weight"; `ModuleProjections` calls the Megatron linear that holds
it (with the row block and LoRA part that name stands for), so TP collectives and the LoRA delta
happen inside the module. The absorbed kv_b_proj terms (W_UK / W_UV and their LoRA moved to the
other side) are zmrl.lora's own code: this class *is* a LoraProjections whose "adapter" is the
kv_up module's factors, so those bits are zmrl.lora's by construction.
"""
from __future__ import annotations

import torch

from zmrl.lora import LoraProjections
from zmrl.model.config import ModelConfig
from zmrl.batch_invariant.collectives import LOCAL, Shards
from zmrl.trainer.megatron.layers import ColumnLinear, Replicated

KV_B = "self_attn.kv_b_proj.weight"


class ModuleProjections(LoraProjections):
    def __init__(self, cfg: ModelConfig, layer: int, linears: dict, experts: dict | None = None,
                 kv_up: ColumnLinear | None = None, shards: Shards = LOCAL):
        """cfg: the rank-local config (num_attention_heads = this rank's heads);
        linears: checkpoint name -> (module, rows, part); experts: checkpoint name ->
        (local modules, first expert id); kv_up: the module holding kv_b_proj (attention only)."""
        # LoraProjections reads adapter.cfg / adapter.pair(layer, name) / scale; this object is
        # its own adapter, answering for kv_b_proj only
        self.adapter, self.cfg, self.layer = self, cfg, layer
        self.linears, self.experts, self.kv_up, self.shards = linears, experts or {}, kv_up, shards
        self.scale = kv_up.lora_scale if kv_up is not None else 0.0
        # the composed expert path (it calls expert_linear, through which the Megatron expert
        # modules are reached); ZmrlMoE takes zmrl's fused path itself when no expert is adapted
        self.has_expert_adapter = True

    # ------------------------------------------------------------------ the adapter face (kv_b only)
    def pair(self, layer: int, name: str):
        if name != KV_B or self.kv_up is None:
            return None
        # A is whole on every rank while B holds this rank's heads: LoraProjections sums A's
        # gradient over the head leaves of every rank (the canonical tree, `shards`)
        return self.kv_up.lora_pair("")

    # ------------------------------------------------------------------ Projections
    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        module, rows, part = self.linears[name]
        if isinstance(module, (ColumnLinear, Replicated)):
            return module(x, rows=rows, part=part)[0]
        return module(x)[0]

    def expert_linear(self, name: str, expert: int, x: torch.Tensor, weight: torch.Tensor,
                      rows: slice | None = None) -> torch.Tensor:
        modules, first = self.experts[name]
        module = modules[expert - first]
        if isinstance(module, ColumnLinear):
            return module(x, rows=rows)[0]
        return module(x)[0]
