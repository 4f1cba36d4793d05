"""zmrl.batch_invariant.rope: the CPU and reference paths are the torch expression apply_rope ran
before the op existed, forward and backward, to the bit; bad arguments fail with one clear line.

The Triton path's bits are checked against the same expression in tests/batch_invariant/triton.
"""
import pytest
import torch

from zmrl.batch_invariant import rope, use_path
from zmrl.model.attention import apply_rope

from tests.batch_invariant.rope_oracle import old_expression, tables, value_and_grad
from tests.bitwise import bit_pattern as bits

T, H, R = 5, 3, 8


@pytest.mark.parametrize("path", ["cpu", "reference", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(T, H, R), (T, R), (T, 2, H, R)])
def test_paths_are_the_old_expression(path, dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    grad = torch.randn(shape, generator=gen).to(dtype)
    cos, sin = tables(T, R // 2)
    want = value_and_grad(old_expression, x, cos, sin, grad)
    with use_path(path):
        got = value_and_grad(rope, x, cos, sin, grad)
    for g, w, what in zip(got, want, ("out", "grad_x")):
        assert g.dtype == dtype and g.shape == shape
        assert torch.equal(bits(g), bits(w)), f"{path} {what} differs from the old expression"


def test_non_contiguous_x_and_apply_rope():
    # q_rope is a slice of the last dim of the projection's output
    q = torch.randn(T, H, 4 + R, generator=torch.Generator().manual_seed(2)).bfloat16()
    cos, sin = tables(T, R // 2)
    x = q[..., 4:]
    assert not x.is_contiguous()
    want = old_expression(x, cos, sin)
    assert torch.equal(bits(rope(x, cos, sin)), bits(want))
    assert torch.equal(bits(apply_rope(x, cos, sin)), bits(want))


_C, _S = tables(T, R // 2)
_X = torch.zeros(T, H, R)
BAD = {
    "x int": ((_X.int(), _C, _S), TypeError, "x has dtype torch.int32"),
    "x 1-D": ((_X[0, 0], _C[0], _S[0]), ValueError, "x must be [T, ..., R] (at least 2-D)"),
    "R odd": ((_X[..., :7], _C, _S), ValueError, "R = 7 must be even"),
    "cos bf16": ((_X, _C.bfloat16(), _S), TypeError, "cos has dtype torch.bfloat16"),
    "sin fp64": ((_X, _C, _S.double()), TypeError, "sin has dtype torch.float64"),
    "cos 3-D": ((_X, _C[:, None], _S[:, None]), ValueError, "cos must be 2-D [T, R/2]"),
    "sin shape": ((_X, _C, _S[:, :2]), ValueError, "sin must have cos's shape (5, 4), got (5, 2)"),
    "cos rows": ((_X, _C[:4], _S[:4]), ValueError, "cos: T (rows) vs x.shape[0] is 4, expected 5"),
    "cos width": ((_X[..., :6], _C, _S), ValueError, "cos: width vs R/2 = x.shape[-1] / 2 is 4, expected 3"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_fail_with_one_line(case):
    args, exc, text = BAD[case]
    with pytest.raises(exc) as info:
        rope(*args)
    message = str(info.value)
    assert text in message and "\n" not in message, message
