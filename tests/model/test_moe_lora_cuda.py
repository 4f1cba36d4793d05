"""On CUDA the grouped expert path with LoRA gives the per-expert loop's bits, forward, and its
gradients do not depend on the batch a token shares. Shapes: the `small` preset's MoE layer
(64 experts, top-6, hidden 1024, moe_intermediate 256), rank-16 LoRA on every expert, 300 tokens.
"""
from types import SimpleNamespace

import pytest
import torch

from tests.bitwise import assert_bitwise
from tests.moe_lora import Looped, StubAdapter
from zmrl.batch_invariant import moe_experts
from zmrl.lora.adapter import LoraProjections
from zmrl.model.mlp import combine_slots, expert_slot_outputs
from zmrl.model.presets import PRESETS

pytestmark = pytest.mark.gpu

P = PRESETS["small"]
E, K, D, INTER, R, SCALE = (P["n_routed_experts"], P["num_experts_per_tok"], P["hidden_size"],
                            P["moe_intermediate_size"], 16, 2.0)






def _layer(dtype, zero_b=False, n=300):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).cuda()

    w = {"mlp.experts.gate_up_proj": rnd(E, 2 * INTER, D, scale=D ** -0.5),
         "mlp.experts.down_proj": rnd(E, D, INTER, scale=INTER ** -0.5)}
    bs = 0.0 if zero_b else 0.05
    pairs = {"mlp.experts.gate_up_proj": (rnd(E, R, D, scale=D ** -0.5), rnd(E, 2 * INTER, R, scale=bs)),
             "mlp.experts.down_proj": (rnd(E, R, INTER, scale=INTER ** -0.5), rnd(E, D, R, scale=bs))}
    x = rnd(n, D, scale=1.0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K].sort().values for _ in range(n)]).cuda()
    return w, pairs, x, ids


def _slots(w, pairs, x, ids, looped=False):
    proj = (Looped if looped else LoraProjections)(StubAdapter(pairs, SCALE), 0)
    return expert_slot_outputs(SimpleNamespace(moe_intermediate_size=INTER, n_routed_experts=E), w, x, ids, proj)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_lora_forward_equals_the_loop_on_cuda(dtype):
    w, pairs, x, ids = _layer(dtype)
    with torch.no_grad():
        assert_bitwise(_slots(w, pairs, x, ids), _slots(w, pairs, x, ids, looped=True), f"{dtype} grouped vs loop")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_zero_adapter_equals_the_fused_kernel_on_cuda(dtype):
    w, pairs, x, ids = _layer(dtype, zero_b=True)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)).cuda()
    gu, dn = w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"]
    with torch.no_grad():
        grouped = combine_slots(_slots(w, pairs, x, ids), weights, None, dtype)
        fused = moe_experts(x, ids, weights, gu[:, :INTER], gu[:, INTER:], dn)
    assert_bitwise(grouped, fused, f"{dtype} zero adapter vs fused moe_experts")


def test_negative_control_delta_kept_in_fp32_differs_on_cuda():
    # the LoRA delta's products kept in fp32 (not rounded to bf16 as the composed path rounds x A
    # and (x A) B) and joined unrounded: the comparison above must see that. (Only joining the
    # rounded delta unrounded would not do: with a power-of-two scale bf16(y + d * s) is the same
    # either way, torch's bf16 add rounding once.)
    from zmrl.batch_invariant import linear

    w, pairs, x, ids = _layer(torch.bfloat16)

    class _Unrounded(Looped):
        def expert_linear(self, name, expert, x, weight, rows=None):
            a, b = self.adapter.pair(self.layer, name)
            b = b[expert] if rows is None else b[expert][rows]
            delta = linear(linear(x.float(), a[expert].float()), b.float())
            return (linear(x, weight).float() + delta * SCALE).to(x.dtype)

    with torch.no_grad():
        got = expert_slot_outputs(SimpleNamespace(moe_intermediate_size=INTER, n_routed_experts=E), w, x, ids,
                                  _Unrounded(StubAdapter(pairs, SCALE), 0))
        assert not torch.equal(got, _slots(w, pairs, x, ids))


def test_grouped_lora_gradients_are_token_invariant_on_cuda():
    w, pairs, x, ids = _layer(torch.bfloat16)
    d_slot = torch.randn(x.shape[0], K, D, generator=torch.Generator().manual_seed(5)).cuda()

    def dx(rows):
        xl = x[rows].clone().requires_grad_()
        _slots(w, pairs, xl, ids[rows]).backward(d_slot[rows])
        return xl.grad

    full = dx(torch.arange(x.shape[0], device="cuda"))
    for n in (0, 1, 150, 299):
        for m in (1, 2, 31, 64):
            rows = torch.arange(n, n + m, device="cuda") % x.shape[0]
            assert torch.equal(dx(rows)[0], full[n]), f"token {n} with {m - 1} companions"


def _forward_and_dx(w, pairs, x, ids, d_slot):
    xl = x.clone().requires_grad_()
    out = _slots(w, pairs, xl, ids)
    out.backward(d_slot)
    return out.detach(), xl.grad


def test_the_grouped_launches_warps_and_stages_leave_the_bits_on_cuda(monkeypatch):
    # At these dims the gated forward and silu's backward hold two 128 x 128 fp32 tiles and launch
    # with 8 warps, a lone 128 x 128 accumulator with 3 stages (grouped._warps_stages); the config's
    # own 4 warps and 4 stages must give the same bits, forward and input gradient. Control: the
    # same launches with the hidden dimension's halves swapped in x, the gate/up weights and their
    # LoRA A (the same products, reduced in another K order) differ.
    from zmrl.batch_invariant.triton import grouped

    w, pairs, x, ids = _layer(torch.bfloat16)
    d_slot = torch.randn(x.shape[0], K, D, generator=torch.Generator().manual_seed(5)).cuda()
    base = grouped.config_for(INTER, D, torch.bfloat16)
    assert grouped._warps_stages(base, 128, 128, 2) == (8, base.num_stages) != (base.num_warps, base.num_stages)
    tuned = _forward_and_dx(w, pairs, x, ids, d_slot)
    with monkeypatch.context() as m:
        m.setattr(grouped, "_warps_stages", lambda base, bm, bn, live: (base.num_warps, base.num_stages))
        plain = _forward_and_dx(w, pairs, x, ids, d_slot)
    assert_bitwise(tuned[0], plain[0], "slot outputs: tuned vs the config's warps and stages")
    assert_bitwise(tuned[1], plain[1], "dx: tuned vs the config's warps and stages")

    swap = torch.cat([torch.arange(D // 2, D), torch.arange(D // 2)]).cuda()
    gu, dn = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
    w_swapped = {gu: w[gu][:, :, swap], dn: w[dn]}
    pairs_swapped = {gu: (pairs[gu][0][:, :, swap], pairs[gu][1]), dn: pairs[dn]}
    with torch.no_grad():
        control = _slots(w_swapped, pairs_swapped, x[:, swap], ids)
    assert not torch.equal(control, tuned[0])
