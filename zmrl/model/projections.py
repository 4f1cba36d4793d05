"""How the layer functions apply a weight matrix: the single hook through which LoRA enters.

The layer functions never multiply by a weight themselves; they ask a `Projections` object.
The base class applies the weight alone through `zmrl.batch_invariant`. `zmrl.lora`
subclasses it and adds the unmerged adapter term at the points pinned here, so the model
(which may not import zmrl.lora) still fixes *where* the delta joins and in which dtype:
the delta is computed in the activation dtype and added to the base output once, right
after the base GEMM (y = base + delta), never inside the accumulator.

`name` is the parameter's path inside the decoder layer, e.g. "self_attn.q_a_proj.weight"
or "mlp.experts.gate_up_proj" (with `expert` set), so adapters key on checkpoint names.

Tensor parallelism is part of the arithmetic, on every host: the weights a TP group splits
(`COLUMN`: over output rows; `ROW`: over input columns) are applied over the canonical leaves of
zmrl.batch_invariant.collectives, whatever the TP size, one process included. So a host that
holds the whole weight computes the very bits a host holding one eighth of it computes with its
peers. `shards` says which leaves this host holds (LOCAL: all). Every other weight is replicated
(applied whole by every rank: the down-projections, the indexer, the router, the shared expert);
routed experts are whole per rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from zmrl.batch_invariant import add_scaled, bmm, linear
from zmrl.batch_invariant.collectives import LOCAL, Shards, column_linear, gather_last, num_leaves, row_linear
from zmrl.model.sharding import ExpertShard

@dataclass(frozen=True)
class GroupedExperts:
    """The routed experts stacked for the grouped path: gate_up [E, 2I, D] (gate rows first),
    down [E, D, I], each LoRA pair (A [E, r, in], B [E, out, r]) or None, the delta's scale, and
    the global id of expert 0 of these tensors (expert parallel: a rank stacks its own experts)."""
    gate_up: torch.Tensor
    down: torch.Tensor
    lora_gate_up: tuple[torch.Tensor, torch.Tensor] | None = None
    lora_down: tuple[torch.Tensor, torch.Tensor] | None = None
    scale: float = 0.0
    first_expert: int = 0


def stacked_experts(w: Mapping[str, object], name: str) -> tuple[torch.Tensor, int]:
    """A layer's routed-expert stack `name` and the global id of its expert 0: an expert-parallel
    rank's own experts (zmrl.model.sharding.ExpertShard, which the per-expert path indexes by global
    id) or the whole stack."""
    t = w[name]
    return (t.local, t.first) if isinstance(t, ExpertShard) else (t, 0)


COLUMN = frozenset({"self_attn.q_b_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"})
"""Split over output rows under TP (kv_b_proj too, but it is applied per head: absorb_uk / expand_uv)."""
ROW = frozenset({"self_attn.o_proj.weight", "mlp.down_proj.weight"})
"""Split over input columns under TP: a sum across ranks."""


def sharded_linear(name: str, x: torch.Tensor, weight: torch.Tensor, shards: Shards = LOCAL,
                   lora: tuple[torch.Tensor, torch.Tensor] | None = None, scale: float = 0.0,
                   num_out: int | None = None, num_in: int | None = None) -> torch.Tensor:
    """x W^T (+ the LoRA delta) by the canonical TP arithmetic of weight `name`. weight (and a
    column weight's B) hold this rank's leaves; num_out / num_in: the whole weight's dims (default:
    weight's own times the TP size). A row weight's x is this rank's slice of the input."""
    if name in COLUMN:
        return column_linear(x, weight, num_leaves(num_out or weight.shape[0] * shards.size), shards, lora, scale)
    if name in ROW:
        y = row_linear(x, weight, num_leaves(num_in or weight.shape[1] * shards.size), shards)
        if lora is not None:
            # a row-parallel delta reads the whole input (gathered: exact), so A and B are whole
            # and the delta is the single host's, A reducing in one GEMM
            x = gather_last(x, shards)
    else:
        y = linear(x, weight)
    if lora is None:
        return y
    return add_scaled(y, linear(linear(x, lora[0]), lora[1]), scale)


class Projections:
    """Weights only (no adapter). Stateless; `BASE` is the shared instance."""

    #: True when routed experts carry an adapter (the MoE then runs the composed expert path)
    has_expert_adapter = False
    #: the leaves of every split dimension this host holds
    shards: Shards = LOCAL
    #: the routed experts' leaves this host holds (expert parallel: the MoE gathers the slot outputs
    #: of the other ranks' experts); LOCAL: all of them
    expert_shards: Shards = LOCAL

    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [*, in], weight [out, in] -> [*, out]."""
        return sharded_linear(name, x, weight, self.shards)

    def expert_linear(self, name: str, expert: int, x: torch.Tensor, weight: torch.Tensor,
                      rows: slice | None = None) -> torch.Tensor:
        """One routed expert's slice of a 3-D parameter: x [N, in], weight [out', in] -> [N, out'].

        `rows` says which output rows of the full [out, in] expert matrix `weight` is (the gate
        and up halves of gate_up_proj are separate GEMMs), so an adapter can slice its B."""
        return linear(x, weight)

    def grouped_experts(self, w: Mapping[str, torch.Tensor]) -> GroupedExperts | None:
        """The routed experts as stacked tensors for the grouped expert path, or None where only
        the per-expert `expert_linear` loop can run them."""
        if type(self).expert_linear is not Projections.expert_linear:
            return None  # a subclass that changes expert_linear says itself how to group experts
        gate_up, first = stacked_experts(w, "mlp.experts.gate_up_proj")
        down, _ = stacked_experts(w, "mlp.experts.down_proj")
        return GroupedExperts(gate_up, down, first_expert=first)

    def absorb_uk(self, name: str, q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope], w_uk [H, nope, C] -> q_latent [T, H, C] = W_UK[h]^T q_nope[t, h]."""
        return bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_uv(self, name: str, o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """o_latent [T, H, C], w_uv [H, v, C] -> [T, H, v] = W_UV[h] o_latent[t, h]."""
        return bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


BASE = Projections()
