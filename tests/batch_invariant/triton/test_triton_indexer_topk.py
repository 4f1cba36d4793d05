"""Triton indexer scores (invariant in queries and keys) and canonical top-k (exact)."""
import importlib

import pytest
import torch

import zmrl.batch_invariant as bi
import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant.indexer import indexer_scores_reference
from zmrl.batch_invariant.topk import topk_reference

from tests.batch_invariant.invariance import first_difference
from tests.batch_invariant.triton._util import randn

DTYPES = [torch.float32, torch.bfloat16]


def _indexer_data(t, s, dtype, dev, h=3, d=32, seed=0):
    q = randn(t, h, d, dtype=dtype, device=dev, seed=seed)
    k = randn(s, d, dtype=dtype, device=dev, seed=seed + 1)
    w = randn(t, h, device=dev, seed=seed + 2)
    q_pos = torch.arange(s - t, s, device=dev)  # the last t tokens of an s-token sequence
    return q, w, k, q_pos, torch.arange(s, device=dev)


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_matches_float64_and_is_causal(dev, dtype):
    q, w, k, qp, kp = _indexer_data(20, 40, dtype, dev)
    got = tri.indexer_scores(q, w, k, qp, kp)
    ref = indexer_scores_reference(q.cpu(), w.cpu(), k.cpu(), qp.cpu(), kp.cpu())
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got).cpu(), finite)
    assert ((got.cpu()[finite] - ref[finite]).abs() <= 1e-4 * (1 + ref[finite].abs())).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_is_invariant_in_queries_and_keys(dev, dtype):
    q, w, k, qp, kp = _indexer_data(20, 40, dtype, dev)
    full = tri.indexer_scores(q, w, k, qp, kp)
    for t in (0, 7, 19):
        for s in (1, 17, 33, 40):  # a decode step sees fewer keys than the trainer
            alone = tri.indexer_scores(q[t:t + 1], w[t:t + 1], k[:s], qp[t:t + 1], kp[:s])[0]
            assert torch.equal(alone, full[t, :s]), f"t={t} S={s}: {first_difference(alone, full[t, :s])}"


def test_indexer_negative_control_head_order_changes_bits(dev):
    # the invariance test compares exact bits; summing the heads in another order moves them
    q, w, k, qp, kp = _indexer_data(20, 40, torch.float32, dev, h=8)
    fwd = tri.indexer_scores(q, w, k, qp, kp)
    rev = tri.indexer_scores(q.flip(1), w.flip(1), k, qp, kp)
    assert not torch.equal(fwd, rev)


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_varlen_equals_a_launch_per_sequence(dev, dtype):
    lengths = [5, 20, 1, 17]  # one-token sequence; both sides of the 16-row interpreter tile
    t = sum(lengths)
    q, w, k = randn(t, 3, 32, dtype=dtype, device=dev), randn(t, 3, device=dev, seed=1), \
        randn(t, 32, dtype=dtype, device=dev, seed=2)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(dev)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    out = tri.indexer_scores_varlen(q, w, k, pos, pos, cu, cu, max(lengths), max(lengths))
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = tri.indexer_scores(q[rows], w[rows], k[rows], pos[rows], pos[rows])
        assert torch.equal(out[rows, :n], alone), f"sequence {b}: {first_difference(out[rows, :n], alone)}"
        assert (out[rows, n:] == float("-inf")).all()
    # the CPU path's packed call is the CPU path's per-sequence call; across paths only rounding agrees
    ref = indexer_scores_reference(q[5:25].cpu(), w[5:25].cpu(), k[5:25].cpu(), pos[5:25].cpu(), pos[5:25].cpu())
    finite = torch.isfinite(ref)
    assert ((out[5:25, :20].cpu()[finite] - ref[finite]).abs() <= 1e-4 * (1 + ref[finite].abs())).all()


