"""Triton sparse MLA over head leaves: one forward launch for every head gives each head the bits of
a call over its leaf alone, and the Triton backward is exact under packing (a packed batch of
sequences == each sequence alone) and under tensor parallelism (per-leaf key gradients, whoever
holds the leaf), for every gradient: q_latent, q_rope, kv_latent, k_rope."""
import pytest
import torch

import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant import Packing, raise_failed_checks
from zmrl.batch_invariant.collectives import tree_sum
from zmrl.batch_invariant.triton import sparse_mla_backward as bwd
from zmrl.batch_invariant.triton.sparse_mla import sparse_mla_forward

from tests.batch_invariant.invariance import assert_bitwise
from tests.batch_invariant.triton._util import randn, rel_err

DTYPES = [torch.float32, torch.bfloat16]
LEAVES = 8
LENGTHS = [9, 1, 14, 6]  # a one-token sequence; sequences longer and shorter than the list width


def _inputs(dtype, dev, rope=True, t=10, h=16, c=32, r=16, s=24, width=12, seed=0):
    ql = randn(t, h, c, dtype=dtype, device=dev, seed=seed)
    qr = randn(t, h, r, dtype=dtype, device=dev, seed=seed + 1) if rope else None
    kv = randn(s, c, dtype=dtype, device=dev, seed=seed + 2)
    kr = randn(s, r, dtype=dtype, device=dev, seed=seed + 3) if rope else None
    return ql, qr, kv, kr


def _random_indices(t, s, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((t, width), -1, dtype=torch.int64)
    for row in range(t):
        n = [0, 1, width][row] if row < 3 else int(torch.randint(1, width + 1, (1,), generator=g))
        idx[row, :n] = torch.randperm(s, generator=g)[:n].sort().values
    return idx


def _packed_indices(lengths, width, seed=0):
    """What select_tokens_packed makes: each row's own sequence's tokens up to itself, ascending,
    -1 padded, as rows of the packed batch."""
    g = torch.Generator().manual_seed(seed)
    rows, start = [], 0
    for n in lengths:
        for pos in range(n):
            pick = torch.randperm(pos + 1, generator=g)[:width].sort().values + start
            rows.append(torch.cat([pick, pick.new_full((width - pick.numel(),), -1)]))
        start += n
    return torch.stack(rows)


def _per_leaf_forward(ql, qr, kv, kr, idx, scale, leaves):
    parts = [tri.sparse_mla(q.contiguous(), None if qr is None else r.contiguous(), kv, kr, idx, scale)
             for q, r in zip(ql.chunk(leaves, 1), qr.chunk(leaves, 1) if qr is not None else [None] * leaves)]
    return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 1)


def _leaves_forward(ql, qr, kv, kr, idx, scale, leaves):
    return tri.sparse_mla_leaves(ql, qr, [kv] * leaves, None if kr is None else [kr] * leaves, idx, scale)


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [True, False])
def test_one_launch_for_all_heads_equals_a_call_per_leaf(dev, dtype, rope):
    ql, qr, kv, kr = _inputs(dtype, dev, rope)
    idx = _random_indices(10, 24, 12).to(dev)
    out, lse = _leaves_forward(ql, qr, kv, kr, idx, 0.2, LEAVES)
    want_out, want_lse = _per_leaf_forward(ql, qr, kv, kr, idx, 0.2, LEAVES)
    assert_bitwise(out, want_out, "out")
    assert_bitwise(lse, want_lse, "lse")
    # a tensor-parallel rank holding leaves 4..7 (heads 8..15) only
    heads = slice(8, 16)
    part_out, part_lse = _leaves_forward(ql[:, heads], qr[:, heads] if rope else None, kv, kr, idx, 0.2, 4)
    assert_bitwise(part_out, want_out[:, heads], "out of half the leaves")
    assert_bitwise(part_lse, want_lse[:, heads], "lse of half the leaves")


