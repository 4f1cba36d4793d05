"""`add_scaled` (y + d * scale, how a LoRA delta joins its base output) in one Triton launch gives
the bits of torch's two eager ops, the product rounded to the dtype and then the sum, and the bits
of autograd's gradients through them: compiled on a GPU, under the interpreter here, for plain
rows, a transposed delta (the attention LoRA's per-head delta) and layouts the kernel leaves to
torch. Negative control: the same sum rounded once (the product kept in fp32) differs on these
inputs, so equality above is not a property of the data."""
import pytest
import torch

import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant import add_scaled, use_path
from zmrl.batch_invariant.elementwise import add_scaled_composed

from tests.bitwise import assert_bitwise
from tests.bitwise import bit_pattern as bits

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(0, 8), (1, 1), (3, 5), (37, 64), (5, 1500)]  # 1500 columns: two column blocks
SCALES = [2.0, 0.37, 1 / 3]


def _wide(shape, dtype, seed):
    """Normal values times 10^u, u uniform in [-3, 3): sums and products round at every scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.pow(10.0, 6 * torch.rand(*shape, generator=g) - 3)
    return x.to(dtype).to(DEV)


def _with_grads(fn, y, d, scale, upstream):
    y, d = y.detach().clone().requires_grad_(), d.detach().clone().requires_grad_()
    out = fn(y, d, scale)
    out.backward(upstream)
    return out.detach(), y.grad, d.grad


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_have_the_two_ops_bits_and_gradients(shape, dtype, scale):
    y, d, up = _wide(shape, dtype, 0), _wide(shape, dtype, 1), _wide(shape, dtype, 2)
    with torch.no_grad():
        plain = tri.add_scaled(y, d, scale)
    got = _with_grads(tri.add_scaled, y, d, scale, up)
    want = _with_grads(add_scaled_composed, y, d, scale, up)
    assert plain.dtype == dtype and plain.shape == y.shape and plain.is_contiguous()
    for name, a, b in zip(("no-grad output", "output", "y grad", "d grad"), (plain, *got), (want[0], *want)):
        assert torch.equal(bits(a), bits(b)), f"{name} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_transposed_delta_reads_in_place_with_the_same_bits(dtype):
    """absorb_uk / expand_uv add a per-head delta [H, T, C] transposed onto y [T, H, C]."""
    y, base = _wide((7, 3, 40), dtype, 3), _wide((3, 7, 40), dtype, 4)
    up = _wide((7, 3, 40), dtype, 5)

    def fn(fn_add):
        def run(y, base, scale):
            return fn_add(y, base.transpose(0, 1), scale)
        return run

    got = _with_grads(fn(tri.add_scaled), y, base, 0.37, up)
    want = _with_grads(fn(add_scaled_composed), y, base, 0.37, up)
    for name, a, b in zip(("output", "y grad", "d grad"), got, want):
        assert torch.equal(bits(a), bits(b)), f"{name} differs"
    assert got[2].stride() == want[2].stride(), "the delta's gradient keeps autograd's layout"


@pytest.mark.parametrize("layout", ["y transposed", "d column-strided", "4-D delta"])
def test_other_layouts_give_the_same_bits(layout):
    y, d = _wide((6, 10), torch.bfloat16, 6), _wide((6, 10), torch.bfloat16, 7)
    if layout == "y transposed":
        y = _wide((10, 6), torch.bfloat16, 6).t()
    elif layout == "d column-strided":
        d = _wide((6, 20), torch.bfloat16, 7)[:, ::2]
    else:
        y, d = _wide((2, 3, 4, 10), torch.bfloat16, 6), _wide((4, 3, 2, 10), torch.bfloat16, 7).permute(2, 1, 0, 3)
    with torch.no_grad():
        assert_bitwise(tri.add_scaled(y, d, 0.37), add_scaled_composed(y, d, 0.37), layout)


def test_the_public_op_takes_the_kernel_on_the_triton_path():
    y, d = _wide((9, 33), torch.bfloat16, 8), _wide((9, 33), torch.bfloat16, 9)
    with use_path("triton"), torch.no_grad():
        assert_bitwise(add_scaled(y, d, 0.37), add_scaled_composed(y, d, 0.37))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_negative_control_one_rounding_differs(dtype):
    y, d = _wide((37, 64), dtype, 0), _wide((37, 64), dtype, 1)
    once = (y.float() + d.float() * 0.37).to(dtype)
    with torch.no_grad():
        assert not torch.equal(tri.add_scaled(y, d, 0.37), once)


@pytest.mark.parametrize("bad,match", [
    (lambda y, d: (y, d[:, :-1], 1.0), "d has shape"),
    (lambda y, d: (y, d.float(), 1.0), "share one dtype"),
    (lambda y, d: (y, d.long(), 1.0), "d has dtype"),
    (lambda y, d: (y, d, "2"), "scale must be a real number"),
    (lambda y, d: (y, d, True), "scale must be a real number"),
])
def test_bad_arguments_raise_one_line(bad, match):
    y, d = _wide((4, 6), torch.bfloat16, 0), _wide((4, 6), torch.bfloat16, 1)
    for path in ("cpu", "triton"):
        with use_path(path), pytest.raises((TypeError, ValueError), match=match):
            add_scaled(*bad(y, d))
