import subprocess
import sys

import torch
import torch.nn.functional as F

import zmrl.batch_invariant as bi
from tests.batch_invariant.invariance import count_variant_rows


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(200, 256, generator=g), torch.randn(96, 256, generator=g)


def test_enable_makes_third_party_torch_calls_invariant():
    x, w = _data()
    calls = {
        "mm": lambda t: torch.mm(t, w.t()),
        "F.linear": lambda t: F.linear(t, w),
        "F.linear+bias": lambda t: F.linear(t, w, torch.ones(96)),
        "matmul": lambda t: t @ w.t(),
        "bmm": lambda t: torch.bmm(t[None], w.t()[None])[0],
        "log_softmax": lambda t: torch.log_softmax(t @ w.t(), -1),
    }
    assert count_variant_rows(calls["mm"], x) > 0  # negative control: mode off
    with bi.batch_invariant_mode():
        for name, fn in calls.items():
            assert count_variant_rows(fn, x) == 0, name
    assert not bi.is_enabled()
    assert count_variant_rows(calls["mm"], x) > 0  # torch's kernel is back


def test_enable_is_idempotent_and_disable_restores():
    x, w = _data()
    before = torch.mm(x[:3], w.t())
    bi.enable()
    bi.enable()
    try:
        assert bi.is_enabled()
        assert torch.equal(torch.mm(x[:3], w.t()), bi.matmul(x[:3], w.t()))
    finally:
        bi.disable()
        bi.disable()
    assert not bi.is_enabled()
    assert torch.equal(torch.mm(x[:3], w.t()), before)


def test_autograd_still_flows_under_the_mode():
    x, w = _data()
    w = w.clone().requires_grad_()
    with bi.batch_invariant_mode():
        loss = torch.log_softmax(F.linear(x, w), -1).mean()
        loss.backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_mean_dim_and_softmax_overrides():
    x, _ = _data()
    with bi.batch_invariant_mode():
        torch.testing.assert_close(x.mean(dim=1), bi.mean(x, 1))
        torch.testing.assert_close(x.mean(dim=(0, 1), keepdim=True), x.sum().div(x.numel()).view(1, 1))
        torch.testing.assert_close(torch.softmax(x, 0), bi.softmax(x, 0))
        assert torch.equal(x.double().mean(1), x.double().sum(1) / 256)  # outside the contract: float64


def test_importing_the_kernels_stays_light():
    code = (
        "import sys, zmrl.batch_invariant;"
        "heavy = [m for m in ('vllm', 'megatron', 'wandb', 'transformers', 'datasets', 'triton') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import zmrl.batch_invariant pulled in: {out.stdout}"