def test_negative_control_another_key_order_changes_the_forward_bits(dev):
    # the equality above holds because only the tile's rows change; another walk over the keys
    # (two online-softmax chunks of 16 instead of one of 64) gives other bits for the same heads.
    # (Another latent slice width would not do: on CUDA an fp32 dot accumulates in one FMA chain
    # whatever the slice, so it keeps the bits.)
    ql, qr, kv, kr = _inputs(torch.float32, dev, s=48)
    idx = _random_indices(10, 48, 32).to(dev)
    want, _ = sparse_mla_forward(ql, qr, kv, kr, idx, 0.2, 64)
    other, _ = sparse_mla_forward(ql, qr, kv, kr, idx, 0.2, 16)
    assert_bitwise(want[:2], other[:2], "rows with no key and one key")  # one chunk either way
    assert not torch.equal(other, want)


# ----------------------------------------------------------------------------- backward
def _weights(t, h, c, dev, seed=7):
    """Fixed upstream gradients for out [T, H, C] and lse [T, H] (lse's: the d lse path)."""
    return randn(t, h, c, device=dev, seed=seed), randn(t, h, device=dev, seed=seed + 1)


def _grads(ql, qr, kv, kr, idx, scale, leaves, weights, lengths=None, packing=None):
    """-> {dq, dqr, dkv [leaves, S, C], dkr [leaves, S, R]}. The key tensors enter as one alias per
    leaf (as collectives.fan_out hands them over), so each leaf's gradient is seen on its own.
    lengths: the rows are these packed sequences (a Packing goes in: the sequence-tiled key kernel);
    packing: that Packing as given (default: made from the lengths)."""
    q = ql.clone().requires_grad_()
    r = None if qr is None else qr.clone().requires_grad_()
    kv_base = kv.clone().requires_grad_()
    kvs = [kv_base.view_as(kv_base) for _ in range(leaves)]
    kr_base = None if kr is None else kr.clone().requires_grad_()
    krs = [] if kr is None else [kr_base.view_as(kr_base) for _ in range(leaves)]
    if packing is None and lengths is not None:
        packing = Packing.from_bounds(_bounds(lengths), ql.device)
    out, lse = tri.sparse_mla_leaves(q, r, kvs, krs or None, idx, scale, packing=packing)
    w, wl = weights
    loss = (out.float() * w).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * wl).sum()
    grads = list(torch.autograd.grad(loss, [q] + ([r] if r is not None else []) + kvs + krs))
    dq = grads.pop(0)
    dqr = grads.pop(0) if r is not None else None
    return dict(dq=dq, dqr=dqr, dkv=torch.stack(grads[:leaves]), dkr=torch.stack(grads[leaves:]) if krs else None)


def _bounds(lengths):
    return [sum(lengths[:i]) for i in range(len(lengths) + 1)]


def _reference_grads(ql, qr, kv, kr, idx, scale, leaves, weights):
    """float64 autograd through the plain softmax, one leaf's heads at a time for the key grads."""
    w, wl = (x.double() for x in weights)
    h = ql.shape[1] // leaves
    res = {"dq": [], "dqr": [], "dkv": [], "dkr": []}
    valid, safe = idx >= 0, idx.clamp(min=0)
    for g in range(leaves):
        heads = slice(g * h, (g + 1) * h)
        q, r, k, kro = (None if x is None else x.detach().double().requires_grad_()
                        for x in (ql[:, heads], None if qr is None else qr[:, heads], kv, kr))
        logits = torch.einsum("thc,tkc->thk", q, k[safe])
        if r is not None:
            logits = logits + torch.einsum("thr,tkr->thk", r, kro[safe])
        logits = (logits * scale).masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(logits, -1)
        p = torch.exp(logits - lse[..., None].clamp(min=-1e300)).nan_to_num(0.0)
        out = torch.einsum("thk,tkc->thc", p, k[safe])
        loss = (out * w[:, heads]).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * wl[:, heads]).sum()
        names = ("dq", "dqr", "dkv", "dkr") if r is not None else ("dq", "dkv")
        for name, gr in zip(names, torch.autograd.grad(loss, [x for x in (q, r, k, kro) if x is not None])):
            res[name].append(gr)
    rope = qr is not None
    return dict(dq=torch.cat(res["dq"], 1), dqr=torch.cat(res["dqr"], 1) if rope else None,
                dkv=torch.stack(res["dkv"]), dkr=torch.stack(res["dkr"]) if rope else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [True, False])
