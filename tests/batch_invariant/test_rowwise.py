import pytest
import torch
import torch.nn.functional as F

import zmrl.batch_invariant as bi
from tests.batch_invariant.invariance import assert_bitwise, count_variant_rows, torch_threads

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
WIDE = 128_000  # a vocabulary-sized row: wide enough that torch splits one row across threads


def _x(rows, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, d, generator=g) * 3).to(dtype)


def _rms64(x, w, eps):
    xd = x.double()
    return xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps) * w.double()


OPS = {
    "rms_norm": (lambda x: bi.rms_norm(x, torch.linspace(0.5, 1.5, x.shape[-1]).to(x.dtype), 1e-6),
                 lambda x: _rms64(x, torch.linspace(0.5, 1.5, x.shape[-1]).to(x.dtype), 1e-6)),
    "softmax": (lambda x: bi.softmax(x, -1), lambda x: torch.softmax(x.double(), -1)),
    "log_softmax": (lambda x: bi.log_softmax(x, -1), lambda x: torch.log_softmax(x.double(), -1)),
    "mean": (lambda x: bi.mean(x, -1), lambda x: x.double().mean(-1)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPS)
def test_matches_float64(name, dtype):
    ours, ref = OPS[name]
    x = _x(70, 200, dtype)
    for path in ("cpu", "reference"):
        with bi.use_path(path):
            torch.testing.assert_close(ours(x), ref(x).to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", OPS)
def test_rows_are_batch_invariant(name, dtype):
    ours, _ = OPS[name]
    assert count_variant_rows(ours, _x(200, 200, dtype)) == 0


@pytest.mark.parametrize("name", OPS)
def test_rows_are_batch_invariant_at_vocab_width(name):
    ours, _ = OPS[name]
    x = _x(130, WIDE, torch.float32)
    with torch_threads(2):
        assert count_variant_rows(ours, x, sizes=(1, 2, 64, 65, 130)) == 0


@pytest.mark.parametrize("name,torch_op", [
    ("mean", lambda x: x.mean(-1)),
    ("rms_norm", lambda x: F.rms_norm(x, (x.shape[-1],), eps=1e-6)),
])
def test_negative_control_torch_reductions_vary_at_vocab_width(name, torch_op):
    # With one row of 128K, torch splits that row's reduction over the threads; with many
    # rows it does not: the same row gets other bits. It takes >= 2 threads to show.
    x = _x(130, WIDE, torch.float32)
    with torch_threads(2):
        assert count_variant_rows(torch_op, x, sizes=(1, 2, 64, 65, 130)) > 0


def test_torch_softmax_happens_to_be_invariant_here():
    # torch's CPU softmax/log_softmax reduce each row in one thread at every width we
    # tried, so on this machine they have no negative control; zmrl owns them anyway so
    # the trainer and the engine run one implementation (and for the Triton path).
    x = _x(130, WIDE, torch.float32)
    with torch_threads(2):
        assert count_variant_rows(lambda t: torch.log_softmax(t, -1), x, sizes=(1, 2, 64, 65, 130)) == 0


def test_other_dims_and_mean_over_several_dims():
    x = _x(6, 40, torch.float32).view(6, 5, 8)
    torch.testing.assert_close(bi.softmax(x, 1), torch.softmax(x, 1))
    torch.testing.assert_close(bi.log_softmax(x, 0), torch.log_softmax(x, 0))
    torch.testing.assert_close(bi.mean(x, (0, 2)), x.mean((0, 2)))
    torch.testing.assert_close(bi.mean(x, 1, keepdim=True), x.mean(1, keepdim=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_float64(dtype):
    x = _x(70, 96, dtype)
    w = torch.linspace(0.5, 1.5, 96).to(dtype)
    g = _x(70, 96, dtype, seed=3)
    cases = [
        (lambda a, b: bi.rms_norm(a, b, 1e-6), lambda a, b: _rms64(a, b, 1e-6)),
        (lambda a, b: bi.log_softmax(a) * b, lambda a, b: torch.log_softmax(a, -1) * b),
        (lambda a, b: bi.softmax(a) * b, lambda a, b: torch.softmax(a, -1) * b),
        (lambda a, b: bi.mean(a, -1)[:, None] * b, lambda a, b: a.mean(-1)[:, None] * b),
    ]
    for ours, ref in cases:
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        ours(xa, wa).backward(g)
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        ref(xd, wd).backward(g.double())
        for got, want in ((xa.grad, xd.grad), (wa.grad, wd.grad)):
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
            else:  # bf16 grads (summed over rows in bf16 by autograd): compare in norm
                assert (got.double() - want).norm() <= 2e-2 * want.norm()


def test_threads_do_not_change_bits():
    x = _x(70, WIDE, torch.float32)
    with torch_threads(2):
        two = bi.log_softmax(x), bi.rms_norm(x, torch.ones(WIDE), 1e-6), bi.mean(x[:1], -1), \
            bi.rms_norm(x[:1], torch.ones(WIDE), 1e-6)
    with torch_threads(1):
        one = bi.log_softmax(x), bi.rms_norm(x, torch.ones(WIDE), 1e-6), bi.mean(x[:1], -1), \
            bi.rms_norm(x[:1], torch.ones(WIDE), 1e-6)
    for a, b, name in zip(one, two, ("log_softmax", "rms_norm", "mean of one row", "rms_norm of one row")):
        assert_bitwise(a, b, name)


def test_negative_control_torch_reductions_of_one_wide_row_change_with_the_threads():
    # what the test above would catch: torch splits a lone 128K row over its threads
    x = _x(1, WIDE, torch.float32)
    with torch_threads(2):
        two = x.mean(-1), F.rms_norm(x, (WIDE,), eps=1e-6)
    with torch_threads(1):
        one = x.mean(-1), F.rms_norm(x, (WIDE,), eps=1e-6)
    assert not torch.equal(one[0], two[0]) and not torch.equal(one[1], two[1])


def test_bad_input_is_named():
    x = _x(4, 8, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        bi.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        bi.rms_norm(x, torch.ones(8), 0.0)
    with pytest.raises(ValueError, match="dim=2"):
        bi.softmax(x, 2)
    with pytest.raises(TypeError, match="dtype"):
        bi.log_softmax(x.long())
    with pytest.raises(ValueError, match="at least one"):
        bi.mean(x, ())


def test_tree_sum_is_the_padded_pairwise_tree():
    # the written-out order: pad to a power of two with zeros, then add halves level by level
    from zmrl.batch_invariant.rowwise import tree_sum

    for d in (1, 2, 3, 7, 64, 100, 1000):
        x = _x(5, d, torch.float32, seed=d)
        width = 1 << max(0, d - 1).bit_length()
        level = torch.cat([x, x.new_zeros(5, width - d)], -1)
        while level.shape[-1] > 1:
            level = level[:, : level.shape[-1] // 2] + level[:, level.shape[-1] // 2:]
        assert_bitwise(tree_sum(x), level, f"d={d}")
