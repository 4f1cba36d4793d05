"""The Triton sigmoid's backward in one launch gives the bits of its torch formula, (grad * y) *
(1 - y) in fp32 rounded step by step and cast to the input's dtype (the three or four torch ops it
replaces), compiled on a GPU and under the interpreter here, through autograd and alone.
Negative control: the same product associated the other way, grad * (y * (1 - y)), differs."""
import pytest
import torch

import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant.triton.elementwise import _sigmoid_backward, sigmoid_backward_composed

from tests.bitwise import bit_pattern as bits

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(DEV)
    up = (torch.randn(shape, generator=g) * torch.pow(10.0, 4 * torch.rand(shape, generator=g) - 2)).to(DEV)
    return x, up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (37, 64), (3, 1500)])
def test_autograd_gradient_has_the_formulas_bits(shape, dtype):
    x, up = _data(shape, dtype, 0)
    xg = x.clone().requires_grad_()
    y = tri.sigmoid(xg)
    y.backward(up)
    want = sigmoid_backward_composed(up, y.detach(), dtype)
    assert xg.grad.dtype == dtype and xg.grad.shape == x.shape
    assert torch.equal(bits(xg.grad), bits(want))


def test_a_strided_gradient_takes_torchs_ops_with_the_same_bits():
    x, up = _data((8, 20), torch.bfloat16, 1)
    y = tri.sigmoid(x)
    strided = up.t().contiguous().t()
    assert torch.equal(bits(_sigmoid_backward(strided, y, torch.bfloat16)),
                       bits(sigmoid_backward_composed(strided, y, torch.bfloat16)))


def test_negative_control_the_other_association_differs():
    x, up = _data((37, 64), torch.float32, 2)
    y = tri.sigmoid(x)
    assert not torch.equal(_sigmoid_backward(up, y, torch.float32), up * (y * (1.0 - y)))