def test_backward_matches_float64_per_leaf(dev, dtype, rope):
    ql, qr, kv, kr = _inputs(dtype, dev, rope, h=4)
    idx = _random_indices(10, 24, 12).to(dev)
    weights = _weights(10, 4, 32, dev)
    got = _grads(ql, qr, kv, kr, idx, 0.2, 2, weights)
    want = _reference_grads(ql, qr, kv, kr, idx, 0.2, 2, weights)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, ref in want.items():
        if ref is None:
            assert got[name] is None
            continue
        assert got[name].dtype == dtype, name
        assert rel_err(got[name], ref) < tol, f"{name}: {rel_err(got[name], ref)}"
    assert not got["dq"][0].any()  # row 0 selects nothing
    unread = torch.ones(kv.shape[0], dtype=torch.bool, device=dev)
    unread[idx[idx >= 0]] = False
    assert unread.any() and not got["dkv"][:, unread].any()


@pytest.mark.parametrize("dtype, rope", [(torch.float32, True), (torch.bfloat16, False)])  # each branch once
def test_sequence_tiled_backward_matches_float64_per_leaf(dev, dtype, rope):
    ql, qr, kv, kr, idx, weights = _packed_case(dtype, dev, rope)
    got = _grads(ql, qr, kv, kr, idx, 0.2, 2, weights, LENGTHS)
    want = _reference_grads(ql, qr, kv, kr, idx, 0.2, 2, weights)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, ref in want.items():
        if ref is not None:
            assert got[name].dtype == dtype, name
            assert rel_err(got[name], ref) < tol, f"{name}: {rel_err(got[name], ref)}"
    # the query gradients come from the same kernel with or without the packing
    pairs = _grads(ql, qr, kv, kr, idx, 0.2, 2, weights)
    assert torch.equal(got["dq"], pairs["dq"])


def test_with_a_packing_every_index_must_stay_in_its_own_sequence(dev):
    ql, qr, kv, kr, idx, weights = _packed_case(torch.float32, dev, True)
    ql.requires_grad_()  # the packing is checked where a backward will read it
    packing = Packing.from_bounds(_bounds(LENGTHS), dev)
    crossing = idx.clone()
    crossing[LENGTHS[0], 0] = 0  # the second sequence's first query reads the first sequence's key
    with pytest.raises(ValueError, match="in its query's own sequence"):
        tri.sparse_mla_leaves(ql, qr, [kv] * 2, [kr] * 2, crossing, 0.2, packing=packing)
        raise_failed_checks()
    ahead = idx.clone()
    assert idx[2, 2] == 2 and idx[2, 3] == -1
    ahead[2, 3] = 5  # a query of the first sequence also reads a later key of its own sequence
    with pytest.raises(ValueError, match="at or before the query"):
        tri.sparse_mla_leaves(ql, qr, [kv] * 2, [kr] * 2, ahead, 0.2, packing=packing)
        raise_failed_checks()
    repeated = idx.clone()
    repeated[5, 1] = repeated[5, 0]
    with pytest.raises(ValueError, match="strictly ascending"):
        tri.sparse_mla_leaves(ql, qr, [kv] * 2, [kr] * 2, repeated, 0.2, packing=packing)
        raise_failed_checks()
    with pytest.raises(ValueError, match="the packing holds"):
        tri.sparse_mla_leaves(ql[:-1], qr[:-1], [kv[:-1]] * 2, [kr[:-1]] * 2, idx[:-1].clamp(max=28), 0.2,
                             packing=packing)
    raise_failed_checks()  # each bad input above failed one check only: nothing is left to report
    with torch.no_grad():  # an inference forward does not read the packing, so it checks nothing
        tri.sparse_mla_leaves(ql, qr, [kv] * 2, [kr] * 2, crossing, 0.2, packing=packing)
    raise_failed_checks()


