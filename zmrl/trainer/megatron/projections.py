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
from zmrl.model.projections import GroupedExperts
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

    def grouped_experts(self, w) -> GroupedExperts | None:
        """This rank's expert modules stacked (a copy per call, differentiable: the gradients reach
        each module's own parameters) for the grouped expert path; None (the per-expert loop)
        where an expert linear is split over ranks or its LoRA is not one whole A/B pair."""
        if "mlp.experts.gate_up_proj" not in self.experts:
            return None
        (fc1, first), (fc2, _) = self.experts["mlp.experts.gate_up_proj"], self.experts["mlp.experts.down_proj"]
        if any(m.leaves is not None for m in fc1 + fc2):
            return None
        stacked = []
        for mods in (fc1, fc2):
            pairs = [m.lora_pair("") for m in mods]
            if any(m.lora_on and set(m.lora_rows) - {""} for m in mods):
                return None  # parts (gate / up) this stacking does not serve
            if all(p is None for p in pairs):
                stacked.append(None)
            elif any(p is None for p in pairs):
                return None
            else:
                stacked.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))
        scale = next((m.lora_scale for m in fc1 + fc2 if m.lora_pair("") is not None), 0.0)
        return GroupedExperts(torch.stack([m.weight for m in fc1]), torch.stack([m.weight for m in fc2]),
                              stacked[0], stacked[1], scale, first)

    def expert_linear(self, name: str, expert: int, x: torch.Tensor, weight: torch.Tensor,
                      rows: slice | None = None) -> torch.Tensor:
        modules, first = self.experts[name]
        module = modules[expert - first]
        if isinstance(module, ColumnLinear):
            return module(x, rows=rows)[0]
        return module(x)[0]
