"""Packed sequences in one call (cu_seqlens offsets): indexer_scores_varlen and mla_attend_packed
give every query the bits of a call over its own sequence alone."""
import dataclasses
import importlib

import pytest
import torch

import zmrl.batch_invariant as bi
from zmrl.model.attention import CacheView, mla_attend, mla_attend_packed, mla_project, select_tokens, \
    select_tokens_packed
from zmrl.model.config import ModelConfig
from zmrl.model.layers import init_weights
from zmrl.model.presets import PRESETS

from tests.batch_invariant.invariance import assert_bitwise

LENGTHS = [5, 70, 1, 33, 40]  # both sides of the 32-row tile, a one-token sequence
DTYPES = [torch.float32, torch.bfloat16]


def _packed(lengths, h=4, d=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    w = torch.randn(t, h, generator=g)
    k = torch.randn(t, d, generator=g).to(dtype)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *lengths]).cumsum(0)
    return q, w, k, pos, cu


@pytest.mark.parametrize("path", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_varlen_equals_a_call_per_sequence(path, dtype):
    q, w, k, pos, cu = _packed(LENGTHS, dtype=dtype)
    with bi.use_path(path):
        out = bi.indexer_scores_varlen(q, w, k, pos, pos, cu, cu)
        assert out.shape == (sum(LENGTHS), max(LENGTHS))
        for b, n in enumerate(LENGTHS):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            alone = bi.indexer_scores(q[rows], w[rows], k[rows], pos[rows], pos[rows])
            assert_bitwise(out[rows, :n], alone, f"sequence {b}")
            assert (out[rows, n:] == float("-inf")).all(), f"sequence {b}: a column past its keys is selectable"


def test_negative_control_torchs_indexer_gives_a_packed_query_other_bits():
    # the torch path scores the packed rows in one einsum: some queries get other bits than in a
    # call over their own sequence, which the comparison above would catch
    q, w, k, pos, cu = _packed(LENGTHS)
    differing = 0
    with bi.use_path("torch"):
        out = bi.indexer_scores_varlen(q, w, k, pos, pos, cu, cu)
        for b, n in enumerate(LENGTHS):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            alone = bi.indexer_scores(q[rows], w[rows], k[rows], pos[rows], pos[rows])
            differing += int((out[rows, :n] != alone).sum())
    assert differing > 0


def test_indexer_varlen_keys_other_than_queries():
    # a prefill chunk: each sequence's last few queries against all its keys so far
    q, w, k, pos, cu_k = _packed(LENGTHS)
    n_q = [min(3, n) for n in LENGTHS]
    rows = torch.cat([torch.arange(int(cu_k[b + 1]) - m, int(cu_k[b + 1])) for b, m in enumerate(n_q)])
    cu_q = torch.tensor([0, *n_q]).cumsum(0)
    out = bi.indexer_scores_varlen(q[rows], w[rows], k, pos[rows], pos, cu_q, cu_k)
    for b, n in enumerate(LENGTHS):
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        mine = rows[int(cu_q[b]):int(cu_q[b + 1])]
        alone = bi.indexer_scores(q[mine], w[mine], k[keys], pos[mine], pos[keys])
        assert_bitwise(out[int(cu_q[b]):int(cu_q[b + 1]), :n], alone, f"sequence {b}")


def test_negative_control_indexer_varlen_sees_only_its_own_sequence():
    # the same rows scored as one long sequence: later sequences' queries see earlier sequences'
    # keys, so the scores (and the shape) differ; the packing offsets are what the test relies on
    q, w, k, pos, cu = _packed(LENGTHS)
    merged = bi.indexer_scores_varlen(q, w, k, pos, pos, torch.tensor([0, sum(LENGTHS)]),
                                      torch.tensor([0, sum(LENGTHS)]))
    rows = slice(int(cu[1]), int(cu[2]))
    assert torch.isfinite(merged[rows, : int(cu[1])]).any()  # keys of sequence 0 are visible there


def test_indexer_varlen_bad_offsets_are_named():
    q, w, k, pos, cu = _packed(LENGTHS)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        bi.indexer_scores_varlen(q, w, k, pos, pos, cu[:-1], cu)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        bi.indexer_scores_varlen(q, w, k, pos, pos, cu, cu.flip(0))


# ----------------------------------------------------------------------------- the model's packed attention
def _model(nope=False):
    fields = dict(PRESETS["tiny"])
    if nope:
        fields["qk_rope_head_dim"] = 0
    cfg = ModelConfig(**fields)
    w = init_weights(cfg, seed=1)
    return cfg, {k[len("model.layers.1."):]: v for k, v in w.items() if k.startswith("model.layers.1.")}


def _project(cfg, w, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), cfg.hidden_size, generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return mla_project(cfg, w, x, pos)


@pytest.mark.parametrize("nope", [False, True])
def test_mla_attend_packed_equals_per_sequence(nope):
    cfg, w = _model(nope)
    query, new = _project(cfg, w, LENGTHS)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    packed = mla_attend_packed(cfg, query, new, cu)
    picked = select_tokens_packed(cfg, query, new, cu)
    for b in range(len(LENGTHS)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        view = CacheView(new.latents[rows], None if nope else new.rope_keys[rows], new.index_keys[rows],
                         query.positions[rows])
        alone = select_tokens(cfg, query.rows(rows), view)
        assert torch.equal(picked[rows], torch.where(alone >= 0, alone + int(cu[b]), -1)), f"sequence {b}"
        assert_bitwise(packed[rows], mla_attend(cfg, query.rows(rows), view), f"sequence {b}")
    assert (picked[: int(cu[2])] >= 0).sum(1).max() == cfg.index_topk  # the 70-token sequence attends sparsely


def test_mla_attend_packed_gradients_equal_per_sequence():
    cfg, w = _model()
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    grads = []
    for packed in (True, False):
        query, new = _project(cfg, w, LENGTHS)
        leaves = [query.q_latent, query.q_rope, new.latents, new.rope_keys]
        leaves = [t.detach().requires_grad_() for t in leaves]
        query = dataclasses.replace(query, q_latent=leaves[0], q_rope=leaves[1])
        new = dataclasses.replace(new, latents=leaves[2], rope_keys=leaves[3])
        if packed:
            out = mla_attend_packed(cfg, query, new, cu)
        else:
            out = torch.cat([mla_attend(cfg, query.rows(slice(int(cu[b]), int(cu[b + 1]))), CacheView(
                new.latents[int(cu[b]):int(cu[b + 1])], new.rope_keys[int(cu[b]):int(cu[b + 1])],
                new.index_keys[int(cu[b]):int(cu[b + 1])], query.positions[int(cu[b]):int(cu[b + 1])]))
                for b in range(len(LENGTHS))])
        weight = torch.linspace(-1, 1, out.numel()).view(out.shape)
        grads.append(torch.autograd.grad((out * weight).sum(), leaves))
    for name, a, b in zip(("q_latent", "q_rope", "latents", "rope_keys"), *grads):
        assert_bitwise(a, b, name)


def test_negative_control_packed_attention_without_offsets_mixes_sequences():
    cfg, w = _model()
    query, new = _project(cfg, w, LENGTHS)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    packed = mla_attend_packed(cfg, query, new, cu)
    # no offsets: one long sequence (positions counted on through it), everything else the same
    query.positions = torch.arange(sum(LENGTHS))
    one = mla_attend_packed(cfg, query, new, torch.tensor([0, sum(LENGTHS)]))
    rows = slice(int(cu[1]), int(cu[2]))
    assert not torch.equal(packed[rows], one[rows])


def test_mla_attend_packed_refuses_positions_out_of_order():
    cfg, w = _model()
    query, new = _project(cfg, w, [4, 4])
    query.positions = torch.tensor([0, 1, 2, 3, 0, 2, 1, 3])
    with pytest.raises(ValueError, match="strictly ascending within each packed sequence"):
        mla_attend_packed(cfg, query, new, torch.tensor([0, 4, 8]))


def test_packing_holds_the_offsets_on_host_and_device():
    p = bi.Packing.from_bounds([0, 3, 3, 7], "cpu")
    assert p.bounds == (0, 3, 3, 7) and (p.num_rows, p.num_seqs, p.max_len) == (7, 3, 4)
    assert torch.equal(p.seq, torch.tensor([0, 0, 0, 2, 2, 2, 2]))
    assert torch.equal(p.local, torch.tensor([0, 1, 2, 0, 1, 2, 3]))
    assert torch.equal(p.first_row, torch.tensor([0, 0, 0, 3, 3, 3, 3]))
    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 3, 2\] must rise from 0"):
        bi.Packing.from_bounds([0, 3, 2], "cpu")
    with pytest.raises(ValueError, match=r"cu_seqlens must be a \[B \+ 1\] tensor, got \(2, 2\)"):
        bi.Packing.of(torch.zeros(2, 2, dtype=torch.int64), "cpu")


@pytest.mark.gpu
def test_gpu_packing_is_the_host_packing_without_a_wait():
    bounds = [0, 3, 3, 7, 300, 14788]
    want = bi.Packing.from_bounds(bounds, "cpu")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host read of a GPU value raises
    try:
        got = bi.Packing.from_bounds(bounds, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("cu_seqlens", "seq", "local", "first_row"):
        t = getattr(got, name)
        assert t.is_cuda and torch.equal(t.cpu(), getattr(want, name)), name
    assert got.bounds == want.bounds


@pytest.mark.parametrize("path", ["cpu", "reference", "torch"])
def test_indexer_varlen_takes_a_packing_with_the_same_bits(path):
    q, w, k, pos, cu = _packed(LENGTHS)
    packing = bi.Packing.from_bounds(cu.tolist(), "cpu")
    with bi.use_path(path):
        assert torch.equal(bi.indexer_scores_varlen(q, w, k, pos, pos, packing, packing),
                           bi.indexer_scores_varlen(q, w, k, pos, pos, cu, cu))
        # negative control: another packing of the same rows scores other columns
        other = bi.Packing.from_bounds([0, sum(LENGTHS)], "cpu")
        assert not torch.equal(bi.indexer_scores_varlen(q, w, k, pos, pos, other, other)[:, :max(LENGTHS)],
                               bi.indexer_scores_varlen(q, w, k, pos, pos, cu, cu))


@pytest.mark.parametrize("path", ["cpu", "reference", "torch"])
def test_a_wider_packing_scores_more_columns_with_the_same_bits(path):
    q, w, k, pos, cu = _packed(LENGTHS)
    narrow = bi.Packing.from_bounds(cu.tolist(), "cpu")
    wide = bi.Packing.from_bounds(cu.tolist(), "cpu", width=max(LENGTHS) + 29)
    assert wide.max_len == max(LENGTHS) + 29 and narrow.max_len == max(LENGTHS)
    with bi.use_path(path):
        a = bi.indexer_scores_varlen(q, w, k, pos, pos, narrow, narrow)
        b = bi.indexer_scores_varlen(q, w, k, pos, pos, wide, wide)
    assert b.shape == (sum(LENGTHS), max(LENGTHS) + 29)
    assert_bitwise(b[:, :max(LENGTHS)], a, "the columns both hold")
    assert (b[:, max(LENGTHS):] == float("-inf")).all()
    assert torch.equal(bi.topk(b, 16), bi.topk(a, 16))  # the DSA selection is the same


def test_a_refilled_packing_equals_one_built_for_its_bounds():
    lengths = [5, 70, 1, 33, 40]
    packing = bi.Packing.from_bounds(torch.tensor([0, *lengths]).cumsum(0).tolist(), "cpu", width=80)
    cu_before = packing.cu_seqlens
    other = torch.tensor([0, 40, 2, 70, 7, 30]).cumsum(0).tolist()  # same count and rows, other lengths
    packing.refill(other)
    want = bi.Packing.from_bounds(other, "cpu")
    assert packing.bounds == want.bounds and packing.cu_seqlens is cu_before  # rewritten in place
    for name in ("cu_seqlens", "seq", "local", "first_row"):
        assert torch.equal(getattr(packing, name), getattr(want, name)), name
    assert packing.max_len == 80 and want.max_len == 70


def test_packing_width_and_refill_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="width=4 is narrower than the longest sequence \\(5 rows\\)"):
        bi.Packing.from_bounds([0, 5, 7], "cpu", width=4)
    packing = bi.Packing.from_bounds([0, 5, 7], "cpu", width=6)
    with pytest.raises(ValueError, match="a refill keeps 2 sequences of 7 rows in all, got 3 of 7"):
        packing.refill([0, 2, 5, 7])
    with pytest.raises(ValueError, match="a refill keeps 2 sequences of 7 rows in all, got 2 of 8"):
        packing.refill([0, 4, 8])
    with pytest.raises(ValueError, match="must fit the packing's width 6"):
        packing.refill([0, 7, 7])
    with pytest.raises(ValueError, match="must rise from 0"):
        packing.refill([0, 5, 3])
    assert packing.bounds == (0, 5, 7)  # a refused refill leaves the packing as it was


def _packed_index_violations(indices: torch.Tensor, packing) -> dict[str, int]:
    """Rows breaking what Packing.vouch promises, counted on the host: an entry outside its query's
    own sequence or after the query, entries not strictly ascending, a -1 before a valid entry."""
    idx = indices.cpu()
    picked = idx >= 0
    rows = torch.arange(idx.shape[0])[:, None]
    first = packing.first_row.cpu()[:, None]
    return {
        "outside its sequence or after the query": int((picked & ((idx < first) | (idx > rows))).any(1).sum()),
        "not ascending": int((picked[:, 1:] & (idx[:, 1:] <= idx[:, :-1])).any(1).sum()),
        "-1 before a valid entry": int((~picked[:, :-1] & picked[:, 1:]).any(1).sum()),
    }


def _check_selection_is_what_it_is_vouched_for(device):
    cfg, w = _model()
    w = {k: v.to(device) for k, v in w.items()}
    lengths = [5, 70, 1, 33, 40, 130]  # past index_topk, and short sequences with -1 padding
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(lengths), cfg.hidden_size, generator=g).to(device)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
    query, new = mla_project(cfg, w, x, pos)
    packing = bi.Packing.from_bounds([0, *torch.tensor(lengths).cumsum(0).tolist()], device)
    picked = select_tokens_packed(cfg, query, new, packing)
    assert packing.vouches_for(picked)
    violations = _packed_index_violations(picked, packing)
    assert violations == dict.fromkeys(violations, 0), violations
    assert (picked >= 0).sum(1).max() == cfg.index_topk
    # negative control: the counter sees a selection shifted one row early (a future key)
    shifted = torch.where(picked >= 0, picked + 1, -1)
    assert _packed_index_violations(shifted, packing)["outside its sequence or after the query"] > 0