def _packed_case(dtype, dev, rope, h=4, lengths=LENGTHS):
    """Few heads: the interpreter runs a program per (key, leaf), each looping over the leaf's heads."""
    t = sum(lengths)
    ql, qr, kv, kr = _inputs(dtype, dev, rope, t=t, h=h, s=t)
    return ql, qr, kv, kr, _packed_indices(lengths, 8).to(dev), _weights(t, h, 32, dev)


@pytest.mark.parametrize("dtype, rope, tiled", [
    (torch.float32, True, False), (torch.float32, False, False), (torch.bfloat16, True, False),
    (torch.float32, False, True), (torch.bfloat16, True, True)])
def test_backward_of_a_packed_batch_equals_each_sequence_alone(dev, dtype, rope, tiled):
    ql, qr, kv, kr, idx, (w, wl) = _packed_case(dtype, dev, rope)
    _assert_packed_grads_equal_each_sequence_alone(ql, qr, kv, kr, idx, 0.2, 2, (w, wl), LENGTHS, tiled)


def _assert_packed_grads_equal_each_sequence_alone(ql, qr, kv, kr, idx, scale, leaves, weights, lengths,
                                                   tiled=False) -> dict:
    """Every gradient of the packed call, per sequence, against that sequence's call alone (its
    indices shifted to its own rows) -> the packed call's gradients. tiled: both calls pass their
    packing (the sequence-tiled key kernel)."""
    w, wl = weights
    packed = _grads(ql, qr, kv, kr, idx, scale, leaves, weights, lengths if tiled else None)
    start = 0
    for b, n in enumerate(lengths):
        rows = slice(start, start + n)
        alone = _grads(ql[rows], None if qr is None else qr[rows], kv[rows], None if kr is None else kr[rows],
                       torch.where(idx[rows] >= 0, idx[rows] - start, -1), scale, leaves, (w[rows], wl[rows]),
                       [n] if tiled else None)
        for name in ("dq", "dqr"):
            if alone[name] is not None:
                assert_bitwise(packed[name][rows], alone[name], f"sequence {b} {name}")
        for name in ("dkv", "dkr"):
            if alone[name] is not None:
                assert_bitwise(packed[name][:, rows], alone[name], f"sequence {b} {name}")
        start += n
    return packed


