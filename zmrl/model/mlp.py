"""The MLPs: a dense SwiGLU (the first `first_k_dense_replace` layers) and the routed MoE.

MoE numerics (pinned): routing by `moe_route` (fp32 sigmoid scores, bias for selection only,
canonical top-k with ascending expert ids, renormalized unbiased weights times
routed_scaling_factor: the scaling lives in the routing weights and nowhere else). Experts
by `moe_experts`: per expert h = (silu(x Wg^T) * (x Wu^T).float()).to(x.dtype), y = h Wd^T;
combine sum_j w_j * y_j in fp32, slot order = ascending expert id; the shared expert's
output is added last inside the fp32 accumulator; one cast to the activation dtype.

With an expert adapter the same arithmetic runs in `_experts_composed`: the adapter term joins
each expert GEMM's output, and everything else, the combine included, is unchanged. Its expert
outputs come from `expert_slot_outputs`: on the Triton path the grouped kernels
(zmrl.batch_invariant.moe_expert_slots: every expert and its LoRA terms in one launch per GEMM
kind, bit for bit the per-expert composition), on the CPU path a loop of per-expert
zmrl.batch_invariant.linear/silu calls.
With a zero adapter it equals `moe_experts` bit for bit on the CPU path and on CUDA (where
`moe_experts` is the Triton grouped kernel: it shares the public sigmoid/silu's `sigmoid_f32` and
is launched without FMA contraction, so its epilogue rounds as the per-expert ops do; tests check
both devices). A host with an adapter (the trainer always holds one) and a host without one
therefore give the same bits.

Expert parallel (`proj.expert_shards`: this host holds some canonical expert leaves, their weights
indexed by global expert id, zmrl.model.sharding.ExpertShard): the composed path runs this host's
experts, the slot outputs of every rank are gathered and each slot is copied from its expert's
owner (`owner_slot_outputs`), then the same combine: the single host's bits.

Weights (names inside a decoder layer): mlp.gate.weight [E, D], mlp.gate.e_score_correction_bias
[E], mlp.experts.gate_up_proj [E, 2I, D] (gate rows first), mlp.experts.down_proj [E, D, I],
mlp.shared_experts.{gate,up,down}_proj.weight; dense: mlp.{gate,up,down}_proj.weight.
"""
from __future__ import annotations

from typing import Mapping

import torch

from zmrl.batch_invariant import (
    grouped_expert_slots_run_here,
    moe_expert_slots,
    moe_experts,
    moe_route,
    silu,
    slot_sum,
)
from zmrl.batch_invariant.collectives import LOCAL, Shards, fan_out, gather_last, num_leaves
from zmrl.model.config import ModelConfig
from zmrl.model.projections import BASE, Projections


