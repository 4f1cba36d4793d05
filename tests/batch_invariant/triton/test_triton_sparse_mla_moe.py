"""Triton sparse MLA (prefill == decode) and grouped MoE experts (token invariance)."""
import pytest
import torch

import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant.moe import moe_experts_reference
from zmrl.batch_invariant.sparse_mla import sparse_mla_reference

from tests.batch_invariant.invariance import first_difference
from tests.batch_invariant.triton._util import randn, rel_err

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _mla_data(dtype, dev, rope=True, t=6, h=5, c=40, r=8, s=150, width=100, seed=0):
    ql = randn(t, h, c, dtype=dtype, device=dev, seed=seed)
    qr = randn(t, h, r, dtype=dtype, device=dev, seed=seed + 1) if rope else None
    kv = randn(s, c, dtype=dtype, device=dev, seed=seed + 2)
    kr = randn(s, r, dtype=dtype, device=dev, seed=seed + 3) if rope else None
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((t, width), -1, dtype=torch.int64)
    counts = [0, 1, 17, 64, 65, width] + [width] * max(0, t - 6)
    for row in range(t):
        n = min(counts[row], width)
        idx[row, :n] = torch.randperm(s, generator=g)[:n].sort().values
    return ql, qr, kv, kr, idx.to(dev)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [True, False])
def test_sparse_mla_matches_float64(dev, dtype, rope):
    ql, qr, kv, kr, idx = _mla_data(dtype, dev, rope)
    out, lse = tri.sparse_mla(ql, qr, kv, kr, idx, 0.1)
    ref_out, ref_lse = sparse_mla_reference(ql, qr, kv, kr, idx, 0.1)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == float("-inf")).all())
    assert rel_err(out[1:], ref_out[1:]) < TOL[dtype]
    assert rel_err(lse[1:], ref_lse[1:]) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [True, False])
def test_sparse_mla_decode_equals_prefill(dev, dtype, rope):
    ql, qr, kv, kr, idx = _mla_data(dtype, dev, rope, t=8)
    out, lse = tri.sparse_mla(ql, qr, kv, kr, idx, 0.1)
    for t in range(8):
        o, l1 = tri.sparse_mla(ql[t:t + 1], qr[t:t + 1] if rope else None, kv, kr, idx[t:t + 1], 0.1)
        assert torch.equal(o[0], out[t]), f"row {t}: {first_difference(o[0], out[t])}"
        assert torch.equal(l1[0], lse[t])


def test_sparse_mla_negative_control_chunk_size_changes_bits(dev):
    # prefill == decode is only meaningful if the bits depend on the reduction order at all
    ql, qr, kv, kr, idx = _mla_data(torch.float32, dev)
    assert not torch.equal(tri.sparse_mla(ql, qr, kv, kr, idx, 0.1, 64)[0],
                           tri.sparse_mla(ql, qr, kv, kr, idx, 0.1, 32)[0])


