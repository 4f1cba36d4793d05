"""The MoE combine in one launch (zmrl.batch_invariant.triton.slot_sum) gives the bits of its torch
ops (zmrl.batch_invariant.slot_sum_composed: w_0 * y_0 + w_1 * y_1 + ... in fp32, each product and
sum rounded on its own, the shared output added last, one cast), compiled on a GPU and under the
interpreter here. Negative control: the same terms added in another order give other bits."""
import pytest
import torch

import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant import slot_sum_composed

from tests.batch_invariant.triton._util import randn
from tests.bitwise import assert_bitwise
from tests.bitwise import bit_pattern as bits

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(t, k, d, dtype, seed=0):
    slot_out = randn(t, k, d, device=DEV, seed=seed)
    weights = randn(t, k, device=DEV, seed=seed + 1).abs()
    weights[1, 0] = -0.0  # a -0.0 product: signed zeros must come out as torch's
    shared = randn(t, d, dtype=dtype, device=DEV, seed=seed + 2)
    return slot_out, weights, shared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 6])
@pytest.mark.parametrize("with_shared", [True, False])
def test_one_launch_gives_the_torch_ops_bits(dtype, k, with_shared):
    slot_out, weights, shared = _inputs(37, k, 200, dtype)
    shared = shared if with_shared else None
    got = tri.slot_sum(slot_out, weights, shared, dtype)
    want = slot_sum_composed(slot_out, weights, shared, dtype)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == (37, 200)
    assert_bitwise(bits(got), bits(want), f"k={k}")


def test_a_strided_slot_tensor_gives_the_same_bits():
    slot_out, weights, shared = _inputs(9, 4, 64, torch.bfloat16, seed=3)
    wide = torch.zeros(9, 4, 128, device=DEV)
    wide[..., :64] = slot_out
    got = tri.slot_sum(wide[..., :64], weights, shared, torch.bfloat16)
    assert_bitwise(bits(got), bits(slot_sum_composed(slot_out, weights, shared, torch.bfloat16)), "strided")


def test_negative_control_another_order_of_the_same_terms_differs():
    slot_out, weights, shared = _inputs(64, 6, 256, torch.float32, seed=5)
    got = tri.slot_sum(slot_out, weights, shared, torch.float32)
    reversed_order = slot_sum_composed(slot_out.flip(1), weights.flip(1), shared, torch.float32)
    assert not torch.equal(bits(got), bits(reversed_order)), "the comparison cannot see the order of the sum"


def test_bad_shapes_are_refused():
    slot_out, weights, shared = _inputs(5, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="fp32 weights"):
        tri.slot_sum(slot_out, weights[:, :1], shared, torch.float32)
    with pytest.raises(ValueError, match="fp32 slot outputs"):
        tri.slot_sum(slot_out.bfloat16(), weights, shared, torch.float32)
    with pytest.raises(ValueError, match=r"shared must be \[5, 8\]"):
        tri.slot_sum(slot_out, weights, shared[:, :4], torch.float32)