def _swiglu(proj: Projections, prefix: str, w: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    gate = proj.linear(prefix + "gate_proj.weight", x, w[prefix + "gate_proj.weight"])
    up = proj.linear(prefix + "up_proj.weight", x, w[prefix + "up_proj.weight"])
    # up is promoted to fp32 inside the product (exactly, on load), forward and backward alike
    h = (silu(gate) * up).to(x.dtype)
    return proj.linear(prefix + "down_proj.weight", h, w[prefix + "down_proj.weight"])


def dense_mlp(cfg: ModelConfig, w: Mapping[str, torch.Tensor], x: torch.Tensor,
              proj: Projections = BASE) -> torch.Tensor:
    """x [T, D] (post-attention-normed) -> [T, D]."""
    return _swiglu(proj, "mlp.", w, x)


def route(cfg: ModelConfig, w: Mapping[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (weights [T, k] fp32, expert ids [T, k] ascending). The router has no adapter."""
    return moe_route(x, w["mlp.gate.weight"], w.get("mlp.gate.e_score_correction_bias"),
                     cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)


def expert_slot_outputs(cfg, w, x, ids, proj: Projections, shards: Shards = LOCAL) -> torch.Tensor:
    """x [T, D], ids [T, k] -> each slot's expert output [T, k, D] fp32 (zeros for slots whose
    expert this host does not hold). Each expert runs once over all its rows.

    Experts are grouped in canonical leaves (zmrl.batch_invariant.collectives: gcd(8, E) runs of
    consecutive experts); `shards` says which leaves this host holds (expert parallel: a rank holds
    whole leaves). Each leaf reads its own alias of x, so the gradient of x is summed over the
    leaves by the canonical tree, whichever rank computed them."""
    inter = cfg.moe_intermediate_size
    n_tokens, k = ids.shape
    leaves = num_leaves(cfg.n_routed_experts)
    per_leaf = cfg.n_routed_experts // leaves
    grouped = proj.grouped_experts(w) if grouped_expert_slots_run_here(x) else None
    if grouped is not None:
        local = shards.local(leaves)
        return moe_expert_slots(fan_out(x, leaves, shards), ids, grouped.gate_up, grouped.down,
                                grouped.lora_gate_up, grouped.lora_down, grouped.scale, local.start, per_leaf,
                                grouped.first_expert, total_leaves=leaves)
    # the CPU path: one expert at a time through `linear`, whose CPU GEMMs are row-invariant at any
    # row count (no grouped kernel exists there); the loop's host sync costs little next to them
    gate_up, down = w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"]
    present = set(torch.unique(ids).tolist())
    slot_out = torch.zeros(n_tokens, k, x.shape[1], dtype=torch.float32, device=x.device)
    for leaf, xc in zip(shards.local(leaves), fan_out(x, leaves, shards)):
        experts = range(leaf * per_leaf, (leaf + 1) * per_leaf)
        # a leaf no token reached still runs one expert over zero rows: its alias of x must take
        # part in the backward (the tree's collective runs on every rank)
        for e in [e for e in experts if e in present] or [experts[0]]:  # ascending expert id
            tok, slot = (ids == e).nonzero(as_tuple=True)
            xe = xc[tok]
            g = proj.expert_linear("mlp.experts.gate_up_proj", e, xe, gate_up[e, :inter], slice(0, inter))
            u = proj.expert_linear("mlp.experts.gate_up_proj", e, xe, gate_up[e, inter:], slice(inter, 2 * inter))
            h = (silu(g) * u.float()).to(x.dtype)
            y = proj.expert_linear("mlp.experts.down_proj", e, h, down[e])
            slot_out = slot_out.index_put((tok, slot), y.float())
    return slot_out


class _CombineSlots(torch.autograd.Function):
    """The combine (`slot_sum`: the bits of its torch ops, one launch on the Triton path), with the
    gradients autograd computes for those torch ops written out.

    Autograd's own backward of the slot loop pads each slot's gradient into a zero [T, k, D] fp32
    tensor and adds the k pads (select's backward, then accumulation): k full-size fills and adds
    per layer, most of a small model's MoE backward traffic. Here each slot's gradient is the same
    product written once; the pads' only effect on the values, a -0.0 turned into +0.0 by adding
    a zero, is kept by one `+ 0.0`. The weights' gradient is the same per-slot product and sum
    over D (the same reduction kernel on the same [T, D] operands), likewise sign-normalized."""

    @staticmethod
    def forward(ctx, slot_out, weights, shared, dtype):
        wf = weights.float()
        ctx.save_for_backward(slot_out, wf)
        ctx.weights_dtype = weights.dtype
        ctx.shared_dtype = None if shared is None else shared.dtype
        return slot_sum(slot_out, wf, shared, dtype)

    @staticmethod
    def backward(ctx, grad):
        slot_out, wf = ctx.saved_tensors
        k = slot_out.shape[1]
        g = grad.float()
        need_slots, need_weights, need_shared = ctx.needs_input_grad[:3]
        d_slots = d_weights = d_shared = None
        if need_slots:
            d_slots = torch.mul(g[:, None, :], wf[:, :, None])  # slot j: g * w_j, each product once
            if k > 1:  # with one slot nothing was accumulated, so no zero was added
                d_slots.add_(0.0)
        if need_weights:
            d_weights = torch.stack([(g * slot_out[:, j]).sum(1) for j in range(k)], 1)
            d_weights = (d_weights + 0.0 if k > 1 else d_weights).to(ctx.weights_dtype)
        if need_shared:
            d_shared = g.to(ctx.shared_dtype)
        return d_slots, d_weights, d_shared, None


def combine_slots(slot_out: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """[T, k, D] fp32 slot outputs, weights [T, k], shared expert output [T, D] | None -> [T, D]:
    the fp32 combine in slot order (= ascending expert id), the shared expert added last, one cast."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (slot_out, weights, shared)):
        return _CombineSlots.apply(slot_out, weights, shared, dtype)
    return slot_sum(slot_out, weights.float(), shared, dtype)


def shared_expert(cfg, w, x, proj: Projections) -> torch.Tensor | None:
    """The shared expert's SwiGLU [T, D] (replicated under TP: applied whole), or None."""
    return _swiglu(proj, "mlp.shared_experts.", w, x) if cfg.n_shared_experts else None


def owner_slot_outputs(cfg, slot_out: torch.Tensor, ids: torch.Tensor, shards: Shards) -> torch.Tensor:
    """Expert parallel: every rank's slot outputs [T, k, D] (zeros where another rank owns the
    slot's expert) -> [T, k, D] with each slot taken from its expert's owner (rank e // (E / size),
    zmrl.model.sharding), gathered as tensors: copies, so each slot holds its owner's exact bits."""
    n_tokens, k, d = slot_out.shape
    everyone = gather_last(slot_out.reshape(n_tokens, k * d), shards).view(n_tokens, shards.size, k, d)
    owner = ids // (cfg.n_routed_experts // shards.size)
    arange = torch.arange(n_tokens, device=slot_out.device)[:, None], torch.arange(k, device=slot_out.device)[None, :]
    return everyone[arange[0], owner, arange[1]]


def _experts_composed(cfg, w, x, ids, weights, proj: Projections) -> torch.Tensor:
    shards = proj.expert_shards
    slot_out = expert_slot_outputs(cfg, w, x, ids, proj, shards)
    if shards.size > 1:
        slot_out = owner_slot_outputs(cfg, slot_out, ids, shards)
    # the shared expert after the routed ones: graph order fixes the backward's accumulation order
    return combine_slots(slot_out, weights, shared_expert(cfg, w, x, proj), x.dtype)


def moe_mlp(cfg: ModelConfig, w: Mapping[str, torch.Tensor], x: torch.Tensor,
            proj: Projections = BASE) -> torch.Tensor:
    """x [T, D] (post-attention-normed) -> [T, D]: routed experts + shared expert."""
    weights, ids = route(cfg, w, x)
    if proj.has_expert_adapter or proj.expert_shards.size > 1:
        # expert parallel runs the composed path too (the fused kernel takes every expert at once)
        return _experts_composed(cfg, w, x, ids, weights, proj)
    inter = cfg.moe_intermediate_size
    gate_up = w["mlp.experts.gate_up_proj"]
    shared = None
    if cfg.n_shared_experts:
        # the shared expert's projections may carry an adapter even when the routed ones do not
        if type(proj) is not Projections:
            return _experts_composed(cfg, w, x, ids, weights, proj)
        shared = tuple(w[f"mlp.shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
    return moe_experts(x, ids, weights, gate_up[:, :inter], gate_up[:, inter:], w["mlp.experts.down_proj"], shared)