def test_indexer_varlen_planned_wider_gives_the_same_bits(dev):
    # a CUDA graph plans its grid and score columns for a bucketed longest sequence
    lengths = [5, 20, 1, 17]
    t = sum(lengths)
    q, w, k = randn(t, 3, 32, device=dev), randn(t, 3, device=dev, seed=1), randn(t, 32, device=dev, seed=2)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(dev)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    exact = tri.indexer_scores_varlen(q, w, k, pos, pos, cu, cu, 20, 20)
    wide = tri.indexer_scores_varlen(q, w, k, pos, pos, cu, cu, 37, 37)
    assert torch.equal(wide[:, :20], exact), first_difference(wide[:, :20], exact)
    assert (wide[:, 20:] == float("-inf")).all()


def test_indexer_varlen_negative_control_offsets_matter(dev):
    lengths = [20, 17]
    q, w, k = randn(37, 3, 32, device=dev), randn(37, 3, device=dev, seed=1), randn(37, 32, device=dev, seed=2)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(dev)
    cu = torch.tensor([0, 20, 37])
    packed = tri.indexer_scores_varlen(q, w, k, pos, pos, cu, cu, 20, 20)
    shifted = tri.indexer_scores_varlen(q, w, k, pos, pos, cu, torch.tensor([0, 17, 37]), 20, 20)  # wrong keys
    assert not torch.equal(packed[20:], shifted[20:])


def _oracle(scores, k):
    rows = []
    for row in scores.float().cpu().tolist():
        keyed = sorted((-(v + 0.0), i) for i, v in enumerate(row) if v != float("-inf"))
        chosen = sorted(i for _, i in keyed[:k])
        rows.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(rows, dtype=torch.int64)


def _topk_cases(dev):
    g = torch.Generator().manual_seed(0)
    yield torch.randn(5, 300, generator=g), 10
    yield torch.randint(-3, 3, (4, 500), generator=g).float(), 37  # heavy ties
    z = torch.zeros(3, 100)
    z[0, ::2] = -0.0
    yield z, 5  # -0.0 == +0.0: lowest indices win
    x = torch.randn(3, 50, generator=g)
    x[0, :45] = float("-inf")
    x[1] = float("-inf")
    yield x, 10  # fewer valid than k, and none
    yield torch.randn(2, 20, generator=g), 30  # k > N
    yield torch.randn(3, 1000, generator=g).bfloat16(), 64
    yield torch.tensor([[float("inf"), 1.0, -1e38, -3e38, 5.0, float("inf"), -1e-45]]), 3
    yield torch.tensor([[-1e-45, 1e-45, -0.0, 0.0, -5e-39]]), 3  # subnormals around zero
    # rows longer than SINGLE_MAX (512 under the interpreter) take the segmented path
    yield torch.randint(-3, 3, (2, 2100), generator=g).float(), 700  # ties spread over segments
    x = torch.randn(3, 1500, generator=g)
    x[0, :1400] = float("-inf")
    x[1] = float("-inf")
    yield x, 300


def test_topk_is_exact_on_ties_zeros_infinities(dev):
    for scores, k in _topk_cases(dev):
        got = tri.topk(scores.to(dev), k).cpu()
        want = _oracle(scores, k)
        assert torch.equal(got, want), f"k={k}: {first_difference(got, want)}"
        assert torch.equal(got, topk_reference(scores, k))


def test_topk_negative_control_torch_topk_breaks_ties_otherwise(dev):
    # the tie cases above do exercise the tie rule: torch.topk's own choice differs on them
    scores = torch.randint(-3, 3, (4, 500), generator=torch.Generator().manual_seed(1)).float()
    plain = torch.topk(scores, 37, dim=-1).indices.sort(-1).values
    assert not torch.equal(plain, _oracle(scores, 37))


