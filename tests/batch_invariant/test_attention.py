"""indexer_scores and sparse_mla: numerics vs float64, prefill == decode, invariance in keys."""
import pytest
import torch

import zmrl.batch_invariant as bi
from tests.batch_invariant.invariance import assert_bitwise

DTYPES = [torch.float32, torch.bfloat16]


def _indexer_inputs(t, s, h=4, d=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    w = torch.randn(t, h, generator=g).to(dtype)
    k = torch.randn(s, d, generator=g).to(dtype)
    return q, w, k, torch.arange(s - t, s), torch.arange(s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_matches_float64_and_is_causal(dtype):
    q, w, k, qp, kp = _indexer_inputs(70, 90, dtype=dtype)
    dots = torch.einsum("thd,sd->ths", q.double(), k.double())
    ref = (torch.relu(dots) * w.double()[..., None]).sum(1)
    ref = ref.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    for path in ("cpu", "reference"):
        with bi.use_path(path):
            out = bi.indexer_scores(q, w, k, qp, kp)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)
        assert torch.isinf(out[0, 21:]).all() and torch.isfinite(out[0, :21]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_decode_equals_prefill_at_every_position(dtype):
    # Prefill: all 130 queries against all 130 keys. Decode: query t alone against keys 0..t.
    q, w, k, qp, kp = _indexer_inputs(130, 130, dtype=dtype)
    full = bi.indexer_scores(q, w, k, qp, kp)
    for t in range(130):
        one = bi.indexer_scores(q[t:t + 1], w[t:t + 1], k[: t + 1], qp[t:t + 1], kp[: t + 1])
        assert_bitwise(one, full[t:t + 1, : t + 1], f"query {t}")


def test_negative_control_indexer_by_plain_matmul_varies_with_keys():
    q, w, k, qp, kp = _indexer_inputs(130, 130)

    def plain(t):  # the obvious torch implementation, decode shape vs prefill shape
        dots = (q[t:t + 1].reshape(-1, 32) @ k[: t + 1].t()).view(1, 4, -1)
        return (torch.relu(dots) * w[t:t + 1, :, None]).sum(1)

    dots_full = (q.reshape(-1, 32) @ k.t()).view(130, 4, -1)
    full = (torch.relu(dots_full) * w[..., None]).sum(1)
    assert any(not torch.equal(plain(t), full[t:t + 1, : t + 1]) for t in range(130))


def _mla_inputs(t, s, h=8, c=48, r=16, topk=40, dtype=torch.float32, seed=0, nope=False):
    g = torch.Generator().manual_seed(seed)
    ql = torch.randn(t, h, c, generator=g).to(dtype)
    qr = None if nope else torch.randn(t, h, r, generator=g).to(dtype)
    kv = torch.randn(s, c, generator=g).to(dtype)
    kr = None if nope else torch.randn(s, r, generator=g).to(dtype)
    scores = torch.randn(t, s, generator=g)
    pos_q = torch.arange(s - t, s)
    scores = scores.masked_fill(torch.arange(s)[None, :] > pos_q[:, None], float("-inf"))
    return ql, qr, kv, kr, bi.topk(scores, topk)


@pytest.mark.parametrize("nope", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_mla_matches_float64(dtype, nope):
    ql, qr, kv, kr, idx = _mla_inputs(70, 100, dtype=dtype, nope=nope)
    with bi.use_path("reference"):
        ref_out, ref_lse = bi.sparse_mla(ql, qr, kv, kr, idx, 0.1)
    out, lse = bi.sparse_mla(ql, qr, kv, kr, idx, 0.1)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # an independent dense oracle: softmax over the listed tokens
    t = 40
    sel = idx[t][idx[t] >= 0]
    logits = ql[t].double() @ kv[sel].double().t()
    if not nope:
        logits = logits + qr[t].double() @ kr[sel].double().t()
    p = torch.softmax(logits * 0.1, -1)
    torch.testing.assert_close(out[t].double(), p @ kv[sel].double(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_mla_decode_equals_prefill(dtype):
    ql, qr, kv, kr, idx = _mla_inputs(130, 150, dtype=dtype, topk=100)
    out, lse = bi.sparse_mla(ql, qr, kv, kr, idx, 0.125)
    for t in range(130):
        o1, l1 = bi.sparse_mla(ql[t:t + 1], qr[t:t + 1], kv, kr, idx[t:t + 1], 0.125)
        assert_bitwise(o1, out[t:t + 1], f"out row {t}")
        assert_bitwise(l1, lse[t:t + 1], f"lse row {t}")
    # a decode step's cache holds only tokens up to its own position
    t = 60
    visible = 150 - 130 + t + 1
    o1, _ = bi.sparse_mla(ql[t:t + 1], qr[t:t + 1], kv[:visible], kr[:visible], idx[t:t + 1], 0.125)
    assert_bitwise(o1, out[t:t + 1], "decode with a shorter cache")


def test_negative_control_a_chunking_by_row_count_breaks_decode_equals_prefill():
    # what the test above would catch: an implementation that picks its key chunk by the number of
    # query rows (as a kernel choosing tiles by problem size would) gives a decoded row other bits
    ql, qr, kv, kr, idx = _mla_inputs(130, 150, topk=100)

    def by_rows(ql, qr, idx):
        return bi.sparse_mla(ql, qr, kv, kr, idx, 0.125, chunk_size=32 if ql.shape[0] == 1 else 64)[0]

    out = by_rows(ql, qr, idx)
    assert any(not torch.equal(by_rows(ql[t:t + 1], qr[t:t + 1], idx[t:t + 1]), out[t:t + 1]) for t in range(130))


def test_sparse_mla_list_padding_does_not_change_bits():
    ql, qr, kv, kr, idx = _mla_inputs(10, 50, topk=20)
    wider = torch.cat([idx, idx.new_full((10, 100), -1)], 1)
    assert_bitwise(bi.sparse_mla(ql, qr, kv, kr, wider, 0.1)[0], bi.sparse_mla(ql, qr, kv, kr, idx, 0.1)[0], "-1 padding")


def test_negative_control_chunk_size_changes_bits():
    # The fixed chunk *size* is part of the numerics: another size gives other bits.
    ql, qr, kv, kr, idx = _mla_inputs(20, 300, topk=256)
    a = bi.sparse_mla(ql, qr, kv, kr, idx, 0.1, chunk_size=64)[0]
    b = bi.sparse_mla(ql, qr, kv, kr, idx, 0.1, chunk_size=32)[0]
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b)


def test_empty_rows_give_zero_and_minus_inf():
    ql, qr, kv, kr, idx = _mla_inputs(3, 10, topk=4)
    idx[1] = -1
    out, lse = bi.sparse_mla(ql, qr, kv, kr, idx, 0.1)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and lse[1].eq(float("-inf")).all()
    assert torch.isfinite(out).all()


def test_sparse_mla_backward_matches_float64():
    ql, qr, kv, kr, idx = _mla_inputs(12, 30, h=2, c=16, r=8, topk=10)
    leaves = [x.clone().requires_grad_() for x in (ql, qr, kv, kr)]
    out, lse = bi.sparse_mla(*leaves[:2], *leaves[2:], idx, 0.3)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    dleaves = [x.double().requires_grad_() for x in (ql, qr, kv, kr)]
    sel_ok = idx >= 0
    logits = torch.einsum("thc,tkc->thk", dleaves[0], dleaves[2][idx.clamp(min=0)])
    logits = logits + torch.einsum("thr,tkr->thk", dleaves[1], dleaves[3][idx.clamp(min=0)])
    p = torch.softmax((logits * 0.3).masked_fill(~sel_ok[:, None], float("-inf")), -1)
    (torch.einsum("thk,tkc->thc", p, dleaves[2][idx.clamp(min=0)]) * g.double()).sum().backward()
    for ours, ref in zip(leaves, dleaves):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-4, atol=1e-4)


def test_bad_input_is_named():
    ql, qr, kv, kr, idx = _mla_inputs(3, 10, topk=4)
    with pytest.raises(ValueError, match="softmax_scale"):
        bi.sparse_mla(ql, qr, kv, kr, idx, 0.0)
    with pytest.raises(ValueError, match="both be given"):
        bi.sparse_mla(ql, qr, kv, None, idx, 0.1)
    with pytest.raises(ValueError, match="cache holds 10"):
        bi.sparse_mla(ql, qr, kv, kr, idx + 10, 0.1)
    with pytest.raises(TypeError, match="indices"):
        bi.sparse_mla(ql, qr, kv, kr, idx.float(), 0.1)
    q, w, k, qp, kp = _indexer_inputs(4, 6)
    with pytest.raises(ValueError, match="k_pos"):
        bi.indexer_scores(q, w, k, qp, kp[:3])


def test_indexer_backward_matches_float64():
    q, w, k, qp, kp = _indexer_inputs(9, 12)
    leaves = [x.clone().requires_grad_() for x in (q, w, k)]
    out = bi.indexer_scores(*leaves, qp, kp)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.masked_fill(torch.isinf(out), 0.0).mul(g).sum().backward()
    dl = [x.double().requires_grad_() for x in (q, w, k)]
    ref = (torch.relu(torch.einsum("thd,sd->ths", dl[0], dl[2])) * dl[1][..., None]).sum(1)
    ref.masked_fill(kp[None, :] > qp[:, None], 0.0).mul(g.double()).sum().backward()
    for ours, want in zip(leaves, dl):
        torch.testing.assert_close(ours.grad.double(), want.grad, rtol=1e-4, atol=1e-4)


def test_sparse_mla_backward_is_deterministic():
    ql, qr, kv, kr, idx = _mla_inputs(12, 30, h=2, c=16, r=8, topk=10)
    grads = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_() for x in (ql, qr, kv, kr)]
        out, _ = bi.sparse_mla(*leaves[:2], *leaves[2:], idx, 0.3)
        out.square().sum().backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert_bitwise(a, b, "sparse_mla grad")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_mla_leaves_gives_each_leaf_the_bits_of_its_own_call(dtype):
    ql, qr, kv, kr, idx = _mla_inputs(30, 300, h=16, c=256, r=32, topk=256, dtype=dtype)
    out, lse = bi.sparse_mla_leaves(ql, qr, [kv] * 8, [kr] * 8, idx, 0.1)
    for g in range(8):
        heads = slice(2 * g, 2 * g + 2)
        o, l1 = bi.sparse_mla(ql[:, heads].contiguous(), qr[:, heads].contiguous(), kv, kr, idx, 0.1)
        assert_bitwise(out[:, heads], o, f"leaf {g} out")
        assert_bitwise(lse[:, heads], l1, f"leaf {g} lse")
    # negative control, and why the CPU path keeps one call per leaf: there the per-query bmm's head
    # count is its M, and one call over all 16 heads gives other bits
    assert not torch.equal(bi.sparse_mla(ql, qr, kv, kr, idx, 0.1)[0], out)


def _per_leaf_recorded_calls(q_latent, q_rope, kv_aliases, kr_aliases, idx, scale, chunk):
    """One recorded `sparse_mla` per head leaf (the CPU's `_SparseMla`), outputs concatenated."""
    count = len(kv_aliases)
    q_lats = q_latent.chunk(count, 1)
    q_ropes = [None] * count if q_rope is None else q_rope.chunk(count, 1)
    kr_aliases = kr_aliases or [None] * count
    parts = [bi.sparse_mla(q.contiguous(), None if qr is None else qr.contiguous(), kv, kr, idx, scale, chunk)
             for q, qr, kv, kr in zip(q_lats, q_ropes, kv_aliases, kr_aliases)]
    return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 1)


@pytest.mark.parametrize("chunk", [64, 5])  # 5: leaf slices off the 64-byte grid, so one pass per leaf
@pytest.mark.parametrize("nope", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_mla_leaves_passes_equal_one_recorded_call_per_leaf(dtype, nope, chunk):
    # the CPU path runs every leaf in one pass over the chunks (rows gathered once per chunk, the
    # elementwise steps stacked over the leaves), without autograd and with it (then each leaf's
    # float64 backward reads rows gathered once for all leaves): outputs and every gradient must
    # have the bits of one recorded call per leaf
    ql, qr, kv, kr, idx = _mla_inputs(20, 150, h=8, c=64, r=16, topk=100, dtype=dtype, nope=nope)
    g = torch.Generator().manual_seed(9)

    def run(fn):
        q = ql.clone().requires_grad_()
        q_rope = None if nope else qr.clone().requires_grad_()
        base_kv = kv.clone().requires_grad_()
        base_kr = None if nope else kr.clone().requires_grad_()
        kv_aliases = [base_kv.view_as(base_kv) for _ in range(4)]  # each alias gets its own leaf's gradient
        kr_aliases = None if nope else [base_kr.view_as(base_kr) for _ in range(4)]
        out, lse = fn(q, q_rope, kv_aliases, kr_aliases, idx, 0.1, chunk)
        wrt = [q, *([] if nope else [q_rope]), *kv_aliases, *(kr_aliases or [])]
        grad_out = torch.randn(out.shape, generator=g.manual_seed(9)).to(out.dtype)
        grad_lse = torch.randn(lse.shape, generator=g.manual_seed(10))
        finite_lse = torch.where(torch.isfinite(lse), lse, 0.0)
        return out.detach(), lse.detach(), torch.autograd.grad([out, finite_lse], wrt, [grad_out, grad_lse])

    out, lse, grads = run(bi.sparse_mla_leaves)
    want, want_lse, want_grads = run(_per_leaf_recorded_calls)
    assert_bitwise(out, want, "out")
    assert_bitwise(lse, want_lse, "lse")
    names = ["q_latent", *([] if nope else ["q_rope"]), *[f"kv leaf {i}" for i in range(4)],
             *([] if nope else [f"k_rope leaf {i}" for i in range(4)])]
    for got, exp, name in zip(grads, want_grads, names, strict=True):
        assert_bitwise(got, exp, f"grad {name}")
    kv_grads = grads[1 if nope else 2:][:4]
    assert not torch.equal(kv_grads[0], kv_grads[1])  # each alias holds its own leaf's gradient, not the sum
    with torch.no_grad():
        inference = bi.sparse_mla_leaves(ql, qr, [kv] * 4, None if nope else [kr] * 4, idx, 0.1, chunk)
    assert_bitwise(inference[0], want, "out, no autograd")
    assert_bitwise(inference[1], want_lse, "lse, no autograd")
    # negative control: another chunk size is another order, and the comparison sees it (in the
    # fp32 lse: a bf16 output may round the change away)
    other = bi.sparse_mla_leaves(ql, qr, [kv] * 4, None if nope else [kr] * 4, idx, 0.1, chunk_size=32)
    assert not torch.equal(other[1], lse)


def test_sparse_mla_leaves_bad_leaves_are_named():
    ql, qr, kv, kr, idx = _mla_inputs(3, 10, h=6, topk=4)
    with pytest.raises(ValueError, match="6 heads cannot be cut into 4 equal leaves"):
        bi.sparse_mla_leaves(ql, qr, [kv] * 4, [kr] * 4, idx, 0.1)
    with pytest.raises(ValueError, match="one alias per head leaf"):
        bi.sparse_mla_leaves(ql, qr, [kv] * 2, [kr] * 3, idx, 0.1)
    with pytest.raises(ValueError, match="aliases of one tensor"):
        bi.sparse_mla_leaves(ql[:, :4], qr[:, :4], [kv, kv.clone()], [kr, kr], idx, 0.1)
