"""The CPU paths rely on one property of this machine's torch: exp, log and rsqrt give the
same bits in a vector lane and in a scalar loop tail, so an element's result cannot depend
on where it sits in a tensor. This checks that property, and shows (negative control) that
torch.sigmoid and silu do not have it, which is why zmrl builds them from exp."""
import torch
import torch.nn.functional as F


def _tail_mismatches(fn, x):
    # 31 elements is less than one unrolled vector iteration: all of them take the scalar tail
    chunks = x[: 31 * (x.numel() // 31)].view(-1, 31)
    as_tails = torch.cat([fn(c) for c in chunks])
    return int((as_tails != fn(x)[: as_tails.numel()]).sum())


def _values():
    return torch.randn(31 * 4000, generator=torch.Generator().manual_seed(0)) * 20


def test_exp_log_rsqrt_are_position_independent():
    x = _values()
    assert _tail_mismatches(torch.exp, x) == 0
    assert _tail_mismatches(torch.log, x.abs() + 1e-30) == 0
    assert _tail_mismatches(torch.rsqrt, x.abs() + 1e-30) == 0


def test_negative_control_torch_sigmoid_and_silu_depend_on_position():
    x = _values()
    assert _tail_mismatches(torch.sigmoid, x) > 0
    assert _tail_mismatches(F.silu, x) > 0


def test_zmrl_sigmoid_and_silu_are_position_independent():
    from zmrl.batch_invariant import sigmoid, silu

    x = _values()
    assert _tail_mismatches(sigmoid, x) == 0
    assert _tail_mismatches(silu, x) == 0
    torch.testing.assert_close(sigmoid(x), torch.sigmoid(x))
    torch.testing.assert_close(silu(x), F.silu(x))
