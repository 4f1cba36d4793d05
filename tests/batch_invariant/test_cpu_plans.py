"""Planned CPU GEMM calls (zmrl/batch_invariant/cpu_plans.py): a repeated call of one kind skips
the argument work but must run the GEMM its first call ran, bit for bit, and never stand in for a
call of another kind (another mode, autograd, bad input)."""
import pytest
import torch

import zmrl.batch_invariant as bi
from tests.batch_invariant.invariance import assert_bitwise
from zmrl.batch_invariant import cpu_gemm, cpu_plans
from zmrl.batch_invariant.exact_gemm import exact_mm


def _data(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=g).float())
    return x.to(dtype), (torch.randn(n, k, generator=g) / k**0.5).to(dtype)


def _unplanned(fn):
    """fn() on the full path: no plan of any kind exists when it runs."""
    cpu_plans.forget()
    return fn()


CALLS = {
    "linear": lambda x, w, b: bi.linear(x, w),
    "linear+bias": lambda x, w, b: bi.linear(x, w, b),
    "linear 3-D": lambda x, w, b: bi.linear(x.view(1, *x.shape), w),
    "linear strided x": lambda x, w, b: bi.linear(torch.cat([x, x], 1)[:, 1:x.shape[1] + 1], w),
    "matmul": lambda x, w, b: bi.matmul(x, w.t().contiguous()),
    "bmm": lambda x, w, b: bi.bmm(x.view(1, *x.shape).expand(2, -1, -1), w.t()[None].expand(2, -1, -1)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8, 33, 300])  # 300: through 256- and 32-row tiles where checked
@pytest.mark.parametrize("call", list(CALLS))
def test_a_planned_call_has_the_bits_of_the_full_path(call, m, dtype):
    fn = CALLS[call]
    x, w = _data(m, 96, 48, dtype)
    y, _ = _data(m, 96, 48, dtype, seed=1)  # other values, same kind
    b = torch.randn(48).to(dtype)
    want_x, want_y = _unplanned(lambda: fn(x, w, b)), _unplanned(lambda: fn(y, w, b))
    assert cpu_plans.count() >= 1  # the full path planned its kind
    assert_bitwise(fn(x, w, b), want_x, f"{call} M={m}, planned")
    assert_bitwise(fn(y, w, b), want_y, f"{call} M={m}, planned, other values")


def test_a_plan_replays_its_route_and_a_wrong_route_would_show():
    x, w = _data(5, 256, 48, torch.float32)
    cpu_plans.forget()
    full = bi.linear(x, w)
    (plan,) = {id(p): p for p in cpu_plans._PLANS.values()}.values()
    assert plan.route == cpu_gemm.mm_route(x, w.t())
    assert_bitwise(bi.linear(x, w), full, "planned")
    # negative control: the same plan on another route gives other bits, so the equality above
    # (and in the test before) would catch a plan that ran something else
    other = ("exact", 0, 1, ()) if plan.route[0] == "tiles" else ("tiles", 0, 1, ())
    plan.gemm = cpu_gemm.mm_for_rows(other, plan.rows)
    assert not torch.equal(bi.linear(x, w), full)
    cpu_plans.forget()


def test_plans_follow_the_mode_and_are_forgotten_with_the_decisions():
    x, w = _data(5, 256, 48, torch.float32)
    bi.linear(x, w)
    bi.linear(x, w)
    with bi.use_cpu_gemm("exact"):  # another mode is another kind: its own full path
        assert_bitwise(bi.linear(x, w), exact_mm(x, w.t()), "exact mode after a plan in auto")
    cpu_gemm.reset_decisions()
    assert cpu_plans.count() == 0


def test_autograd_calls_and_other_paths_are_never_planned():
    x, w = _data(5, 64, 48, torch.float32)
    cpu_plans.forget()
    xg = x.clone().requires_grad_()
    bi.linear(xg, w).sum().backward()
    assert cpu_plans.count() == 0 and xg.grad is not None
    with bi.use_path("torch"):
        bi.linear(x, w)
    assert cpu_plans.count() == 0


def test_bad_input_still_fails_after_a_good_call_of_the_same_shapes():
    x, w = _data(5, 64, 48, torch.float32)
    bi.linear(x, w)
    bi.linear(x, w)
    with pytest.raises(TypeError, match="dtype"):
        bi.linear(x.double(), w)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        bi.linear(x.tolist(), w)
    with pytest.raises(ValueError, match="K"):
        bi.matmul(x, w)
