import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zmrl.batch_invariant as bi
from zmrl.batch_invariant import cpu_gemm as gemm_paths
from tests.batch_invariant.invariance import assert_bitwise, count_variant_rows, torch_threads

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}
SHAPES = [(64, 48), (256, 320), (1000, 96)]  # (K, N), N not a multiple of the tile included


@pytest.fixture(params=["auto", "exact"])
def cpu_gemm(request):
    """Each CPU test runs twice: as shipped (BLAS tiles where this machine's self-check passed)
    and on the exact GEMM forced everywhere (the path a machine with a row-variant BLAS takes)."""
    with bi.use_cpu_gemm(request.param):
        yield request.param


def _data(k, n, dtype, rows=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
def test_linear_matches_float64(dtype, k, n, cpu_gemm):
    x, w = _data(k, n, dtype)
    b = torch.randn(n).to(dtype)
    ref = (x.double() @ w.double().t() + b.double()).to(dtype)
    for path in ("cpu", "reference"):
        with bi.use_path(path):
            torch.testing.assert_close(bi.linear(x[:70], w, b), ref[:70], **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", SHAPES)
def test_linear_rows_are_batch_invariant(dtype, k, n, cpu_gemm):
    x, w = _data(k, n, dtype)
    with torch_threads(2):
        assert count_variant_rows(lambda t: bi.linear(t, w), x) == 0


def test_reference_path_is_batch_invariant():
    x, w = _data(96, 40, torch.float32, rows=70)
    with bi.use_path("reference"):
        assert count_variant_rows(lambda t: bi.linear(t, w), x, sizes=(1, 3, 64, 65, 70)) == 0


@pytest.mark.parametrize("k,n", SHAPES)
def test_negative_control_torch_mm_fp32_is_batch_variant(k, n):
    # On this machine MKL's fp32 GEMM picks other kernels for small M, so rows change bits.
    x, w = _data(k, n, torch.float32)
    with torch_threads(2):
        assert count_variant_rows(lambda t: torch.mm(t, w.t()), x) > 0


BF16_CONTROL = """
import sys
import torch
sys.path.insert(0, {root!r})
import zmrl.batch_invariant as bi
from tests.batch_invariant.invariance import count_variant_rows
from tests.batch_invariant.test_matmul import _data
torch.set_num_threads(2)
x, w = _data(256, 320, torch.bfloat16)
print(count_variant_rows(lambda t: torch.mm(t, w.t()), x), count_variant_rows(lambda t: bi.linear(t, w), x))
"""


def _cpu_has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _cpu_has_avx512(), reason="oneDNN's AVX-512 kernels need an AVX-512 CPU")
def test_negative_control_torch_mm_bf16_is_batch_variant_on_onednns_avx512_kernels():
    # torch's bf16 CPU GEMM is oneDNN's, and whether its rows vary with M depends on the kernels the
    # CPU gets (200 rows, 256 x 320): with AVX-512 but no BF16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE, a
    # Skylake or Cascade Lake Xeon's) 41 rows vary; with AVX512-BF16 (the EPYC VM) none at this shape
    # (10 at 64 x 48); with AVX2 none. Capping oneDNN gives a bf16 control on any AVX-512 CPU, and
    # zmrl's linear stays invariant on the very same kernels.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE")
    proc = subprocess.run([sys.executable, "-c", BF16_CONTROL.format(root=root)], capture_output=True, text=True,
                          env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch_rows, zmrl_rows = map(int, proc.stdout.split())
    assert torch_rows > 0, "control: torch's bf16 mm kept every row's bits on oneDNN's AVX512_CORE kernels"
    assert zmrl_rows == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_leading_dims_and_threads(dtype, cpu_gemm):
    x, w = _data(128, 96, dtype, rows=130)
    wt = w.t()
    with torch_threads(2):
        flat = bi.matmul(x, wt)
        assert_bitwise(bi.matmul(x.view(10, 13, 128), wt).reshape(130, 96), flat, "3-D input")
    with torch_threads(1):
        one = bi.matmul(x, wt)
        path_one = gemm_paths.path_for("mm", wt, dtype)
    with torch_threads(2):
        path_two = gemm_paths.path_for("mm", wt, dtype)
    # each thread count has its own self-check; bits across thread counts are promised where both
    # take the same path (always with the exact GEMM; with the tiles, this machine's BLAS decides)
    if path_one == path_two:
        assert_bitwise(one, flat, f"1 thread vs 2 threads ({path_one})")
    else:
        assert cpu_gemm == "auto" and "exact" in (path_one, path_two)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_is_invariant_in_rows_and_batch(dtype, cpu_gemm):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(5, 130, 64, generator=g).to(dtype)
    b = torch.randn(5, 64, 72, generator=g).to(dtype)
    full = bi.bmm(a, b)
    for batch in (1, 2, 5):
        for m in (1, 3, 64, 65, 130):
            assert_bitwise(bi.bmm(a[:batch, :m], b[:batch]), full[:batch, :m], f"bmm B={batch} M={m}")
    torch.testing.assert_close(full, (a.double() @ b.double()).to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_backward_matches_float64(dtype, cpu_gemm):
    x, w = _data(96, 40, dtype, rows=70)
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    grad = torch.randn(70, 40).to(dtype)
    bi.linear(x, w).backward(grad)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (xd @ wd.t()).backward(grad.double())
    torch.testing.assert_close(x.grad, xd.grad.to(dtype), **TOL[dtype])
    torch.testing.assert_close(w.grad, wd.grad.to(dtype), **TOL[dtype])


def test_backward_is_deterministic(cpu_gemm):
    x, w = _data(96, 40, torch.float32, rows=70)
    grads = []
    for _ in range(2):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        bi.linear(xx, ww).square().sum().backward()
        grads.append((xx.grad, ww.grad))
    assert_bitwise(grads[0][0], grads[1][0], "grad x")
    assert_bitwise(grads[0][1], grads[1][1], "grad w")


def test_bad_input_is_named():
    x, w = _data(32, 16, torch.float32, rows=4)
    with pytest.raises(ValueError, match="K"):
        bi.matmul(x, w)  # [4, 32] x [16, 32]
    with pytest.raises(TypeError, match="dtype"):
        bi.linear(x.double(), w.double())
    with pytest.raises(TypeError, match="share one dtype"):
        bi.linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="bias"):
        bi.linear(x, w, torch.zeros(3))
    with pytest.raises(ValueError, match="b must be 3-D"):
        bi.bmm(x[None], w)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        bi.matmul([[1.0]], w)
