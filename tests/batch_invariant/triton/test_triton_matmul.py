"""Triton matmul / linear / bmm: float64 numerics, bitwise row invariance, backward, errors.

Small shapes run everywhere (the interpreter on CPU; BLOCK_M is 16 there, so the sizes
cross one, two and three row tiles); the `gpu` tests use the issue's batch sizes on the
fixed H200 configuration.
"""
import pytest
import torch

import zmrl.batch_invariant.triton as tri

from tests.batch_invariant.triton._util import randn, rel_err, variant_rows

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative Frobenius error vs float64
SMALL_M = (1, 2, 3, 7, 15, 16, 17, 31, 33)
GPU_M = (1, 2, 3, 7, 8, 31, 64, 255, 256, 257, 1024, 4096)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 40, 33), (17, 64, 48), (5, 7, 9), (33, 100, 70)])
def test_matmul_and_linear_match_float64(dev, dtype, m, k, n):
    a = randn(m, k, dtype=dtype, device=dev, seed=1)
    b = randn(k, n, dtype=dtype, device=dev, seed=2)
    assert rel_err(tri.matmul(a, b), a.double() @ b.double()) < TOL[dtype]
    w = randn(n, k, dtype=dtype, device=dev, seed=3)
    bias = randn(n, dtype=dtype, device=dev, seed=4)
    ref = (a.double() @ w.double().t()).to(dtype).double() + bias.double()
    assert rel_err(tri.linear(a, w, bias), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [20, 64, 7])  # 20 and 7: K not a BLOCK_K multiple (padded N-major path)
