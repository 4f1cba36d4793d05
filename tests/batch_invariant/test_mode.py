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
    assert not torch.equal(before, bi.matmul(x[:3], w.t()))  # control: an override left on would show
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
    # control: torch's own kernels give other bits here, so the equalities below need the overrides
    assert not torch.equal(x.mean(dim=1), bi.mean(x, 1))
    assert not torch.equal(torch.softmax(x, 0), bi.softmax(x, 0))
    with bi.batch_invariant_mode():
        assert torch.equal(x.mean(dim=1), bi.mean(x, 1))
        assert torch.equal(torch.softmax(x, 0), bi.softmax(x, 0))
        # a mean over every dim: one value, not a row op; its value is what is checked
        torch.testing.assert_close(x.mean(dim=(0, 1), keepdim=True), x.sum().div(x.numel()).view(1, 1))
        assert torch.equal(x.double().mean(1), x.double().sum(1) / 256)  # outside the contract: float64


def test_importing_the_kernels_stays_light():
    code = (
        "import sys, zmrl.batch_invariant;"
        "heavy = [m for m in ('vllm', 'megatron', 'wandb', 'transformers', 'datasets', 'triton') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import zmrl.batch_invariant pulled in: {out.stdout}"


def test_zmrl_ops_give_the_same_bits_with_the_mode_on_or_off():
    # the kernels call only the out= overloads and non-overridden ops internally, so a
    # trainer with enable() and an engine without it (or the reverse) still agree
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(70, 64, generator=g), torch.randn(48, 64, generator=g)
    ql, kv = torch.randn(5, 4, 16, generator=g), torch.randn(30, 16, generator=g)
    idx = bi.topk(torch.randn(5, 30, generator=g), 8)

    def run():
        return [bi.linear(x, w), bi.log_softmax(x), bi.rms_norm(x, torch.ones(64), 1e-6), bi.mean(x, 0),
                bi.bmm(x.view(2, 35, 64), w.t().expand(2, 64, 48).contiguous()),
                bi.sparse_mla(ql, None, kv, None, idx, 0.2)[0]]

    off = run()
    with bi.batch_invariant_mode():
        on = run()
    for a, b in zip(off, on):
        assert torch.equal(a, b)


def test_torch_path_is_the_variant_control():
    x, w = _data()
    with bi.use_path("torch"):
        assert count_variant_rows(lambda t: bi.linear(t, w), x) > 0
        torch.testing.assert_close(bi.log_softmax(x), torch.log_softmax(x, -1))
        ids = bi.topk(torch.zeros(1, 100), 10)
    assert sorted(ids[0].tolist()) != list(range(10))  # torch.topk's tie choice, not the rule
    assert ids[0].tolist() == sorted(ids[0].tolist())


def test_dtypes_outside_the_contract_keep_torchs_kernels():
    # a float64 reference backward (or fp16 code) must still run with the mode on
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(7, 3, generator=g, dtype=torch.float64)
    want = [a @ b, torch.addmm(torch.ones(3, dtype=torch.float64), a, b), torch.bmm(a[None], b[None]),
            torch.softmax(a, -1), torch.log_softmax(a, 0), a.mean(1), a.mean(), a.half().mean(0)]
    with bi.batch_invariant_mode():
        got = [a @ b, torch.addmm(torch.ones(3, dtype=torch.float64), a, b), torch.bmm(a[None], b[None]),
               torch.softmax(a, -1), torch.log_softmax(a, 0), a.mean(1), a.mean(), a.half().mean(0)]
        x = a.clone().requires_grad_()
        torch.einsum("ij,jk->ik", x, b).sum().backward()
    for w, o in zip(want, got):
        assert w.dtype == o.dtype and torch.equal(w, o)
    assert x.grad is not None


def test_forced_torch_path_under_the_mode_runs_torchs_own_kernels():
    """With the aten overrides on and the "torch" path forced, the torch path's ops reach aten
    again: they must get torch's own kernels (bit for bit), not recurse into the overrides."""
    x = torch.randn(48, 40, generator=torch.Generator().manual_seed(0))
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(1))
    few, wide = _data()  # three rows of this mm: torch's small-M kernel gives other bits than zmrl's tiles
    want = (few[:3] @ wide.t(), x.mean(-1), torch.softmax(x, -1), torch.log_softmax(x, -1))
    zmrl = (bi.matmul(few[:3], wide.t()), bi.mean(x, -1), bi.softmax(x, -1), bi.log_softmax(x, -1))
    for z, e in zip(zmrl, want):  # control: an op that reached the overrides would show
        assert not torch.equal(z, e)
    with bi.batch_invariant_mode(True), bi.use_path("torch"):
        got = (few[:3] @ wide.t(), x.mean(-1), torch.softmax(x, -1), torch.log_softmax(x, -1))
    for g, e in zip(got, want):
        assert torch.equal(g, e)


def test_forced_reference_path_under_the_mode_does_not_recurse():
    """The reference ops compose aten ops too (a `@` per row): under the aten overrides with the
    "reference" path forced they must reach torch's kernels, not the override that calls them (an
    in-process vLLM engine leaves the mode on; a test forcing the reference path then recursed)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 40, generator=g), torch.randn(24, 40, generator=g)
    with bi.use_path("reference"):
        want = (bi.linear(x, w), bi.log_softmax(x), bi.softmax(x, 0))
        with bi.batch_invariant_mode(True):
            got = (bi.linear(x, w), bi.log_softmax(x), bi.softmax(x, 0))
    for a, b in zip(want, got):
        assert torch.equal(a, b)