@pytest.mark.parametrize("block", [256, 512, 1024])
def test_topk_every_launch_shape_gives_the_same_indices(dev, block):
    # many short rows take a block sized to the row (topk_launch); selection does no arithmetic, so
    # every block and warp count must give the oracle's indices, ties and -inf rows included
    topk_module = importlib.import_module("zmrl.batch_invariant.triton.topk")  # the package re-exports topk()
    g = torch.Generator().manual_seed(block)
    scores = torch.randint(-3, 3, (6, 300), generator=g).float()
    scores[2, 100:] = float("-inf")
    scores[4] = float("-inf")
    want = _oracle(scores, 37)
    for warps in (2, 8):
        got = topk_module.topk_launch(scores.to(dev), 37, block, warps).cpu()
        assert torch.equal(got, want), f"block {block}, {warps} warps: {first_difference(got, want)}"


def test_topk_rows_are_independent(dev):
    scores = torch.randint(-4, 4, (9, 700), generator=torch.Generator().manual_seed(2)).float().to(dev)
    full = tri.topk(scores, 50)
    for r in range(9):
        assert torch.equal(tri.topk(scores[r:r + 1], 50)[0], full[r])


def test_bad_inputs_name_the_argument(dev):
    with pytest.raises(ValueError, match="NaN"):
        tri.topk(torch.tensor([[1.0, float("nan")]], device=dev), 1)
        bi.raise_failed_checks()  # a GPU defers the check to here
    with pytest.raises(TypeError, match="k"):
        tri.topk(torch.ones(1, 3, device=dev), 1.5)
    with pytest.raises(ValueError, match="scores"):
        tri.topk(torch.ones(3, device=dev), 1)
    q, w, k, qp, kp = _indexer_data(4, 8, torch.float32, dev)
    with pytest.raises(ValueError, match="weights"):
        tri.indexer_scores(q, w[:, :2], k, qp, kp)
    with pytest.raises(TypeError, match="q"):
        tri.indexer_scores(q, w, k.bfloat16(), qp, kp)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_indexer_invariant_at_prefill_scale(dtype):
    q, w, k, qp, kp = _indexer_data(1024, 2048, dtype, "cuda", h=64, d=128)
    full = tri.indexer_scores(q, w, k, qp, kp)
    for t in (0, 1, 63, 64, 511, 1023):
        s = int(qp[t]) + 1  # decode: the keys up to this token
        alone = tri.indexer_scores(q[t:t + 1], w[t:t + 1], k[:s], qp[t:t + 1], kp[:s])[0]
        assert torch.equal(alone, full[t, :s]), f"t={t}: {first_difference(alone, full[t, :s])}"


@pytest.mark.gpu
@pytest.mark.parametrize("cols, k", [(64, 6), (571, 256), (1500, 300)])
def test_gpu_topk_many_short_rows_match_the_oracle_and_one_row_alone(cols, k):
    # >= 256 rows take a block sized to the row, a single row the wide one: both must be the oracle's
    g = torch.Generator().manual_seed(cols)
    scores = torch.randint(-8, 8, (700, cols), generator=g).float()  # ties at the threshold
    scores[5, cols // 3:] = float("-inf")
    got = tri.topk(scores.cuda(), k).cpu()
    assert torch.equal(got, topk_reference(scores, k))
    for r in (0, 5, 699):
        assert torch.equal(tri.topk(scores[r:r + 1].cuda(), k).cpu()[0], got[r])


@pytest.mark.gpu
def test_gpu_topk_matches_oracle_at_128k_columns():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 131072, generator=g)
    scores[1] = torch.randint(-8, 8, (131072,), generator=g).float()  # ties at the threshold
    scores[2, 5000:] = float("-inf")
    got = tri.topk(scores.cuda(), 2048).cpu()
    assert torch.equal(got, topk_reference(scores, 2048))
    ragged = torch.randint(-5, 5, (3, 50000), generator=g).float()  # a partial last segment, ties
    ragged[2, :49000] = float("-inf")
    assert torch.equal(tri.topk(ragged.cuda(), 2048).cpu(), topk_reference(ragged, 2048))
    assert torch.equal(tri.topk(scores[:1].cuda(), 2048).cpu(), got[:1])  # one row alone
