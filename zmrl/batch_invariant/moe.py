"""Mixture-of-experts routing and execution (DeepSeek-V3 / Kimi-K2 family), batch-invariant.

Routing: router logits through the invariant linear; fp32 sigmoid (written with exp, whose
CPU lanes and tails agree, unlike torch.sigmoid's); the bias is added for *selection only*;
optional group limit (group score = sum of the group's top-2 biased scores); canonical
top-k; weights are the unbiased scores of the chosen experts, renormalized, times
routed_scaling_factor. Expert ids come out ascending per token.

Execution: each expert's rows go through the invariant matmul (fixed row tiles, so how
many tokens an expert received does not matter); silu(gate) * up in fp32; the combine
accumulates weight * expert output in fp32 per token in ascending expert id; the shared
expert's output is added last, then one cast to the activation dtype.
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant import cpu_grouped
from zmrl.batch_invariant._checks import (
    check_dim,
    check_float,
    check_index,
    check_same_device,
    check_size,
    fail_if,
)
from zmrl.batch_invariant._paths import path_for, records_graph, torch_ops, triton_ops
from zmrl.batch_invariant.matmul import linear
from zmrl.batch_invariant.topk import topk, topk_of_checked


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid from exp and IEEE division only (position-independent on CPU). On the
    Triton path it is the Triton sigmoid that the fused MoE kernel inlines, so the composed
    and the fused MoE agree bit for bit (zmrl/batch_invariant/triton/elementwise.py)."""
    if path_for(x) == "triton":
        return triton_ops().sigmoid(x)
    return 1.0 / (1.0 + torch.exp(-x.float()))


def silu(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf * sigmoid(xf)


def moe_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D], router_weight [E, D], bias [E] | None -> (weights [N, k] fp32, ids [N, k] int64)."""
    check_float("x", x)
    check_float("router_weight", router_weight)
    check_dim("x", x, 2, "[N, D]")
    check_dim("router_weight", router_weight, 2, "[E, D]")
    num_experts = router_weight.shape[0]
    if bias is not None:
        check_dim("bias", bias, 1, "[E]")
        check_size("bias", bias.shape[0], num_experts, "length vs number of experts")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group={n_group} must be >= 1 and divide the {num_experts} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"top_k={top_k} exceeds the {topk_group * (num_experts // n_group)} experts in kept groups")
    path = path_for(x)
    if path == "torch":
        return torch_ops().moe_route(x, router_weight, bias, top_k, n_group, topk_group, routed_scaling_factor)
    scores = sigmoid(linear(x.float(), router_weight.float()))  # [N, E]
    biased = scores if bias is None else scores + bias.float()
    # one NaN check for the router: a NaN logit (from NaN activations) and a NaN bias both show here
    fail_if(torch.isnan(biased).any(), "router scores contain NaN (check the input activations and the router bias)")
    if path == "triton" and num_experts <= triton_ops().ROUTE_SELECT_MAX_EXPERTS:
        ids = triton_ops().route_select(biased, top_k, n_group, topk_group)  # one launch, the same ids
    else:
        ids = route_select_composed(biased, top_k, n_group, topk_group)
    return route_weights(scores, ids, routed_scaling_factor), ids


def route_select_composed(biased: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """The router's selection from its NaN-checked biased scores [N, E] -> ids [N, top_k], ascending:
    with n_group > 1 the DeepSeek group limit (a group's score is its two largest scores added, the
    canonical top-`topk_group` groups are kept), then the canonical top-k of the kept experts."""
    if n_group > 1:
        grouped = biased.view(biased.shape[0], n_group, -1)
        top2 = torch.topk(grouped, min(2, grouped.shape[-1]), dim=-1).values
        group_score = top2[..., 0] if top2.shape[-1] == 1 else top2[..., 0] + top2[..., 1]  # fixed order
        keep = topk(group_score, topk_group)  # [N, topk_group], canonical
        group_mask = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
        biased = grouped.masked_fill(group_mask[..., None], float("-inf")).flatten(1)
    return topk_of_checked(biased, top_k)  # ascending expert id


def route_weights_composed(scores: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """`route_weights` as torch ops (the CPU and reference paths, and what the Triton kernel and
    its backward reproduce bit for bit)."""
    chosen = scores.gather(1, ids)
    total = chosen[:, 0]
    for j in range(1, ids.shape[1]):  # renormalize in slot order
        total = total + chosen[:, j]
    return chosen / total[:, None] * scale


def route_weights(scores: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """The router's weights: scores [N, E] fp32, the chosen experts ids [N, k] -> [N, k] fp32, each
    chosen score over the chosen scores' sum (added in slot order), times scale. On the Triton path
    one launch instead of k + 2 torch ops, with their bits and their autograd gradient
    (zmrl/batch_invariant/triton/route.py)."""
    if path_for(scores) == "triton":
        return triton_ops().route_weights(scores, ids, scale)
    return route_weights_composed(scores, ids, scale)


def _gated(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up in fp32, cast to the activations' dtype: every CPU expert path's middle step."""
    return (silu(gate) * up.float()).to(dtype)


