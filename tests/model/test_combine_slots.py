"""The MoE combine's written-out backward (zmrl.model.mlp.combine_slots) gives autograd's
gradients of the combine's torch ops bit for bit, signed zeros included, on any device; negative
control: the same products without the sign normalization differ from autograd exactly where a
product is -0.0, so the comparison sees zero signs."""
import pytest
import torch

from zmrl.batch_invariant import slot_sum_composed
from zmrl.model.mlp import combine_slots

from tests.bitwise import assert_bitwise
from tests.bitwise import bit_pattern as bits

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def composed(slot_out, weights, shared, dtype):
    """The combine's torch ops recorded by autograd as they are (the oracle for the backward)."""
    return slot_sum_composed(slot_out, weights.float(), shared, dtype)


def inputs(t, k, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    slot_out = torch.randn(t, k, d, generator=g)
    weights = torch.rand(t, k, generator=g)
    weights[0] = 0.0  # products of +-0.0: the signed-zero cases
    weights[1, 0] = -0.0
    slot_out[2] = -0.0
    shared = torch.randn(t, d, generator=g).to(dtype)
    grad = torch.randn(t, d, generator=g).to(dtype)
    grad[3] = -0.0
    grad[4, : d // 2] = 0.0
    return [x.to(device) for x in (slot_out, weights, shared, grad)]


def value_and_grads(fn, slot_out, weights, shared, grad, dtype):
    leaves = [x.detach().clone().requires_grad_() for x in (slot_out, weights, shared)]
    out = fn(*leaves, dtype)
    grads = torch.autograd.grad(out, leaves, grad)
    return out.detach(), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 6])
def test_gradients_are_autograds_bits(device, dtype, k):
    args = inputs(37, k, 40, dtype, device)
    got, got_grads = value_and_grads(combine_slots, *args, dtype)
    want, want_grads = value_and_grads(composed, *args, dtype)
    # the forward is the subject on CUDA (a kernel there); on the CPU it runs these same ops
    assert_bitwise(bits(got), bits(want), "forward")
    for name, a, b in zip(("slot outputs", "weights", "shared"), got_grads, want_grads):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_bitwise(bits(a), bits(b), f"gradient of the {name}")
    with torch.no_grad():  # inference: the same ops without the Function
        assert_bitwise(bits(combine_slots(*args[:3], dtype)), bits(want), "forward without autograd")


def test_without_shared_expert():
    slot_out, weights, _, grad = inputs(9, 4, 16, torch.float32, "cpu", seed=1)
    leaves = [x.clone().requires_grad_() for x in (slot_out, weights)]
    got = torch.autograd.grad(combine_slots(*leaves, None, torch.float32), leaves, grad)
    want = torch.autograd.grad(composed(*leaves, None, torch.float32), leaves, grad)
    for a, b in zip(got, want):
        assert_bitwise(bits(a), bits(b), "no shared expert")


def test_negative_control_unnormalized_products_differ_in_zero_signs():
    slot_out, weights, shared, grad = inputs(37, 6, 40, torch.float32, "cpu")
    _, want_grads = value_and_grads(composed, slot_out, weights, shared, grad, torch.float32)
    raw = torch.mul(grad.float()[:, None, :], weights.float()[:, :, None])  # the products, no "+ 0.0"
    assert torch.equal(raw, want_grads[0])  # equal as numbers ...
    assert not torch.equal(bits(raw), bits(want_grads[0]))  # ... not as bits: -0.0 vs +0.0
