"""The CPU paths rely on one property of this machine's torch: exp, log and rsqrt give the
same bits in a vector lane and in a scalar loop tail, so an element's result cannot depend
on where it sits in a tensor (zmrl/batch_invariant/lanes.py, which `zmrl doctor` runs). This
checks that property, and shows (negative control) that torch.sigmoid and silu do not have it,
which is why zmrl builds them from exp."""
import pytest
import torch
import torch.nn.functional as F

from zmrl.batch_invariant.lanes import lane_report, position_mismatches, probe_values


def test_exp_log_rsqrt_are_position_independent():
    assert lane_report() == {"exp": 0, "log": 0, "rsqrt": 0}


def test_negative_control_torch_sigmoid_and_silu_depend_on_position():
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("torch runs no vector lanes here (capability DEFAULT): every op is position-independent")
    x = probe_values()
    assert position_mismatches(torch.sigmoid, x) > 0
    assert position_mismatches(F.silu, x) > 0


def test_zmrl_sigmoid_and_silu_are_position_independent():
    from zmrl.batch_invariant import sigmoid, silu

    x = probe_values()
    assert position_mismatches(sigmoid, x) == 0
    assert position_mismatches(silu, x) == 0
    torch.testing.assert_close(sigmoid(x), torch.sigmoid(x))
    torch.testing.assert_close(silu(x), F.silu(x))
