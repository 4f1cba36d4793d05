"""Triton rms_norm / softmax / log_softmax / mean: numerics, row invariance, backward.

Rows up to 16384 long run in one register block; longer rows (vocabularies) stream through
16384-wide chunks. Both paths are covered: 20000 columns takes the chunked one.
"""
import importlib

import pytest
import torch

import zmrl.batch_invariant.triton as tri

from tests.batch_invariant.triton._util import randn, rel_err, variant_rows
from tests.bitwise import assert_bitwise

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}
WIDTHS = [7, 100, 20000]  # 20000 > 16384: the chunked path
ROW_OPS = {
    "rms_norm": lambda x, w: tri.rms_norm(x, w, 1e-6),
    "softmax": lambda x, w: tri.softmax(x, -1),
    "log_softmax": lambda x, w: tri.log_softmax(x, -1),
    "mean": lambda x, w: tri.mean(x, -1),
}
GRAD_OPS = ["rms_norm", "softmax", "log_softmax"]  # the ones with a Triton backward kernel
GRAD_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}  # bf16: the saved output and dx are rounded


def _ref(name, x, w):
    xf = x.double()
    if name == "rms_norm":
        return xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6) * w.double()
    if name == "softmax":
        return torch.softmax(xf, -1)
    if name == "log_softmax":
        return torch.log_softmax(xf, -1)
    return xf.mean(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", list(ROW_OPS))
def test_row_ops_match_float64(dev, name, width, dtype):
    x = randn(3, width, dtype=dtype, device=dev, seed=1, scale=3.0)
    w = randn(width, dtype=dtype, device=dev, seed=2)
    got = ROW_OPS[name](x, w)
    assert got.dtype == dtype and got.shape == _ref(name, x, w).shape
    assert rel_err(got, _ref(name, x, w)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ROW_OPS))
def test_row_ops_are_batch_invariant(dev, name, dtype):
    pool = randn(12, 100, dtype=dtype, device=dev, seed=3, scale=3.0)
    w = randn(100, dtype=dtype, device=dev, seed=4)
    bad = variant_rows(lambda x: ROW_OPS[name](x, w), pool, (1, 2, 3, 9, 17))
    assert not bad, "\n".join(bad[:5])


def test_other_dims_and_edge_rows(dev):
    x = randn(3, 4, 5, device=dev, seed=5)
    assert rel_err(tri.softmax(x, 0), torch.softmax(x.double(), 0)) < TOL[torch.float32]
    assert rel_err(tri.log_softmax(x, 1), torch.log_softmax(x.double(), 1)) < TOL[torch.float32]
    got = tri.mean(x, (0, 2), keepdim=True)
    assert got.shape == (1, 4, 1) and rel_err(got, x.double().mean((0, 2), keepdim=True)) < TOL[torch.float32]
    row = torch.full((1, 20000), float("-inf"), device=dev)
    row[0, 12345] = 2.0  # one finite entry in a chunked row
    assert tri.softmax(row)[0, 12345].item() == 1.0 and tri.log_softmax(row)[0, 12345].item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_float64(dev, dtype):
    x = randn(5, 33, dtype=dtype, device=dev, seed=6).requires_grad_()
    w = randn(33, dtype=dtype, device=dev, seed=7).requires_grad_()
    g = randn(5, 33, dtype=dtype, device=dev, seed=8)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    tri.rms_norm(x, w, 1e-6).backward(g)
    _ref("rms_norm", xd, wd).backward(g.double())
    assert rel_err(x.grad, xd.grad) < 10 * TOL[dtype] and rel_err(w.grad, wd.grad) < 10 * TOL[dtype]
    for name, fn in (("log_softmax", tri.log_softmax), ("softmax", tri.softmax)):
        x.grad, xd.grad = None, None
        fn(x, -1).backward(g)
        _ref(name, xd, None).backward(g.double())
        assert rel_err(x.grad, xd.grad) < 10 * TOL[dtype], name


def _input_grad(name, x, g, w):
    """The gradient of ROW_OPS[name] at x against the incoming g, with the weight w frozen."""
    x = x.detach().requires_grad_()
    ROW_OPS[name](x, w).backward(g)
    return x.grad