def test_sparse_mla_backward_matches_float64_and_is_deterministic(dev):
    ql, qr, kv, kr, idx = _mla_data(torch.float32, dev)
    leaves = [x.clone().requires_grad_() for x in (ql, qr, kv, kr)]
    grads = []
    for _ in range(2):
        for x in leaves:
            x.grad = None
        out, lse = tri.sparse_mla(*leaves, idx, 0.1)
        (out.sum() + 0.3 * torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
        grads.append([x.grad.clone() for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    ref_leaves = [x.detach().double().requires_grad_() for x in (ql, qr, kv, kr)]
    out, lse = sparse_mla_reference(*ref_leaves, idx, 0.1)
    (out.sum() + 0.3 * torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for got, ref in zip(grads[0], ref_leaves):
        assert rel_err(got, ref.grad) < 1e-5


def _moe_data(dtype, dev, n=9, d=24, i=40, e=5, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = randn(n, d, dtype=dtype, device=dev, seed=seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k].sort().values for _ in range(n)]).to(dev)
    w = torch.rand(n, k, generator=g).to(dev)
    wg, wu = (randn(e, i, d, dtype=dtype, device=dev, seed=seed + s, scale=0.2) for s in (1, 2))
    wd = randn(e, d, i, dtype=dtype, device=dev, seed=seed + 3, scale=0.2)
    shared = tuple(randn(*shape, dtype=dtype, device=dev, seed=seed + 4 + j, scale=0.2)
                   for j, shape in enumerate(((16, d), (16, d), (d, 16))))
    return x, ids, w, wg, wu, wd, shared


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_shared", [False, True])
def test_moe_matches_reference_and_is_token_invariant(dev, dtype, with_shared):
    x, ids, w, wg, wu, wd, shared = _moe_data(dtype, dev)
    shared = shared if with_shared else None
    out = tri.moe_experts(x, ids, w, wg, wu, wd, shared)
    cpu = [t.cpu() for t in (x, ids, w, wg, wu, wd)]
    ref = moe_experts_reference(*cpu, tuple(t.cpu() for t in shared) if shared else None)
    assert rel_err(out, ref) < TOL[dtype]
    for n in range(x.shape[0]):
        alone = tri.moe_experts(x[n:n + 1], ids[n:n + 1], w[n:n + 1], wg, wu, wd, shared)[0]
        assert torch.equal(alone, out[n]), f"token {n}: {first_difference(alone, out[n])}"


def test_moe_negative_control_per_expert_torch_mm_is_variant():
    # the per-expert loop over torch.mm sees a different M per expert and call: on this
    # CPU's fp32 MKL that changes bits, which the grouped kernel must not
    x, ids, w, wg, wu, wd, _ = _moe_data(torch.float32, "cpu", n=64, d=96, i=64, e=2, k=1)

    def loop(xb, idsb):
        out = torch.zeros_like(xb)
        for e in range(wg.shape[0]):
            rows = (idsb[:, 0] == e).nonzero()[:, 0]
            h = torch.nn.functional.silu(xb[rows] @ wg[e].t()) * (xb[rows] @ wu[e].t())
            out[rows] = h @ wd[e].t()
        return out

    full = loop(x, ids)
    assert any(not torch.equal(loop(x[n:n + 1], ids[n:n + 1])[0], full[n]) for n in range(64))


def test_moe_backward_matches_float64(dev):
    x, ids, w, wg, wu, wd, shared = _moe_data(torch.float32, dev)
    leaves = [t.clone().requires_grad_() for t in (x, w, wg, wu, wd, *shared)]
    tri.moe_experts(leaves[0], ids, leaves[1], *leaves[2:5], tuple(leaves[5:])).pow(2).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (x, w, wg, wu, wd, *shared)]
    xd, wtd, gd, ud, dd, sg, su, sd = ref

    def mlp(v, a, b, c):
        h = v @ a.t()
        return (h * torch.sigmoid(h) * (v @ b.t())) @ c.t()

    rows = []
    for n in range(x.shape[0]):
        acc = sum(wtd[n, j] * mlp(xd[n:n + 1], gd[ids[n, j]], ud[ids[n, j]], dd[ids[n, j]])[0]
                  for j in range(ids.shape[1]))
        rows.append(acc + mlp(xd[n:n + 1], sg, su, sd)[0])
    torch.stack(rows).pow(2).sum().backward()
    for got, want in zip(leaves, ref):
        assert rel_err(got.grad, want.grad) < 1e-5


def test_moe_frozen_experts_get_no_gradient_and_the_same_input_gradient(dev):
    x, ids, w, wg, wu, wd, shared = _moe_data(torch.float32, dev)

    def input_grad(train_weights: bool):
        xl = x.clone().requires_grad_()
        ws = [t.clone().requires_grad_(train_weights) for t in (wg, wu, wd, *shared)]
        tri.moe_experts(xl, ids, w, *ws[:3], tuple(ws[3:])).pow(2).sum().backward()
        return xl.grad, [t.grad for t in ws]

    dx_trained, grads = input_grad(True)
    dx_frozen, none = input_grad(False)
    assert all(g is not None for g in grads) and all(g is None for g in none)
    assert torch.equal(dx_frozen, dx_trained)


def test_bad_inputs_name_the_argument(dev):
    ql, qr, kv, kr, idx = _mla_data(torch.float32, dev)
    with pytest.raises(ValueError, match="q_rope and k_rope"):
        tri.sparse_mla(ql, qr, kv, None, idx, 0.1)
    with pytest.raises(ValueError, match="indices"):
        tri.sparse_mla(ql, qr, kv, kr, idx[:2], 0.1)
    with pytest.raises(ValueError, match="chunk_size"):
        tri.sparse_mla(ql, qr, kv, kr, idx, 0.1, 24)
    x, ids, w, wg, wu, wd, _ = _moe_data(torch.float32, dev)
    with pytest.raises(ValueError, match="expert_ids"):
        tri.moe_experts(x, ids + 10, w, wg, wu, wd)
    with pytest.raises(TypeError, match="w_up"):
        tri.moe_experts(x, ids, w, wg, wu.bfloat16(), wd)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [True, False])
def test_gpu_sparse_mla_decode_equals_prefill_at_model_shape(dtype, rope):
    s, width, t = 4096, 2048, 64
    ql, qr, kv, kr, _ = _mla_data(dtype, "cuda", rope, t=t, h=16, c=512, r=64, s=s, width=8)
    g = torch.Generator().manual_seed(5)
    idx = torch.full((t, width), -1, dtype=torch.int64)
    for row in range(t):
        n = [0, 1, 63, 64, 65, 2047][row] if row < 6 else width
        idx[row, :n] = torch.randperm(s, generator=g)[:n].sort().values
    idx = idx.cuda()
    out, lse = tri.sparse_mla(ql, qr, kv, kr, idx, 0.07)
    for row in (0, 1, 2, 3, 4, 5, 17, 63):
        o, l1 = tri.sparse_mla(ql[row:row + 1], qr[row:row + 1] if rope else None, kv, kr, idx[row:row + 1], 0.07)
        assert torch.equal(o[0], out[row]) and torch.equal(l1[0], lse[row]), f"row {row}"
    ref_out, _ = sparse_mla_reference(ql[1:9], qr[1:9] if rope else None, kv, kr, idx[1:9], 0.07)
    assert rel_err(out[1:9], ref_out) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_moe_is_token_invariant_at_model_shape(dtype):
    x, ids, w, wg, wu, wd, _ = _moe_data(dtype, "cuda", n=300, d=1024, i=512, e=16, k=4)
    out = tri.moe_experts(x, ids, w, wg, wu, wd)
    for n in (0, 1, 150, 299):
        for m in (1, 2, 31, 64):
            rows = torch.arange(n, n + m, device="cuda") % 300
            part = tri.moe_experts(x[rows], ids[rows], w[rows], wg, wu, wd)
            assert torch.equal(part[0], out[n]), f"token {n} with {m - 1} companions"
