"""Triton RoPE: one launch forward and one backward, bit for bit the torch expression and the
gradient torch autograd computes for it (signed zeros included), on every layout the model
passes; and negative controls showing the comparison sees a one-rounding difference."""
import importlib

import pytest
import torch

import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant import rope, use_path

from tests.batch_invariant.rope_oracle import old_expression as expression
from tests.batch_invariant.rope_oracle import tables, value_and_grad
from tests.bitwise import assert_bitwise
from tests.bitwise import bit_pattern as bits
from tests.batch_invariant.triton._util import randn

# the module, not the function of the same name that the package exports
tri_rope = importlib.import_module("zmrl.batch_invariant.triton.rope")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ANGLES = dict(seed=7, span=1000.0)  # wide angles: many cos/sin values, the negative controls' data


def with_zeros(t: torch.Tensor) -> torch.Tensor:
    """Signed zeros in a few rows: autograd turns a -0.0 gradient into +0.0, and so must the kernel."""
    t = t.clone()
    t[0] = -0.0
    t[1, ..., ::2] = 0.0
    return t


def layout(case: str, t: int, h: int, r: int, dtype, device, seed: int = 0) -> torch.Tensor:
    """x as the model passes it: [T, H, R], [T, R], or a slice of a wider projection's last dim."""
    if case == "THR":
        return with_zeros(randn(t, h, r, dtype=dtype, device=device, seed=seed, scale=3.0))
    if case == "TR":
        return with_zeros(randn(t, r, dtype=dtype, device=device, seed=seed, scale=3.0))
    wide = with_zeros(randn(t, h, 24 + r, dtype=dtype, device=device, seed=seed, scale=3.0))
    return wide[..., 24:]


def assert_same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert_bitwise(bits(got), bits(want), what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["THR", "TR", "slice"])
@pytest.mark.parametrize("r", [32, 12])  # 12: half = 6 is not a power of two (a masked tile)
def test_forward_and_backward_are_the_expressions_bits(dev, case, dtype, r):
    t, h = 70, 4  # 280 rows of [T, H, R]: three programs at R = 32, the last one partial
    x = layout(case, t, h, r, dtype, dev)
    grad = with_zeros(randn(*x.shape, dtype=dtype, device=dev, seed=1, scale=2.0))
    cos, sin = tables(t, r // 2, dev, **ANGLES)
    want_out, want_grad = value_and_grad(expression, x, cos, sin, grad)
    got_out, got_grad = value_and_grad(tri.rope, x, cos, sin, grad)
    assert_same_bits(got_out, want_out, f"forward {case} {dtype}")
    assert_same_bits(got_grad, want_grad, f"backward {case} {dtype}")
    assert got_out.is_contiguous()
    with torch.no_grad():  # without a graph the kernel runs directly: the same bits
        assert_same_bits(tri.rope(x, cos, sin), want_out, f"no-grad forward {case} {dtype}")


def test_public_op_on_the_triton_path_is_one_launch_each_way(dev, monkeypatch):
    launches = []
    kernel = tri_rope._rope_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(tri_rope, "_rope_kernel", Counting())
    x = layout("THR", 9, 3, 16, torch.bfloat16, dev)
    grad = randn(*x.shape, dtype=torch.bfloat16, device=dev, seed=3)
    cos, sin = tables(9, 8, dev, **ANGLES)
    want = value_and_grad(expression, x, cos, sin, grad)
    leaf = x.detach().requires_grad_()
    with use_path("triton"):
        out = rope(leaf, cos, sin)
    assert len(launches) == 1
    out.backward(grad)
    assert len(launches) == 2
    assert_same_bits(out.detach(), want[0], "public forward")
    assert_same_bits(leaf.grad, want[1], "public backward")


def test_empty_x(dev):
    cos, sin = tables(0, 4, dev, **ANGLES)
    x = torch.empty(0, 3, 8, device=dev)
    assert tri.rope(x, cos, sin).shape == (0, 3, 8)


def test_negative_control_one_rounding_less_is_seen(dev):
    # An FMA-style forward (x0 * c exact, one rounding for the difference) is what a fused
    # launch computes; on this data it differs from the separately rounded expression, and the
    # comparison above must see it. (The interpreter ignores the fusion option, so the fused
    # arithmetic is formed here in float64, where an fp32 product is exact.)
    x = randn(64, 4, 32, device=dev, seed=5, scale=3.0)
    cos, sin = tables(64, 16, dev, **ANGLES)
    c, s = cos[:, None, :].double(), sin[:, None, :].double()
    x0, x1 = x[..., :16], x[..., 16:]
    fused = torch.cat([(x0.double() * c - (x1 * sin[:, None, :]).double()).float(),
                       (x1.double() * c + (x0 * cos[:, None, :]).double()).float()], -1)
    got = tri.rope(x, cos, sin)
    assert_same_bits(got, expression(x, cos, sin), "kernel vs expression")
    assert not torch.equal(bits(fused), bits(got)), "the fused arithmetic gave the same bits: no control"


def test_negative_control_signed_zero_is_seen(dev):
    # Without autograd's final + 0 the backward would keep -0.0 where autograd gives +0.0:
    # torch.equal cannot tell, the bit comparison the tests use can.
    x = randn(6, 2, 8, device=dev, seed=6)
    grad = torch.full_like(x, -0.0)
    cos, sin = tables(6, 4, dev, **ANGLES)
    _, autograd = value_and_grad(expression, x, cos, sin, grad)
    c, s = cos[:, None, :], sin[:, None, :]
    g0, g1 = grad[..., :4], grad[..., 4:]
    no_plus_zero = torch.cat([g0 * c + g1 * s, g1 * c - g0 * s], -1)
    assert torch.equal(no_plus_zero, autograd) and not torch.equal(bits(no_plus_zero), bits(autograd))
    _, got = value_and_grad(tri.rope, x, cos, sin, grad)
    assert_same_bits(got, autograd, "kernel backward on -0.0 gradients")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_realistic_shapes_on_cuda(dtype):
    t, h, nope, r, c = 14_000, 16, 64, 32, 128
    q = randn(t, h, nope + r, dtype=dtype, device="cuda", seed=8, scale=3.0)
    kv = randn(t, c + r, dtype=dtype, device="cuda", seed=9, scale=3.0)
    cos, sin = tables(t, r // 2, "cuda", **ANGLES)
    for name, x in (("q_rope", q[..., nope:]), ("rope_key", kv[:, c:])):
        grad = with_zeros(randn(*x.shape, dtype=dtype, device="cuda", seed=10))
        want_out, want_grad = value_and_grad(expression, x, cos, sin, grad)
        with use_path("triton"):
            got_out, got_grad = value_and_grad(rope, x, cos, sin, grad)
        assert_same_bits(got_out, want_out, f"{name} forward {dtype}")
        assert_same_bits(got_grad, want_grad, f"{name} backward {dtype}")
    if dtype == torch.float32:  # the same kernel launched with fp fusion contracts to FMAs: other bits
        x = q[..., nope:]
        fused = tri_rope._launch(x, cos, sin, dtype, backward=False, options={"enable_fp_fusion": True})
        assert not torch.equal(bits(fused), bits(expression(x, cos, sin))), "fusion changed no bit: no control"
