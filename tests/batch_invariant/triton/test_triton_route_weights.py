"""The router's weights in one launch (zmrl.batch_invariant.triton.route_weights) give the bits of the
torch expression (zmrl.batch_invariant.moe.route_weights_composed: gather, add the chosen scores in
slot order, divide, scale) and the bits of autograd's gradient through it, compiled on a GPU and
under the interpreter here; moe_route on the Triton path is unchanged by it. Negative controls: the
same sum in reversed slot order, and a reassociated but mathematically equal backward, differ."""
import pytest
import torch

import zmrl.batch_invariant.moe as moe
import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant import use_path
from zmrl.batch_invariant.moe import route_weights_composed

from tests.batch_invariant.triton._util import randn
from tests.bitwise import assert_bitwise
from tests.bitwise import bit_pattern as bits

DEV = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [(n, e, k) for n in (0, 1, 37) for e in (8, 64) for k in (1, 6, 16) if k <= e]


def _scores(n, e, wild, seed):
    """fp32 scores in (0, 1); wild: each also scaled by 10^-u, u uniform in [0, 30), so the chosen
    scores of a row span up to 30 orders of magnitude and every rounding step shows."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(n, e, generator=g)
    if wild:
        s = s * torch.pow(10.0, -30 * torch.rand(n, e, generator=g))
    return s.to(DEV)


def _ids(n, e, k, seed):
    """k distinct experts per row, ascending (what moe_route's top-k gives)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(e, generator=g)[:k].sort().values for _ in range(n)]
    return (torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)).to(DEV)


def _case(n, e, k, wild, seed=0):
    return _scores(n, e, wild, seed), _ids(n, e, k, seed + 1), randn(n, k, device=DEV, seed=seed + 2)


def _grad(fn, scores, ids, scale, upstream):
    x = scores.clone().requires_grad_()
    w = fn(x, ids, scale)
    w.backward(upstream)
    return w.detach(), x.grad


@pytest.mark.parametrize("wild", [False, True])
@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("n,e,k", SHAPES)
def test_weights_and_gradient_have_the_expression_bits(n, e, k, scale, wild):
    scores, ids, upstream = _case(n, e, k, wild)
    with torch.no_grad():  # the graph-free launch
        plain = tri.route_weights(scores, ids, scale)
    got_w, got_g = _grad(tri.route_weights, scores, ids, scale, upstream)
    want_w, want_g = _grad(route_weights_composed, scores, ids, scale, upstream)
    assert got_w.shape == want_w.shape == (n, k) and got_g.shape == want_g.shape == (n, e)
    assert_bitwise(bits(plain), bits(want_w), "weights without a graph")
    assert_bitwise(bits(got_w), bits(want_w), "weights")
    assert_bitwise(bits(got_g), bits(want_g), "gradient w.r.t. scores")


def test_non_contiguous_inputs_and_an_inexact_scale():
    scores, ids, upstream = _case(37, 64, 6, wild=True, seed=3)
    wide = torch.zeros(37, 128, device=DEV)
    wide[:, 1::2] = scores  # every other column: strides (128, 2)
    ids_t = ids.t().contiguous().t()  # column-major ids: strides (1, 37)
    scale = 2.827  # not an fp32 value: rounded to fp32 first, as torch does
    got = _grad(tri.route_weights, wide[:, 1::2], ids_t, scale, upstream)
    want = _grad(route_weights_composed, scores, ids, scale, upstream)
    assert_bitwise(bits(got[0]), bits(want[0]), "weights")
    assert_bitwise(bits(got[1]), bits(want[1]), "gradient w.r.t. scores")


def _reversed_sum(scores, ids, scale):
    """route_weights_composed with the slots added last to first: the only difference."""
    chosen = scores.gather(1, ids)
    total = chosen[:, -1]
    for j in range(ids.shape[1] - 2, -1, -1):
        total = total + chosen[:, j]
    return chosen / total[:, None] * scale


def test_negative_control_the_slot_order_of_the_sum_shows():
    differs = 0
    for n, e, k in SHAPES:
        scores, ids, _ = _case(n, e, k, wild=True)
        if k > 2 and n:
            differs += not torch.equal(bits(tri.route_weights(scores, ids, 1.0)), bits(_reversed_sum(scores, ids, 1.0)))
    assert differs, "no case tells the slot order of the sum apart: the bitwise comparison proves nothing"


def _reassociated_grad(scores, ids, scale, upstream):
    """d(c_j / T * s) / d scores, with T as the forward adds it, written as (g_q - sum_i g_q,i * q_i)
    / T: equal in exact arithmetic to autograd's g_q / T - sum_i g_q,i * (c_i / T) / T, other roundings."""
    c = scores.gather(1, ids)
    t = c[:, :1]
    for j in range(1, ids.shape[1]):
        t = t + c[:, j:j + 1]
    g_q = upstream * scale
    g_c = (g_q - (g_q * (c / t)).sum(1, keepdim=True)) / t
    return torch.zeros_like(scores).scatter_add_(1, ids, g_c)


def test_negative_control_a_reassociated_backward_differs():
    scores, ids, upstream = _case(37, 64, 6, wild=False)
    _, got = _grad(tri.route_weights, scores, ids, 2.5, upstream)
    other = _reassociated_grad(scores, ids, 2.5, upstream)
    torch.testing.assert_close(other, got, rtol=1e-5, atol=1e-6)  # the same gradient up to rounding...
    assert not torch.equal(bits(other), bits(got)), "...whose bits the comparison must tell apart"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", [dict(top_k=6), dict(top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5)])
def test_moe_route_on_the_triton_path_is_unchanged(monkeypatch, dtype, route):
    """moe_route with the kernel against moe_route with the torch expression in its place (the code
    before the kernel): the same weights, ids and gradients w.r.t. x and the router, bit for bit."""
    x0 = randn(29, 32, dtype=dtype, device=DEV, seed=4)
    w0 = randn(16, 32, dtype=dtype, device=DEV, seed=5, scale=0.3)
    bias = randn(16, device=DEV, seed=6, scale=0.1)
    upstream = randn(29, route["top_k"], device=DEV, seed=7)

    def run():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with use_path("triton"):
            weights, ids = moe.moe_route(x, w, bias, **route)
            weights.backward(upstream)
        return weights.detach(), ids, x.grad, w.grad

    got = run()
    monkeypatch.setattr(moe, "route_weights", route_weights_composed)
    want = run()
    assert torch.equal(got[1], want[1]), "ids"
    for name, a, b in zip(("weights", "x.grad", "router.grad"), (got[0], got[2], got[3]), (want[0], want[2], want[3])):
        assert_bitwise(bits(a), bits(b), name)


def test_an_id_outside_the_experts_gives_nan_not_another_rows_score():
    scores, ids, _ = _case(3, 8, 2, wild=False)
    ids[1, 0] = -1  # top-k's padding
    ids[2, 1] = 8
    w = tri.route_weights(scores, ids, 1.0)
    assert torch.isnan(w[1:]).all() and not torch.isnan(w[0]).any()


def test_bad_arguments_are_refused():
    scores, ids, _ = _case(5, 8, 2, wild=False)
    with pytest.raises(ValueError, match="fp32 scores"):
        tri.route_weights(scores.double(), ids, 1.0)
    with pytest.raises(ValueError, match="int64 ids"):
        tri.route_weights(scores, ids.int(), 1.0)
    with pytest.raises(ValueError, match=r"1 to 8 slots"):
        tri.route_weights(scores, torch.zeros(5, 9, dtype=torch.int64, device=DEV), 1.0)