def test_bmm_matches_float64(dev, dtype, k):
    a = randn(3, 5, k, dtype=dtype, device=dev, seed=5)
    b = randn(3, k, 16, dtype=dtype, device=dev, seed=6)
    assert rel_err(tri.bmm(a, b), a.double() @ b.double()) < TOL[dtype]
    bt = randn(3, 16, k, dtype=dtype, device=dev, seed=7).transpose(1, 2)  # K-major operand
    assert rel_err(tri.bmm(a, bt), a.double() @ bt.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_are_batch_invariant(dev, dtype):
    pool = randn(24, 96, dtype=dtype, device=dev, seed=8)
    w = randn(40, 96, dtype=dtype, device=dev, seed=9, scale=0.1)
    bad = variant_rows(lambda x: tri.linear(x, w), pool, SMALL_M)
    assert not bad, "\n".join(bad[:5])


def test_matmul_layouts_agree(dev):
    # matmul(x, W.t()) (K-major weight) and matmul(x, W.t().contiguous()) (N-major) are one op
    x = randn(9, 64, dtype=torch.bfloat16, device=dev, seed=10)
    w = randn(48, 64, dtype=torch.bfloat16, device=dev, seed=11)
    assert torch.equal(tri.matmul(x, w.t()), tri.linear(x, w))
    assert rel_err(tri.matmul(x, w.t().contiguous()), x.double() @ w.double().t()) < 1e-2


def test_negative_control_torch_cpu_mm_is_batch_variant():
    # The interpreter has no cuBLAS to compare against; MKL's fp32 GEMM on this CPU is the
    # control that shows the harness can see variance at all.
    pool = randn(24, 96, seed=8)
    w = randn(40, 96, seed=9, scale=0.1)
    assert variant_rows(lambda x: torch.mm(x, w.t()), pool, (2, 3, 16, 64, 256)), "torch.mm was invariant here"


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_float64_and_is_deterministic(dev, dtype):
    x = randn(9, 24, dtype=dtype, device=dev, seed=12).requires_grad_()
    w = randn(20, 24, dtype=dtype, device=dev, seed=13).requires_grad_()
    bias = randn(20, dtype=dtype, device=dev, seed=14).requires_grad_()
    g = randn(9, 20, dtype=dtype, device=dev, seed=15)
    grads = []
    for _ in range(2):
        x.grad = w.grad = bias.grad = None
        tri.linear(x, w, bias).backward(g)
        grads.append((x.grad.clone(), w.grad.clone(), bias.grad.clone()))
    for first, second in zip(*grads):
        assert torch.equal(first, second)
    gd = g.double()
    assert rel_err(grads[0][0], gd @ w.double()) < TOL[dtype]
    assert rel_err(grads[0][1], gd.t() @ x.double()) < TOL[dtype]
    assert rel_err(grads[0][2], gd.sum(0)) < TOL[dtype]
    a = randn(2, 5, 24, dtype=dtype, device=dev, seed=16).requires_grad_()
    b = randn(2, 24, 8, dtype=dtype, device=dev, seed=17).requires_grad_()
    gb = randn(2, 5, 8, dtype=dtype, device=dev, seed=18)
    tri.bmm(a, b).backward(gb)
    assert rel_err(a.grad, gb.double() @ b.double().transpose(1, 2)) < TOL[dtype]
    assert rel_err(b.grad, a.double().transpose(1, 2) @ gb.double()) < TOL[dtype]


def test_bad_inputs_name_the_argument(dev):
    a = randn(3, 8, device=dev)
    with pytest.raises(TypeError, match="b"):
        tri.matmul(a, torch.ones(8, 4, dtype=torch.int32, device=dev))
    with pytest.raises(TypeError, match="share one dtype"):
        tri.matmul(a, randn(8, 4, dtype=torch.bfloat16, device=dev))
    with pytest.raises(ValueError, match="K"):
        tri.matmul(a, randn(7, 4, device=dev))
    with pytest.raises(ValueError, match="bias"):
        tri.linear(a, randn(4, 8, device=dev), randn(5, device=dev))
    with pytest.raises(ValueError, match="bmm"):
        tri.bmm(randn(2, 3, 8, device=dev), randn(3, 8, 4, device=dev))


def test_config_never_reads_m():
    import importlib
    import inspect

    mm_mod = importlib.import_module("zmrl.batch_invariant.triton.matmul")
    assert list(inspect.signature(mm_mod.config_for).parameters) == ["n", "k", "dtype"]


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 7168)])
def test_gpu_linear_is_invariant_at_issue_batch_sizes(dtype, n, k):
    torch.backends.cuda.matmul.allow_tf32 = False
    pool = randn(64, k, dtype=dtype, device="cuda", seed=20)
    w = randn(n, k, dtype=dtype, device="cuda", seed=21, scale=k ** -0.5)
    bad = variant_rows(lambda x: tri.linear(x, w), pool, GPU_M)
    assert not bad, "\n".join(bad[:5])
    ref = pool[:8].double() @ w.double().t()
    assert rel_err(tri.linear(pool[:8], w), ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_negative_control_cublas_is_batch_variant(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    pool = randn(64, 4096, dtype=dtype, device="cuda", seed=20)
    w = randn(4096, 4096, dtype=dtype, device="cuda", seed=21, scale=4096 ** -0.5)
    bad = variant_rows(lambda x: torch.nn.functional.linear(x, w), pool, GPU_M)
    assert bad, "cuBLAS gave the same bits at every M: the invariance test above would prove nothing"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_bmm_is_invariant_in_m_and_batch(dtype):
    b = randn(4, 512, 256, dtype=dtype, device="cuda", seed=22, scale=0.05)
    a = randn(4, 300, 512, dtype=dtype, device="cuda", seed=23)
    full = tri.bmm(a, b)
    for m in (1, 3, 64, 257):
        for i in range(4):
            part = tri.bmm(a[i:i + 1, :m], b[i:i + 1])
            assert torch.equal(part[0], full[i, :m]), f"bmm differs at M={m} batch entry {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 7168), (7168, 2048)])
def test_gpu_ladder_tiles_give_the_fixed_config_bits(n, k):
    """Evidence for a design question, not a property the public ops rely on: tiles of other
    M/N shapes with the same BLOCK_K (so other wgmma instruction shapes and warp counts)
    give every row the same bits as the fixed configuration."""
    import importlib

    mm = importlib.import_module("zmrl.batch_invariant.triton.matmul")
    x = randn(4096, k, dtype=torch.bfloat16, device="cuda", seed=30)
    w = randn(n, k, dtype=torch.bfloat16, device="cuda", seed=31, scale=k ** -0.5)
    fixed = mm.gemm(x[None], w.t()[None])[0]
    for m in GPU_M:
        for pad in (False, True):
            got = mm.gemm(x[None, :m], w.t()[None], None, mm.ladder_config(m, n, k, torch.bfloat16), pad)[0]
            assert torch.equal(got, fixed[:m]), f"M={m} pad={pad}"
    for cfg in mm._LADDER:
        assert torch.equal(mm.gemm(x[None, :300], w.t()[None], None, cfg)[0], fixed[:300]), str(cfg)
