"""The CPU tiles hand the BLAS one operand layout (zmrl/batch_invariant/_tiles.py).

A BLAS may pick its kernel by how the operands sit in memory. Under oneDNN's AVX2 bf16 GEMM (what a
CPU without AVX-512 runs, and what `ONEDNN_MAX_CPU_ISA=AVX2` selects on any x86 CPU), a k-major B gives
some rows other bits than the same B dense. So every BLAS call of the tiles gets dense operands, at
every tile count and batch size, and the self-check's probe calls get the same. Checked here by
recording the calls, and end to end on oneDNN's AVX2 kernels in a subprocess (negative control: the
two layouts of one B differ there).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zmrl.batch_invariant import cpu_gemm
from zmrl.batch_invariant._tiles import bmm_tiles, mm_large_tiles, mm_tiles


@pytest.fixture
def blas_calls(monkeypatch):
    """Every torch.mm / torch.bmm call's operands: (op, a dense?, b dense?)."""
    calls = []
    for op in ("mm", "bmm"):
        real = getattr(torch, op)

        def record(a, b, *args, _op=op, _real=real, **kwargs):
            calls.append((_op, a.is_contiguous(), b.is_contiguous()))
            return _real(a, b, *args, **kwargs)
        monkeypatch.setattr(torch, op, record)
    return calls


def _k_major_heads(heads, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, n, k, generator=g).to(dtype).transpose(1, 2)  # [H, K, N], k-major


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_tiles_give_the_blas_dense_operands_at_every_tile_count(blas_calls, dtype):
    b = _k_major_heads(4, 64, 32, dtype)
    a_strided = torch.randn(70, 4, 64).to(dtype).transpose(0, 1)  # [H, T, K] read from [T, H, K]
    for a in (a_strided[:, :5], a_strided[:, :32], a_strided[:, :40], a_strided, a_strided[:1, :64]):
        bmm_tiles(a, b[: a.shape[0]])
    bmm_tiles(a_strided[:, :40], b[0].expand(4, 64, 32))  # a stride-0 batch, as the probes pass
    assert blas_calls and all(op == "bmm" for op, _, _ in blas_calls)
    assert [c for c in blas_calls if not (c[1] and c[2])] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_tiles_give_the_blas_dense_rows(blas_calls, dtype):
    w = torch.randn(48, 64).to(dtype)
    x = torch.randn(64, 300).to(dtype)[:, :64]  # rows with a stride of 300
    mm_tiles(x, w.t())
    mm_tiles(x[:64], w.t())
    mm_large_tiles(torch.randn(300, 128).to(dtype)[:, :64], w.t(), (256, 64))
    assert blas_calls and [c for c in blas_calls if not c[1]] == []


def test_the_bmm_self_check_calls_the_blas_as_a_call_does(blas_calls):
    b = _k_major_heads(4, 64, 32, torch.bfloat16)
    ok, _, _ = cpu_gemm.check_bmm_rows(bmm_tiles, b[0], torch.bfloat16, 1)
    assert ok and blas_calls
    assert [c for c in blas_calls if not (c[1] and c[2])] == []


AVX2_SCRIPT = textwrap.dedent("""
    import torch
    from zmrl.batch_invariant import cpu_gemm
    from zmrl.batch_invariant._tiles import bmm_tiles
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    b = torch.randn(4, 32, 64, generator=g).to(torch.bfloat16).transpose(1, 2)  # [4, 64, 32] k-major
    a = torch.stack([cpu_gemm.probe_rows_against(b[h], 64, torch.bfloat16) for h in range(4)])
    two_tiles = bmm_tiles(a, b)
    one_tile = bmm_tiles(a[:, :32], b)
    print("tiles", int((one_tile != two_tiles[:, :32]).any(-1).sum()))
    as_given, dense = torch.bmm(a[:, :32], b), torch.bmm(a[:, :32], b.contiguous())
    print("layouts", int((as_given != dense).any(-1).sum()))
""")


def test_bmm_rows_keep_their_bits_on_onednn_avx2_where_the_b_layout_changes_them():
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    proc = subprocess.run([sys.executable, "-c", AVX2_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = dict(line.split() for line in proc.stdout.splitlines())
    assert int(counts["layouts"]) > 0, "control: a k-major and a dense B gave equal rows on oneDNN's AVX2 GEMM"
    assert int(counts["tiles"]) == 0, f"{counts['tiles']} rows differ between a call of one tile and of two"
