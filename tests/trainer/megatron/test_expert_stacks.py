"""The routed experts live in stacked parameters that the MoE paths read with no copy.

The fused path (no adapter) and the grouped path (every expert with its LoRA) receive the stacked
parameters themselves (the same storage: a per-forward stack would be a second copy of every
expert, 79 GB at the k31-layer size), and the grouped path's factor gradients land in the trained
parameters with the per-expert path's bits. The grouped kernels run on CUDA only, so here the call
into them is replaced by a stand-in that records what it receives and runs the per-expert loop over
exactly those tensors. Expert-parallel runs of experts map to and from the canonical layout.
"""
import pytest
import torch

import zmrl.model.mlp as model_mlp
from tests.moe_lora import Looped, StubAdapter
from tests.trainer.megatron.conftest import random_adapter
from zmrl.model.mlp import expert_slot_outputs

pytestmark = pytest.mark.megatron

GU, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def _moe_and_input(mt, seed: int = 5, tokens: int = 12):
    layer = mt.cfg.first_k_dense_replace
    moe = mt.model.mlp(layer)
    gen = torch.Generator().manual_seed(seed)
    like = moe.experts.linear_fc1.weight
    x = (torch.randn(tokens, 1, mt.cfg.hidden_size, generator=gen) * 0.5).to(dtype=like.dtype, device=like.device)
    return layer, moe, x


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_fused_path_reads_the_expert_stacks_without_a_copy(mt, monkeypatch):
    _, moe, x = _moe_and_input(mt)
    fc1, fc2 = moe.experts.linear_fc1, moe.experts.linear_fc2
    seen = {}
    real = model_mlp.moe_experts

    def spy(x, ids, weights, w_gate, w_up, w_down, shared):
        seen.update(gate=w_gate, up=w_up, down=w_down)
        return real(x, ids, weights, w_gate, w_up, w_down, shared)

    monkeypatch.setattr(model_mlp, "moe_experts", spy)
    inter = mt.cfg.moe_intermediate_size
    mt.model.set_lora_enabled(False)  # no active expert adapter: the fused path
    try:
        with torch.no_grad():
            moe(x)
    finally:
        mt.model.set_lora_enabled(True)
    assert seen, "the fused MoE path did not run"
    assert seen["gate"].data_ptr() == fc1.weight.data_ptr() and _same_storage(seen["gate"], fc1.weight)
    assert seen["up"].data_ptr() == fc1.weight[:, inter:].data_ptr() and _same_storage(seen["up"], fc1.weight)
    assert seen["down"].data_ptr() == fc2.weight.data_ptr() and _same_storage(seen["down"], fc2.weight)
    # the control: a stack of the experts (what the fused path read before) is another storage
    assert not _same_storage(torch.stack(list(fc1.weight.unbind(0))), fc1.weight)


def test_grouped_path_reads_the_expert_stacks_and_trains_them_with_the_per_expert_bits(mt, monkeypatch):
    layer, moe, x = _moe_and_input(mt)
    mt.load_adapter_tensors(random_adapter(mt, seed=2))
    fc1, fc2 = moe.experts.linear_fc1, moe.experts.linear_fc2
    params = [fc1.lora_A, fc1.lora_B, fc2.lora_A, fc2.lora_B]
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).to(dtype=x.dtype, device=x.device)

    def run():
        for p in params:
            p.grad = None
        out = moe(x.clone().requires_grad_(True))[0]
        out.backward(upstream)
        return out.detach(), [p.grad.clone() for p in params]

    # the per-expert loop over views of the stacks (the CPU path; on CUDA the grouped kernels' own
    # gradients are not this loop's bits, so the loop is forced there)
    monkeypatch.setattr(model_mlp, "grouped_expert_slots_run_here", lambda t: False)
    loop_out, loop_grads = run()

    seen = []

    def grouped_kernel(x_leaves, ids, gate_up, down, lora_gu, lora_d, scale, first_leaf, per_leaf, first_expert, *,
                       total_leaves):
        assert total_leaves == len(x_leaves)  # one host: every leaf here
        seen.append((gate_up, down, lora_gu, lora_d, first_expert))
        # the kernels' arithmetic by the per-expert loop, over exactly the tensors received
        proj = Looped(StubAdapter({GU: lora_gu, DOWN: lora_d}, scale), layer)
        return expert_slot_outputs(mt.cfg, {GU: gate_up, DOWN: down}, x_leaves[0], ids, proj)

    monkeypatch.setattr(model_mlp, "grouped_expert_slots_run_here", lambda t: True)
    monkeypatch.setattr(model_mlp, "moe_expert_slots", grouped_kernel)
    grouped_out, grouped_grads = run()

    assert len(seen) == 1, "the grouped expert path did not run (once)"
    gate_up, down, lora_gu, lora_d, first = seen[0]
    assert first == 0 and gate_up is fc1.weight and down is fc2.weight
    for got, want in zip((*lora_gu, *lora_d), params):
        assert got is want and got.data_ptr() == want.data_ptr()
    assert torch.equal(grouped_out, loop_out)
    for name, g, want in zip(("fc1 A", "fc1 B", "fc2 A", "fc2 B"), grouped_grads, loop_grads):
        assert torch.equal(g, want), name
    # a gradient that flowed: a zero one would not tell the two paths apart
    assert all(float(g.abs().max()) > 0 for g in loop_grads)


def test_expert_parallel_runs_map_to_and_from_the_canonical_layout(mt, lora_config):
    """EP = 2: each rank's stacked parameters take its run of experts; gathering every rank's
    stacks gives back the canonical tensors bit for bit; one rank's runs alone do not tile them."""
    from zmrl.trainer.megatron.convert import Layout, base_shapes, gather, lora_shapes, scatter

    layer = mt.cfg.first_k_dense_replace
    canonical_base = mt.hf_state_dict()
    canonical_lora = random_adapter(mt, seed=4)
    layouts = [Layout(mt.cfg, 1, 0, ep=2, ep_rank=r) for r in range(2)]
    cases = ((Layout.base, canonical_base, base_shapes(mt.cfg), f"model.layers.{layer}.mlp.experts."),
             (lambda lay: lay.lora(lora_config), canonical_lora, lora_shapes(mt.cfg, lora_config),
              f"layers_{layer}__mlp__experts__"))
    for slots_of, canonical, shapes, prefix in cases:
        keys = {k for k in shapes if k.startswith(prefix)}
        assert len(keys) == (2 if slots_of is Layout.base else 4)
        slots = [[s for s in slots_of(lay) if s.key in keys] for lay in layouts]
        params = []
        for lay, ss in zip(layouts, slots):
            params.append({s.param: torch.full((s.num_experts, *canonical[s.key].shape[1:]), float("nan"),
                                               dtype=canonical[s.key].dtype, device=canonical[s.key].device)
                           for s in ss})
            scatter(lay, ss, canonical, params[-1])
            assert all(s.num_experts == mt.cfg.n_routed_experts // 2 and s.expert == lay.ep_rank * s.num_experts
                       for s in ss)
        back = gather(layouts, slots, params, {k: shapes[k] for k in keys})
        for k in keys:
            assert torch.equal(back[k], canonical[k]), k
        with pytest.raises(ValueError, match="do not tile"):
            gather(layouts[1:], slots[1:], params[1:], {k: shapes[k] for k in keys})
