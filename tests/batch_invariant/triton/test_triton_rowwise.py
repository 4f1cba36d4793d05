"""Triton rms_norm / softmax / log_softmax / mean: numerics, row invariance, backward.

Rows up to 16384 long run in one register block; longer rows (vocabularies) stream through
4096-wide chunks. Both paths are covered: 20000 columns takes the chunked one.
"""
import pytest
import torch

import zmrl.batch_invariant.triton as tri

from tests.batch_invariant.triton._util import randn, rel_err, variant_rows

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}
WIDTHS = [7, 100, 20000]  # 20000 > 16384: the chunked path
ROW_OPS = {
    "rms_norm": lambda x, w: tri.rms_norm(x, w, 1e-6),
    "softmax": lambda x, w: tri.softmax(x, -1),
    "log_softmax": lambda x, w: tri.log_softmax(x, -1),
    "mean": lambda x, w: tri.mean(x, -1),
}


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
def test_gpu_row_ops_are_invariant_at_issue_batch_sizes(name, width, dtype):
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
