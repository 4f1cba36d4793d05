"""zmrl's Projections hook over Megatron modules: how zmrl/model's layer functions reach them.

The layer functions (mla_project, mla_output, dense_mlp, moe_mlp) name the checkpoint weight they
apply, e.g. "self_attn.q_b_proj.weight"; `ModuleProjections` calls the Megatron linear that holds
it (with the row block and LoRA part that name stands for), so TP collectives and the LoRA delta
happen inside the module. Routed experts are reached through their stacked parameters
(zmrl.trainer.megatron.layers.ExpertStack): the grouped path gets those tensors themselves, the
per-expert path views of them. The absorbed kv_b_proj terms (W_UK / W_UV and their LoRA moved to the
other side) are zmrl.lora's own code: this class *is* a LoraProjections whose "adapter" is the
kv_up module's factors, so those bits are zmrl.lora's by construction.
"""
from __future__ import annotations

import torch

from zmrl.lora import LoraProjections
from zmrl.model.config import ModelConfig
from zmrl.model.projections import GroupedExperts
from zmrl.batch_invariant.collectives import LOCAL, Shards
from zmrl.trainer.megatron.layers import ColumnLinear, Replicated, gemm

KV_B = "self_attn.kv_b_proj.weight"


class ModuleProjections(LoraProjections):
    def __init__(self, cfg: ModelConfig, layer: int, linears: dict, experts: dict | None = None,
                 kv_up: ColumnLinear | None = None, shards: Shards = LOCAL):
        """cfg: the rank-local config (num_attention_heads = this rank's heads);
        linears: checkpoint name -> (module, rows, part); experts: checkpoint name ->
        (ExpertStack of this rank's experts, global id of its expert 0); kv_up: the module holding
        kv_b_proj (attention only)."""
        # LoraProjections reads adapter.cfg / adapter.pair(layer, name) / scale; this object is
        # its own adapter, answering for kv_b_proj only
        self.adapter, self.cfg, self.layer = self, cfg, layer
        self.linears, self.experts, self.kv_up, self.shards = linears, experts or {}, kv_up, shards
        self.scale = kv_up.lora_scale if kv_up is not None else 0.0
        # the composed expert path (grouped_experts / expert_linear, through which the expert
        # stacks are reached); ZmrlMoE takes zmrl's fused path itself when no expert is adapted
        self.has_expert_adapter = True
        self._expert_pairs: dict[str, list | None] = {}

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
        """This rank's expert stacks as they are (no copy: the kernels read the parameters, and the
        factor gradients land in them) for the grouped expert path."""
        if "mlp.experts.gate_up_proj" not in self.experts:
            return None
        (fc1, first), (fc2, _) = self.experts["mlp.experts.gate_up_proj"], self.experts["mlp.experts.down_proj"]
        pairs = fc1.lora_pair(""), fc2.lora_pair("")
        scale = next((m.lora_scale for m, p in zip((fc1, fc2), pairs) if p is not None), 0.0)
        return GroupedExperts(fc1.weight, fc2.weight, pairs[0], pairs[1], scale, first)

    def _expert_pair(self, name: str, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Expert `expert`'s (A, B): views from one unbind of the stacked factors per forward, so the
        backward stacks the experts' gradients once (indexing per expert would give each expert a
        gradient the size of the whole stack)."""
        stack, first = self.experts[name]
        if name not in self._expert_pairs:
            pair = stack.lora_pair("")
            self._expert_pairs[name] = None if pair is None else list(zip(pair[0].unbind(0), pair[1].unbind(0)))
        pairs = self._expert_pairs[name]
        return None if pairs is None else pairs[expert - first]

    def expert_linear(self, name: str, expert: int, x: torch.Tensor, weight: torch.Tensor,
                      rows: slice | None = None) -> torch.Tensor:
        """weight: the view of the stack zmrl/model passes (expert `expert`, output rows `rows`)."""
        y = gemm(x, weight)
        pair = self._expert_pair(name, expert)
        if pair is None:
            return y
        a, b = pair
        return self.experts[name][0].with_delta(y, x, (a, b if rows is None else b[rows]))