def test_the_packed_selection_holds_what_the_packing_vouches_for():
    _check_selection_is_what_it_is_vouched_for("cpu")


@pytest.mark.gpu
def test_gpu_the_packed_selection_holds_what_the_packing_vouches_for():
    _check_selection_is_what_it_is_vouched_for("cuda")


def _sparse_mla_packed(indices, packing, rows):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(rows, 2, 16, generator=g)
    kv = torch.randn(rows, 16, generator=g)
    return bi.sparse_mla_leaves(q, None, [kv], None, indices, 0.25, packing=packing)


def test_a_vouched_selection_skips_the_index_checks_until_it_changes(monkeypatch):
    sparse_mla_mod = importlib.import_module("zmrl.batch_invariant.sparse_mla")  # the package's name is the function
    checked = []
    monkeypatch.setattr(sparse_mla_mod, "fail_if",
                        lambda bad, message, detail=None: checked.append(message) or bi.fail_if(bad, message, detail))
    packing = bi.Packing.from_bounds([0, 2, 5], "cpu")
    good = torch.tensor([[0, -1], [0, 1], [2, -1], [2, 3], [3, 4]])
    packing.vouch(good)
    want = _sparse_mla_packed(good.clone(), packing, 5)  # an unvouched copy: checked
    assert len(checked) == 2
    got = _sparse_mla_packed(good, packing, 5)
    assert len(checked) == 2  # vouched: no index check ran
    assert_bitwise(got[0], want[0], "vouched vs checked indices")
    _sparse_mla_packed(good, bi.Packing.from_bounds([0, 2, 5], "cpu"), 5)  # another packing: checked
    assert len(checked) == 4
    good.add_(0)  # an in-place change voids the mark
    assert not packing.vouches_for(good)
    _sparse_mla_packed(good, packing, 5)
    assert len(checked) == 6
    bad = packing.vouch(torch.tensor([[0, 7], [0, 1], [2, -1], [2, 3], [3, 4]])).clone()  # 7: past the 5 rows
    with pytest.raises(ValueError, match="indices must be < 5"):
        _sparse_mla_packed(bad, packing, 5)


def test_an_inference_mode_selection_is_not_vouched_and_stays_checked(monkeypatch):
    """Inference tensors keep no version counter: an in-place change could not void the mark."""
    cfg, w = _model()
    with torch.inference_mode():
        query, new = _project(cfg, w, LENGTHS)
        packing = bi.Packing.from_bounds([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], "cpu")
        picked = select_tokens_packed(cfg, query, new, packing)
        assert not packing.vouches_for(picked)
        assert torch.equal(mla_attend_packed(cfg, query, new, packing), mla_attend_packed(cfg, query, new, packing,
                                                                                         indices=picked.clone()))
    outside = select_tokens_packed(cfg, *_project(cfg, w, LENGTHS), packing)
    assert packing.vouches_for(outside) and torch.equal(outside, picked)  # negative control: vouched outside it

