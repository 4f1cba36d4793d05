"""`add_scaled` (y + d * scale, how a LoRA delta joins its base output) in one Triton launch gives
the bits of torch's two eager ops, the product rounded to the dtype and then the sum, and the bits
of autograd's gradients through them: compiled on a GPU, under the interpreter here, for plain
rows, a transposed delta (the attention LoRA's per-head delta) and layouts the kernel leaves to
torch. Negative control: the same sum rounded once (the product kept in fp32) differs on these
inputs, so equality above is not a property of the data."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
    x = torch.randn(shape, generator=g) * torch.pow(10.0, 6 * torch.rand(shape, generator=g) - 3)
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
    assert plain.dtype == dtype and plain.shape == y.shape and plain.stride() == want[0].stride()
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
        assert a.stride() == b.stride(), f"{name}: strides {a.stride()} vs {b.stride()}"


def _layout(name):
    y, d = _wide((6, 10), torch.bfloat16, 6), _wide((6, 10), torch.bfloat16, 7)
    if name == "y transposed":
        y = _wide((10, 6), torch.bfloat16, 6).t()
    elif name == "both transposed (absorb_uk's base and delta)":
        y, d = _wide((3, 7, 40), torch.bfloat16, 6).transpose(0, 1), _wide((3, 7, 40), torch.bfloat16, 7).transpose(0, 1)
    elif name == "y sliced":
        y = _wide((6, 20), torch.bfloat16, 6)[:, 5:15]
    elif name == "d column-strided":
        d = _wide((6, 20), torch.bfloat16, 7)[:, ::2]
    elif name == "1-D, d strided":
        y, d = _wide((10,), torch.bfloat16, 6), _wide((20,), torch.bfloat16, 7)[::2]
    elif name == "0-D":
        y, d = _wide((), torch.bfloat16, 6), _wide((), torch.bfloat16, 7)
    elif name == "size-1 dims":
        y, d = _wide((6, 1, 10, 1), torch.bfloat16, 6), _wide((1, 6, 10, 1), torch.bfloat16, 7).transpose(0, 1)
    else:
        y, d = _wide((2, 3, 4, 10), torch.bfloat16, 6), _wide((4, 3, 2, 10), torch.bfloat16, 7).permute(2, 1, 0, 3)
    return y, d


LAYOUTS = ["y transposed", "both transposed (absorb_uk's base and delta)", "y sliced", "d column-strided",
           "1-D, d strided", "0-D", "size-1 dims", "4-D delta"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_the_two_ops_bits_and_layout(layout):
    """Values and strides: the output takes the layout torch's expression gives it (y's, for a
    dense y), so whatever reads it next sees the same tensor."""
    y, d = _layout(layout)
    up = _wide(tuple(y.shape), torch.bfloat16, 8)
    got = _with_grads(tri.add_scaled, y, d, 0.37, up)
    want = _with_grads(add_scaled_composed, y, d, 0.37, up)
    for name, a, b in zip(("output", "y grad", "d grad"), got, want):
        assert torch.equal(bits(a), bits(b)), f"{layout}: {name} differs"
        assert a.stride() == b.stride(), f"{layout}: {name} strides {a.stride()} vs {b.stride()}"


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


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dense_bases_take_the_kernel_and_other_layouts_torchs_two_ops(layout):
    """Which path each layout takes: the kernel (no aten arithmetic) for a dense y whose delta
    reads as rows, torch's mul and add otherwise (the same bits, above)."""
    y, d = _layout(layout)
    with torch.no_grad(), _AtenOps() as ops:
        tri.add_scaled(y, d, 0.37)
    arithmetic = [n for n in ops.names if n.split(".")[0] in ("mul", "add")]
    composed = layout in ("y transposed", "y sliced", "d column-strided", "1-D, d strided", "4-D delta")
    assert arithmetic == (["mul.Tensor", "add.Tensor"] if composed else []), arithmetic


@pytest.mark.parametrize("path", ["cpu", "triton"])
def test_parameters_and_an_int_scale_pass_the_checks(path):
    """The quick argument test admits plain tensors and float or int scales; anything else (a
    Parameter, a numpy float) goes through the itemized checks and is accepted when valid."""
    import numpy as np

    y, d = _wide((4, 6), torch.float32, 0), torch.nn.Parameter(_wide((4, 6), torch.float32, 1))
    with use_path(path), torch.no_grad():
        for scale in (2, np.float64(0.37)):
            assert_bitwise(add_scaled(y, d, scale), add_scaled_composed(y, d, float(scale)))