def _expert_mlp(x, w_gate, w_up, w_down):
    return linear(_gated(linear(x, w_gate), linear(x, w_up), x.dtype), w_down)


def moe_experts_reference(x, expert_ids, expert_weights, w_gate, w_up, w_down, shared=None):
    """Token by token, slot by slot: readable, and invariant by construction."""
    rows = []
    for n in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32)
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[n, j])
            y = _expert_mlp(x[n:n + 1], w_gate[e], w_up[e], w_down[e])[0]
            acc = acc + expert_weights[n, j].float() * y.float()
        if shared is not None:
            acc = acc + _expert_mlp(x[n:n + 1], *shared)[0].float()
        rows.append(acc.to(x.dtype))
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


def _slot_outputs_by_expert(x, expert_ids, w_gate, w_up, w_down):
    """Per-slot expert outputs [N, k, D] fp32, one expert at a time over all its rows (ascending
    token), differentiable (autograd sums each token's gradient over the experts' gathers)."""
    n_tokens, k = expert_ids.shape
    slot_out = torch.zeros(n_tokens, k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(expert_ids).tolist():  # ascending expert id
        tok, slot = (expert_ids == e).nonzero(as_tuple=True)
        slot_out = slot_out.index_put((tok, slot), _expert_mlp(x[tok], w_gate[e], w_up[e], w_down[e]).float())
    return slot_out


def _slot_outputs_sorted(x, expert_ids, w_gate, w_up, w_down):
    """`_slot_outputs_by_expert` without autograd, with fewer ops: the (token, slot) pairs sorted by
    expert once (a stable sort keeps ascending tokens within an expert, nonzero's order), every row
    gathered once, and silu(gate) * up (elementwise, position-independent) run once over every
    expert's rows. Each expert's three GEMMs see the rows, in the order, of the loop above. Where
    every expert got at most a tile of rows, its GEMMs are one bmm per weight over all experts,
    checked to give each row the bits of the per-expert call (cpu_grouped.py)."""
    n_tokens, k = expert_ids.shape
    slot_out = torch.zeros(n_tokens, k, x.shape[1], dtype=torch.float32, device=x.device)
    flat = expert_ids.reshape(-1)
    pairs = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate.shape[0]).tolist()
    rows = x[pairs // k]
    tiles = cpu_grouped.ExpertTiles.fit(counts, flat[pairs], x, w_gate, w_up, w_down)
    if tiles is not None:  # every expert within one tile: one bmm per weight, the loop's bits
        block = tiles.scatter(rows)
        gate, up = cpu_grouped.bmm_grouped(block, w_gate), cpu_grouped.bmm_grouped(block, w_up)
        h = _gated(gate, up, x.dtype)
        slot_out[pairs // k, pairs % k] = tiles.gather(cpu_grouped.bmm_grouped(h, w_down)).float()
        return slot_out
    spans, gates, ups = [], [], []
    start = 0
    for e, count in enumerate(counts):
        if count:
            xe = rows[start:start + count]
            gates.append(linear(xe, w_gate[e]))
            ups.append(linear(xe, w_up[e]))
            spans.append((e, start, count))
        start += count
    if not spans:
        return slot_out
    h = _gated(torch.cat(gates), torch.cat(ups), x.dtype)
    out = torch.cat([linear(h[a:a + count], w_down[e]) for e, a, count in spans])
    slot_out[pairs // k, pairs % k] = out.float()
    return slot_out


def _moe_experts_grouped(x, expert_ids, expert_weights, w_gate, w_up, w_down, shared=None):
    # per-slot expert outputs, [N, k, D] fp32; each expert runs once over all its rows
    if records_graph(x, expert_weights, w_gate, w_up, w_down, *(shared or ())):
        slot_out = _slot_outputs_by_expert(x, expert_ids, w_gate, w_up, w_down)
    else:
        slot_out = _slot_outputs_sorted(x, expert_ids, w_gate, w_up, w_down)
    # ids are ascending per token, so slot order is expert order
    return slot_sum_composed(slot_out, expert_weights.float(), None if shared is None else _expert_mlp(x, *shared),
                             x.dtype)


def slot_sum_composed(slot_out: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """`slot_sum` as torch ops (what autograd records, and the CPU and "torch" paths)."""
    acc = weights[:, 0, None] * slot_out[:, 0]
    for j in range(1, slot_out.shape[1]):
        acc = acc + weights[:, j, None] * slot_out[:, j]
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(dtype)


def slot_sum(slot_out: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
             dtype: torch.dtype) -> torch.Tensor:
    """The MoE combine: slot outputs [T, k, D] fp32, weights [T, k] fp32, the shared expert's
    output [T, D] | None -> [T, D] in `dtype`: w_0 * y_0 + w_1 * y_1 + ... in fp32 in slot order,
    each product and each sum rounded on its own, the shared output added last, one cast. On the
    Triton path one launch (the fused MoE's combine kernel) instead of 2k + 2 torch ops, with
    their bits. No autograd here (zmrl.model.mlp.combine_slots writes the backward)."""
    if path_for(slot_out) == "triton":
        return triton_ops().slot_sum(slot_out, weights, shared, dtype)
    return slot_sum_composed(slot_out, weights, shared, dtype)


def moe_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [N, D], expert_ids [N, k] (ascending per token), expert_weights [N, k] fp32,
    w_gate/w_up [E, I, D], w_down [E, D, I], shared = (gate [Is, D], up [Is, D], down [D, Is])
    -> [N, D] in x's dtype. Differentiable in x, the weights and expert_weights."""
    check_float("x", x)
    check_dim("x", x, 2, "[N, D]")
    check_index("expert_ids", expert_ids)
    check_dim("expert_ids", expert_ids, 2, "[N, k]")
    check_size("expert_weights", tuple(expert_weights.shape), tuple(expert_ids.shape), "shape vs expert_ids")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        check_float(name, w)
        check_dim(name, w, 3, "[E, out, in]")
    check_size("w_up", tuple(w_up.shape), tuple(w_gate.shape), "shape vs w_gate")
    check_size("w_down", tuple(w_down.shape), (w_gate.shape[0], x.shape[1], w_gate.shape[1]), "shape [E, D, I]")
    check_size("w_gate", w_gate.shape[2], x.shape[1], "input dim vs x")
    check_same_device(x=x, expert_ids=expert_ids, expert_weights=expert_weights, w_gate=w_gate)
    if expert_ids.numel():  # deferred on a GPU (no host sync; see zmrl.batch_invariant.fail_if)
        e = w_gate.shape[0]
        fail_if(((expert_ids < 0) | (expert_ids >= e)).any(), f"expert_ids must lie in [0, {e})",
                lambda: f"got range [{int(expert_ids.min())}, {int(expert_ids.max())}]")
        fail_if((expert_ids[:, 1:] <= expert_ids[:, :-1]).any(),
                "expert_ids must be strictly ascending per token (use zmrl.batch_invariant.topk)")
    path = path_for(x)
    if path in ("triton", "torch"):
        impl = triton_ops() if path == "triton" else torch_ops()
        return impl.moe_experts(x, expert_ids.long(), expert_weights, w_gate, w_up, w_down, shared)
    if path == "reference":
        return moe_experts_reference(x, expert_ids, expert_weights, w_gate, w_up, w_down, shared)
    return _moe_experts_grouped(x, expert_ids, expert_weights, w_gate, w_up, w_down, shared)


def grouped_expert_slots_run_here(x: torch.Tensor) -> bool:
    """Whether `moe_expert_slots` runs for x: on the Triton path only (the CPU path composes the
    experts from per-expert `linear` calls, zmrl.model.mlp)."""
    return path_for(x) == "triton"


def moe_expert_slots(x_leaves: list[torch.Tensor], expert_ids: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, lora_gate_up: tuple[torch.Tensor, torch.Tensor] | None,
                     lora_down: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
                     first_leaf: int, per_leaf: int, first_expert: int = 0, *, total_leaves: int) -> torch.Tensor:
    """The routed experts as grouped GEMMs with their LoRA terms (Triton path): per-slot outputs
    [T, k, D] fp32, bit for bit the per-expert `linear(x, W) + linear(linear(x, A), B) * scale`
    composition, differentiable in every x alias (one per canonical expert leaf this host holds),
    the factors and the expert weights; zeros for the slots of experts outside this host's leaves
    (total_leaves: the model's leaf count). See
    zmrl/batch_invariant/triton/moe_lora.py."""
    if not grouped_expert_slots_run_here(x_leaves[0]):
        raise ValueError(f"moe_expert_slots runs on the Triton path only, not {path_for(x_leaves[0])!r}")
    check_index("expert_ids", expert_ids)
    check_dim("expert_ids", expert_ids, 2, "[T, k]")
    return triton_ops().moe_expert_slots(x_leaves, expert_ids, gate_up, down, lora_gate_up, lora_down, scale,
                                         first_leaf, per_leaf, first_expert, total_leaves=total_leaves)