def test_key_tiles_built_on_the_device_are_the_host_tiles_then_empty_ones():
    for lengths, height in (([9, 1, 14, 6], 4), ([40, 3], 16), ([64, 64], 32), ([1], 64), ([5, 70, 2, 33], 16)):
        bounds = _bounds(lengths)
        host = bwd.key_tiles(tuple(bounds), torch.device("cpu"), height)
        built = bwd.refillable_key_tiles(torch.tensor(bounds), bounds[-1], height)
        assert built.shape == (-(-bounds[-1] // height) + len(lengths), 3)
        assert torch.equal(built[:len(host)], host) and not built[len(host):].any(), (lengths, height)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_refillable_packing_gives_the_host_tiles_bits_and_follows_a_refill(dev, dtype):
    # a packing with a width (what a CUDA graph holds) builds its key tiles on the device from its
    # offsets, wider than needed: the same gradients, bit for bit, as the host tiles of the exact
    # packing; refilled in place with other lengths, it gives what a packing of those lengths gives
    lengths, others = [9, 1, 14, 6], [3, 12, 9, 6]
    ql, qr, kv, kr, idx, weights = _packed_case(dtype, dev, True, lengths=lengths)
    exact = _grads(ql, qr, kv, kr, idx, 0.2, 2, weights, lengths)
    refillable = Packing.from_bounds(_bounds(others), dev, width=16)
    refillable.refill(_bounds(lengths))
    got = _grads(ql, qr, kv, kr, idx, 0.2, 2, weights, lengths, packing=refillable)
    for name in exact:
        assert_bitwise(got[name], exact[name], name)
    idx_others = _packed_indices(others, 8).to(dev)
    refillable.refill(_bounds(others))
    got = _grads(ql, qr, kv, kr, idx_others, 0.2, 2, weights, others, packing=refillable)
    want = _grads(ql, qr, kv, kr, idx_others, 0.2, 2, weights, others)
    for name in want:
        assert_bitwise(got[name], want[name], f"refilled {name}")


def _reversed_pairs(indices, num_keys):
    """The negative control's pair order: each key's pairs in descending query order."""
    width, flat = indices.shape[1], indices.reshape(-1)
    n = flat.numel()
    key = torch.where(flat >= 0, flat, num_keys)
    order = torch.argsort(key * n + (n - 1 - torch.arange(n, device=flat.device)))
    bounds = torch.searchsorted(key[order], torch.arange(num_keys + 1, device=flat.device))
    return order // width, bounds


def test_negative_control_the_key_gradient_depends_on_the_order_of_its_pairs(dev, monkeypatch):
    # packed == alone above holds because a key's pairs are summed in an order of their own (ascending
    # query); summed in another order the same pairs give other bits
    ql, qr, kv, kr, idx, weights = _packed_case(torch.float32, dev, True)
    ascending = _grads(ql, qr, kv, kr, idx, 0.2, 2, weights)
    monkeypatch.setattr(bwd, "pairs_by_key", _reversed_pairs)
    descending = _grads(ql, qr, kv, kr, idx, 0.2, 2, weights)
    assert torch.equal(descending["dq"], ascending["dq"])  # the query-major kernel does not use the order
    assert not torch.equal(descending["dkv"], ascending["dkv"])
    torch.testing.assert_close(descending["dkv"], ascending["dkv"])


def test_negative_control_the_tiled_key_gradient_depends_on_its_query_tiles(dev, monkeypatch):
    # packed == alone above holds for the tiled kernel because its query tiles start at each
    # sequence's first row; tiles of another height group the same terms otherwise and give other bits
    # (a sequence longer than both heights, so the grouping differs)
    lengths = [40, 3]
    ql, qr, kv, kr, idx, weights = _packed_case(torch.float32, dev, True, lengths=lengths)
    want = _grads(ql, qr, kv, kr, idx, 0.2, 2, weights, lengths)
    config = bwd._tile_config
    monkeypatch.setattr(bwd, "_tile_config",
                        lambda c, dtype: {**config(c, dtype), "BLOCK_T": 2 * config(c, dtype)["BLOCK_T"]})
    other = _grads(ql, qr, kv, kr, idx, 0.2, 2, weights, lengths)
    assert torch.equal(other["dq"], want["dq"])
    assert not torch.equal(other["dkv"], want["dkv"])
    torch.testing.assert_close(other["dkv"], want["dkv"])


@pytest.mark.parametrize("dtype, tiled", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_backward_per_leaf_is_the_same_whichever_leaves_a_host_holds(dev, dtype, tiled):
    # one host with all 4 leaves (8 heads) vs two tensor-parallel hosts with 2 leaves each
    ql, qr, kv, kr, idx, (w, wl) = _packed_case(dtype, dev, True, h=8)
    lengths = LENGTHS if tiled else None
    one = _grads(ql, qr, kv, kr, idx, 0.2, 4, (w, wl), lengths)
    halves = (slice(0, 4), slice(4, 8))
    hosts = [_grads(ql[:, h], qr[:, h], kv, kr, idx, 0.2, 2, (w[:, h], wl[:, h]), lengths) for h in halves]
    for rank, (heads, leaves, got) in enumerate(zip(halves, (slice(0, 2), slice(2, 4)), hosts)):
        assert_bitwise(got["dq"], one["dq"][:, heads], f"rank {rank} dq")
        assert_bitwise(got["dqr"], one["dqr"][:, heads], f"rank {rank} dqr")
        assert_bitwise(got["dkv"], one["dkv"][leaves], f"rank {rank} dkv")
        assert_bitwise(got["dkr"], one["dkr"][leaves], f"rank {rank} dkr")
    # so the canonical tree (each host its subtree, then the top) gives one host's sum
    for name in ("dkv", "dkr"):
        two_hosts = tree_sum([tree_sum([g.float() for g in host[name]]) for host in hosts])
        assert_bitwise(two_hosts, tree_sum([g.float() for g in one[name]]), name)


def test_negative_control_one_accumulator_over_all_heads_is_not_the_tree_over_leaves(dev):
    # why the key gradient is formed per leaf: summing every head of a host in one accumulator gives
    # other bits than the canonical tree over the leaves, so TP = 2 would differ from TP = 1
    ql, qr, kv, kr, idx, weights = _packed_case(torch.float32, dev, True)
    per_leaf = _grads(ql, qr, kv, kr, idx, 0.2, 4, weights)
    one_sum = _grads(ql, qr, kv, kr, idx, 0.2, 1, weights)
    assert torch.equal(one_sum["dq"], per_leaf["dq"])
    tree = tree_sum(list(per_leaf["dkv"].float()))
    assert not torch.equal(one_sum["dkv"][0], tree)
    torch.testing.assert_close(one_sum["dkv"][0], tree)


# ----------------------------------------------------------------------------- GPU, model shapes
MODEL_DIMS = {  # heads, kv_lora_rank, qk_rope_head_dim, index_topk, packed sequence lengths
    "small": (16, 256, 32, 256, [700, 1, 300]),
    "k31-layer": (96, 512, 0, 2048, [2300, 40]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", list(MODEL_DIMS))
def test_gpu_leaves_at_model_shape(dtype, dims):
    h, c, r, width, lengths = MODEL_DIMS[dims]
    t, rope = sum(lengths), r > 0
    ql, qr, kv, kr = _inputs(dtype, "cuda", rope, t=t, h=h, c=c, r=max(r, 16), s=t)
    idx = _packed_indices(lengths, width).cuda()
    scale = 0.07
    out, lse = _leaves_forward(ql, qr, kv, kr, idx, scale, LEAVES)
    want_out, want_lse = _per_leaf_forward(ql, qr, kv, kr, idx, scale, LEAVES)
    assert_bitwise(out, want_out, "out")
    assert_bitwise(lse, want_lse, "lse")
    w, wl = _weights(t, h, c, "cuda")
    packed = _assert_packed_grads_equal_each_sequence_alone(ql, qr, kv, kr, idx, scale, LEAVES, (w, wl), lengths)
    half = slice(h // 2, h)
    host = _grads(ql[:, half], qr[:, half] if rope else None, kv, kr, idx, scale, LEAVES // 2,
                  (w[:, half], wl[:, half]))
    assert_bitwise(host["dq"], packed["dq"][:, half], "dq of half the leaves")
    assert_bitwise(host["dkv"], packed["dkv"][LEAVES // 2:], "dkv of half the leaves")
    if rope:
        assert_bitwise(host["dkr"], packed["dkr"][LEAVES // 2:], "dkr of half the leaves")
    ref = _reference_grads(ql[:40], qr[:40] if rope else None, kv, kr, idx[:40], scale, LEAVES,
                           (w[:40], wl[:40]))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(packed["dq"][:40], ref["dq"]) < tol
    # the sequence-tiled key kernel: exact under packing too, and the pairs' gradients within rounding
    tiled = _assert_packed_grads_equal_each_sequence_alone(ql, qr, kv, kr, idx, scale, LEAVES, (w, wl), lengths,
                                                           tiled=True)
    assert torch.equal(tiled["dq"], packed["dq"])
    for name in ("dkv", "dkr") if rope else ("dkv",):
        assert rel_err(tiled[name], packed[name].double()) < tol, f"{name}: {rel_err(tiled[name], packed[name])}"