def _ref_input_grad(name, x, g, w):
    xd = x.detach().double().requires_grad_()
    _ref(name, xd, w).backward(g.double())
    return xd.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (37, 64), (1, 1000), (37, 1000), (1, 20000), (3, 20000)])
@pytest.mark.parametrize("name", GRAD_OPS)
def test_backward_kernels_match_float64(dev, name, rows, width, dtype):
    # 20000 columns: the chunked path of the backward kernels
    x = randn(rows, width, dtype=dtype, device=dev, seed=12, scale=3.0)
    g = randn(rows, width, dtype=dtype, device=dev, seed=13)
    w = randn(width, dtype=dtype, device=dev, seed=14)
    got = _input_grad(name, x, g, w)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel_err(got, _ref_input_grad(name, x, g, w)) < GRAD_TOL[dtype]


@pytest.fixture(params=["single", "chunked"])
def grad_width(request, monkeypatch):
    """A row width for each path of the backward kernels; chunked: 200 columns in a 128-wide
    chunk and a ragged one (the real chunk is too wide for the interpreter's speed)."""
    if request.param == "single":
        return 100
    rowwise = importlib.import_module("zmrl.batch_invariant.triton.rowwise")
    monkeypatch.setattr(rowwise, "MAX_SINGLE_BLOCK", 128)
    monkeypatch.setattr(rowwise, "CHUNK", 128)
    assert rowwise._blocking(200)[:2] == (128, False)
    return 200


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", GRAD_OPS)
def test_backward_rows_are_batch_invariant(dev, name, dtype, grad_width):
    # x and the incoming gradient side by side: both reach the kernels as strided row views
    pool = randn(10, 2, grad_width, dtype=dtype, device=dev, seed=15, scale=3.0)
    w = randn(grad_width, dtype=dtype, device=dev, seed=16)
    bad = variant_rows(lambda p: _input_grad(name, p[:, 0], p[:, 1], w), pool, (1, 2, 5, 16))
    assert not bad, "\n".join(bad[:5])


@pytest.mark.parametrize("name", GRAD_OPS)
def test_backward_ignores_the_incoming_gradients_layout(dev, name):
    x = randn(6, 40, device=dev, seed=17, scale=3.0)
    w = randn(40, device=dev, seed=18)
    g = randn(40, 6, device=dev, seed=19)
    want = _input_grad(name, x, g.t().contiguous(), w)
    assert_bitwise(_input_grad(name, x, g.t(), w), want, "transposed gradient")
    row = g[:, 0].contiguous()
    assert_bitwise(_input_grad(name, x, row.expand(6, 40), w), _input_grad(name, x, row.repeat(6, 1), w),
                   "expanded gradient")


def test_softmax_backward_along_another_dim(dev):
    # dim 0 moves the reduced axis last: the gradient arrives transposed and strided
    x = randn(30, 4, device=dev, seed=20, scale=3.0)
    g = randn(30, 4, device=dev, seed=21)
    for fn in (tri.softmax, tri.log_softmax):
        xa, xb = x.clone().requires_grad_(), x.t().contiguous().requires_grad_()
        fn(xa, 0).backward(g)
        fn(xb, -1).backward(g.t().contiguous())
        assert_bitwise(xa.grad, xb.grad.t(), fn.__name__)


def test_backward_of_empty_inputs(dev):
    w = torch.ones(8, device=dev, requires_grad=True)
    for name in GRAD_OPS:
        x = torch.zeros(0, 8, device=dev, requires_grad=True)
        ROW_OPS[name](x, w).backward(torch.ones(0, 8, device=dev))
        assert x.grad.shape == (0, 8), name
    assert w.grad.shape == (8,) and not w.grad.any()
    # zero width: the public ops cannot reshape such rows, so the backward functions directly
    rowwise = importlib.import_module("zmrl.batch_invariant.triton.rowwise")
    empty = torch.zeros(3, 0, device=dev)
    assert rowwise.rms_norm_backward(empty, torch.zeros(0, device=dev), empty, 1e-6).shape == (3, 0)
    assert rowwise.softmax_backward(empty, empty, log=True).shape == (3, 0)


def test_rows_of_width_one(dev):
    # a compiled kernel sees a width of 1 as a Python int, not a tensor
    x = randn(5, 1, device=dev, seed=26, scale=3.0).requires_grad_()
    g = randn(5, 1, device=dev, seed=27)
    w = randn(1, device=dev, seed=28)
    assert rel_err(tri.rms_norm(x, w, 1e-6), _ref("rms_norm", x, w)) < TOL[torch.float32]
    # d/dx of x / |x| is 0 up to eps: only an absolute bound makes sense
    want = _ref_input_grad("rms_norm", x, g, w)
    assert (_input_grad("rms_norm", x, g, w).double() - want).abs().max() < 1e-6
    for name in ("softmax", "log_softmax"):  # one entry: the output is constant, the gradient 0
        assert not _input_grad(name, x, g, w).any(), name
    assert torch.equal(tri.mean(x.detach(), -1), x.detach()[:, 0]), "the mean of one value"


def test_bad_inputs_name_the_argument(dev):
    x = randn(2, 8, device=dev)
    with pytest.raises(ValueError, match="weight"):
        tri.rms_norm(x, randn(7, device=dev), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        tri.rms_norm(x, randn(8, device=dev), 0.0)
    with pytest.raises(TypeError, match="x"):
        tri.softmax(torch.ones(2, 3, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="dim"):
        tri.log_softmax(x, 2)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,width", [("rms_norm", 7168), ("log_softmax", 129280), ("softmax", 4096),
                                        ("mean", 7168)])
def test_gpu_row_ops_are_invariant_at_model_batch_sizes(name, width, dtype):
    pool = randn(32, width, dtype=dtype, device="cuda", seed=9, scale=3.0)
    w = randn(width, dtype=dtype, device="cuda", seed=10)
    bad = variant_rows(lambda x: ROW_OPS[name](x, w), pool, (1, 2, 3, 7, 8, 31, 64, 255, 256, 257, 1024))
    assert not bad, "\n".join(bad[:5])
    assert rel_err(ROW_OPS[name](pool[:4], w), _ref(name, pool[:4], w)) < TOL[dtype]


@pytest.mark.gpu
def test_gpu_negative_control_torch_sum_is_batch_variant():
    # torch's reduction splits one wide row over several blocks when there are few rows
    pool = randn(32, 129280, device="cuda", seed=11, scale=3.0)
    bad = variant_rows(lambda x: x.sum(-1), pool, (1, 2, 3, 64, 1024))
    assert bad, "torch.sum was invariant: the row tests above would prove nothing"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,rows,width", [("rms_norm", 14000, 1024), ("rms_norm", 4096, 7168),
                                             ("softmax", 8192, 4096), ("log_softmax", 1024, 129280)])
def test_gpu_backward_rows_are_invariant_at_training_shapes(name, rows, width, dtype):
    x = randn(rows, width, dtype=dtype, device="cuda", seed=22, scale=3.0)
    g = randn(rows, width, dtype=dtype, device="cuda", seed=23)
    w = randn(width, dtype=dtype, device="cuda", seed=24)
    full = _input_grad(name, x, g, w)
    cuts = [c for c in (0, 1, 8, 263, 1287) if c < rows] + [rows]  # pieces of 1, 7, 255, 1024 rows, the rest
    pieces = torch.cat([_input_grad(name, x[a:b], g[a:b], w) for a, b in zip(cuts, cuts[1:])])
    assert_bitwise(pieces, full, "batch cut into pieces")
    pick = torch.randint(0, rows, (24,), generator=torch.Generator().manual_seed(25)).tolist()
    alone = torch.cat([_input_grad(name, x[i:i + 1], g[i:i + 1], w) for i in pick])
    assert_bitwise(alone, full[pick], "rows alone")
    assert rel_err(full[:4], _ref_input_grad(name, x[:4], g[:4], w)) < GRAD_TOL[dtype]
