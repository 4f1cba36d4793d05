"""The grouped expert path with LoRA (zmrl/batch_invariant/triton/moe_lora.py): bit for bit the
per-expert composed loop forward, invariant and float64-close backward, expert-parallel splits."""
import importlib
from types import SimpleNamespace

import pytest
import torch

import zmrl.batch_invariant.triton as tri
from tests.batch_invariant.invariance import first_difference
from tests.batch_invariant.triton._util import randn, rel_err
from tests.moe_lora import Looped, StubAdapter
from zmrl.batch_invariant import use_path
from zmrl.lora.adapter import LoraProjections
from zmrl.model.mlp import combine_slots, expert_slot_outputs
from zmrl.model.projections import Projections

E, D, INTER, K, R, SCALE = 16, 32, 48, 3, 8, 0.75  # 16 experts: 8 canonical leaves of 2






def _cfg():
    return SimpleNamespace(moe_intermediate_size=INTER, n_routed_experts=E)


def _data(dtype, dev, n=11, seed=0, zero_b=False):
    g = torch.Generator().manual_seed(seed)
    x = randn(n, D, dtype=dtype, device=dev, seed=seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K].sort().values for _ in range(n)]).to(dev)
    w = {"mlp.experts.gate_up_proj": randn(E, 2 * INTER, D, dtype=dtype, device=dev, seed=seed + 1, scale=0.2),
         "mlp.experts.down_proj": randn(E, D, INTER, dtype=dtype, device=dev, seed=seed + 2, scale=0.2)}
    b_scale = 0.0 if zero_b else 0.3
    def rnd(*shape, seed, scale):
        return randn(*shape, dtype=dtype, device=dev, seed=seed, scale=scale)

    pairs = {"mlp.experts.gate_up_proj": (rnd(E, R, D, seed=seed + 3, scale=0.3),
                                          rnd(E, 2 * INTER, R, seed=seed + 4, scale=b_scale)),
             "mlp.experts.down_proj": (rnd(E, R, INTER, seed=seed + 5, scale=0.3),
                                       rnd(E, D, R, seed=seed + 6, scale=b_scale))}
    return x, ids, w, StubAdapter(pairs, SCALE)


def _slots(x, ids, w, adapter, looped=False):
    proj = (Looped if looped else LoraProjections)(adapter, 0)
    with use_path("triton"):
        return expert_slot_outputs(_cfg(), w, x, ids, proj)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_forward_equals_the_per_expert_loop(dev, dtype):
    x, ids, w, ad = _data(dtype, dev)
    with torch.no_grad():
        grouped, looped = _slots(x, ids, w, ad), _slots(x, ids, w, ad, looped=True)
    assert grouped.abs().amax(-1).min() > 0, "every slot is local here: no zero rows expected"
    assert torch.equal(grouped, looped), first_difference(grouped, looped)


def test_negative_control_delta_added_unrounded_differs(dev, monkeypatch):
    # the same comparison with the loop adding the delta in fp32 before one rounding: a single
    # rounding step moved must show, or the test above proves nothing
    x, ids, w, ad = _data(torch.bfloat16, dev)

    def fused_delta(self, name, expert, x, weight, rows=None):
        a, b = self.adapter.pair(self.layer, name)
        b = b[expert] if rows is None else b[expert][rows]
        return (tri.linear(x, weight).float() + tri.linear(tri.linear(x, a[expert]), b).float() * SCALE).to(x.dtype)

    monkeypatch.setattr(Looped, "expert_linear", fused_delta)
    with torch.no_grad():
        assert not torch.equal(_slots(x, ids, w, ad), _slots(x, ids, w, ad, looped=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_adapter_equals_the_fused_kernel(dev, dtype):
    x, ids, w, ad = _data(dtype, dev, zero_b=True)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(7)).to(dev)
    gate_up, down = w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"]
    with torch.no_grad():
        grouped = combine_slots(_slots(x, ids, w, ad), weights, None, dtype)
        fused = tri.moe_experts(x, ids, weights, gate_up[:, :INTER], gate_up[:, INTER:], down)
    assert torch.equal(grouped, fused), first_difference(grouped, fused)


def _train(x, ids, w, ad, d_slot, base_trainable=False):
    """One backward through the grouped path: (slot outputs, dx, {factor name: grad}, base grads)."""
    xl = x.clone().requires_grad_()
    pairs = {n: tuple(t.clone().requires_grad_() for t in p) for n, p in ad.pairs.items()}
    wl = {n: t.clone().requires_grad_(base_trainable) for n, t in w.items()}
    out = _slots(xl, ids, wl, StubAdapter(pairs, SCALE))
    (out * d_slot).sum().backward()
    grads = {f"{n}.{ab}": t.grad for n, p in pairs.items() for ab, t in zip("AB", p)}
    return out.detach(), xl.grad, grads, {n: t.grad for n, t in wl.items()}


def test_input_gradient_is_token_invariant(dev):
    x, ids, w, ad = _data(torch.bfloat16, dev, n=12)
    d_slot = randn(12, K, D, device=dev, seed=9)
    _, dx, _, _ = _train(x, ids, w, ad, d_slot)
    for rows in ([5], [0, 7, 3], list(range(11, -1, -2))):
        _, part, _, _ = _train(x[rows], ids[rows], w, ad, d_slot[rows])
        assert torch.equal(part, dx[rows]), f"rows {rows}: {first_difference(part, dx[rows])}"


def test_negative_control_the_torch_path_loop_is_not_token_invariant():
    # torch's own GEMMs per expert see a different M per call: on this CPU's fp32 BLAS that
    # changes a token's input gradient, which the grouped kernels must not
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen)
    wg, wd = torch.randn(2, 64, 96, generator=gen) * 0.1, torch.randn(2, 96, 64, generator=gen) * 0.1
    ids = torch.randint(0, 2, (64,), generator=gen)

    def dx(rows):
        xl = x[rows].clone().requires_grad_()
        out = torch.zeros(len(rows), 96)
        for e in range(2):
            sel = (ids[rows] == e).nonzero()[:, 0]
            out = out.index_put((sel,), (xl[sel] @ wg[e].t()).relu() @ wd[e].t())
        out.pow(2).sum().backward()
        return xl.grad

    full = dx(list(range(64)))
    assert any(not torch.equal(dx([n])[0], full[n]) for n in range(64))


def test_backward_matches_float64_and_frozen_base_gets_no_gradient(dev):
    x, ids, w, ad = _data(torch.float32, dev)
    d_slot = randn(x.shape[0], K, D, device=dev, seed=9)
    _, dx, grads, base = _train(x, ids, w, ad, d_slot, base_trainable=True)
    _, dx_frozen, grads_frozen, none = _train(x, ids, w, ad, d_slot)
    assert all(g is None for g in none.values()) and torch.equal(dx, dx_frozen)
    assert all(torch.equal(grads[n], grads_frozen[n]) for n in grads)

    xd = x.detach().double().requires_grad_()
    wd = {n: t.detach().double().requires_grad_() for n, t in w.items()}
    pd = {n: tuple(t.detach().double().requires_grad_() for t in p) for n, p in ad.pairs.items()}
    gu_w, dn_w = wd["mlp.experts.gate_up_proj"], wd["mlp.experts.down_proj"]
    (a1, b1), (a2, b2) = pd["mlp.experts.gate_up_proj"], pd["mlp.experts.down_proj"]
    out = torch.zeros(x.shape[0], K, D, dtype=torch.float64, device=dev)
    for n in range(x.shape[0]):
        for j in range(K):
            e = int(ids[n, j])
            v = xd[n]
            gu = gu_w[e] @ v + SCALE * (b1[e] @ (a1[e] @ v))
            g, u = gu[:INTER], gu[INTER:]
            h = g * torch.sigmoid(g) * u
            out = out.index_put((torch.tensor(n, device=dev), torch.tensor(j, device=dev)),
                                dn_w[e] @ h + SCALE * (b2[e] @ (a2[e] @ h)))
    (out * d_slot.double()).sum().backward()
    assert rel_err(dx, xd.grad) < 1e-5
    for n, (a, b) in pd.items():
        assert rel_err(grads[f"{n}.A"], a.grad) < 1e-5, n
        assert rel_err(grads[f"{n}.B"], b.grad) < 1e-5, n
    for n, t in wd.items():
        assert rel_err(base[n], t.grad) < 1e-5, n


@pytest.mark.parametrize("stacked", [False, True])
def test_expert_parallel_halves_give_the_whole_run_bits(dev, stacked):
    """Leaves 4..7 on their own (as EP rank 1 of 2 runs them; stacked: with only its own experts'
    weights, as the Megatron trainer stacks them) equal the whole run on those leaves' slots, leaf
    gradients of x and factor gradients."""
    x, ids, w, ad = _data(torch.bfloat16, dev, n=12)
    d_slot = randn(12, K, D, device=dev, seed=9)
    gate_up, down = w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"]
    (a1, b1), (a2, b2) = ad.pairs["mlp.experts.gate_up_proj"], ad.pairs["mlp.experts.down_proj"]

    def run(first_leaf, n_leaves, lo, hi):
        xs = [x.clone().requires_grad_() for _ in range(n_leaves)]
        fac = [t[lo:hi].clone().requires_grad_() for t in (a1, b1, a2, b2)]
        with use_path("triton"):
            out = tri.moe_expert_slots(xs, ids, gate_up[lo:hi], down[lo:hi], tuple(fac[:2]), tuple(fac[2:]),
                                       SCALE, first_leaf, 2, lo, total_leaves=8)
        (out * d_slot).sum().backward()
        return out.detach(), [t.grad for t in xs], [t.grad for t in fac]

    whole, dx_whole, fac_whole = run(0, 8, 0, E)
    half, dx_half, fac_half = run(4, 4, 8 if stacked else 0, E)
    mine = ids >= 8
    assert mine.any() and (~mine).any()
    assert torch.equal(half[mine], whole[mine]) and not half[~mine].any()
    for leaf in range(4):
        assert torch.equal(dx_half[leaf], dx_whole[4 + leaf]), f"leaf {4 + leaf}"
    for got, want in zip(fac_half, fac_whole):
        assert torch.equal(got[-8:], want[8:])
        if not stacked:
            assert not got[:8].any()


class _PoisonedTorch:
    """torch, but `empty` float tensors come filled with NaN: what a GPU's reused memory may hold."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.mark.parametrize("order", ["the rule", "EXPERT_MAJOR"])
@pytest.mark.parametrize("stacked", [False, True])
def test_first_expert_parallel_rank_zeroes_the_other_ranks_slots(dev, monkeypatch, stacked, order):
    """Leaves 0..3 on their own (EP rank 0 of 2; stacked: only experts 0..7's weights, so from its
    weights alone it looks like a host holding every expert). The grouped kernels never write the
    rows of other ranks' slots; poisoned with NaN, those slots must still come out as zeros, and
    rank 0's slots and leaf gradients as the whole run's. Negative control: told its 4 leaves are the
    model's all (`total_leaves=4`, what its weights alone suggest), rank 0 passes the NaN rows through.
    EXPERT_MAJOR: every launch in that order (the rule gives it only where K > 64, never at these
    sizes), so its programs skip the other ranks' sentinel tiles too."""
    grouped = importlib.import_module("zmrl.batch_invariant.triton.grouped")
    monkeypatch.setattr(grouped, "torch", _PoisonedTorch())
    if order != "the rule":
        monkeypatch.setattr(grouped, "PROGRAM_ORDER", getattr(grouped, order))
    x, ids, w, ad = _data(torch.bfloat16, dev, n=12)
    d_slot = randn(12, K, D, device=dev, seed=9)
    gate_up, down = w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"]
    (a1, b1), (a2, b2) = ad.pairs["mlp.experts.gate_up_proj"], ad.pairs["mlp.experts.down_proj"]

    def run(first_leaf, n_leaves, lo, hi, total_leaves=8):
        xs = [x.clone().requires_grad_() for _ in range(n_leaves)]
        fac = [t[lo:hi].clone().requires_grad_() for t in (a1, b1, a2, b2)]
        with use_path("triton"):
            out = tri.moe_expert_slots(xs, ids, gate_up[lo:hi], down[lo:hi], tuple(fac[:2]), tuple(fac[2:]),
                                       SCALE, first_leaf, 2, lo, total_leaves=total_leaves)
        (out * d_slot).sum().backward()
        return out.detach(), [t.grad for t in xs]

    whole, dx_whole = run(0, 8, 0, E)
    half, dx_half = run(0, 4, 0, 8 if stacked else E)
    mine = ids < 8
    assert mine.any() and (~mine).any()
    assert torch.equal(half[mine], whole[mine]) and torch.equal(half[~mine], torch.zeros_like(half[~mine]))
    for leaf in range(4):
        assert torch.equal(dx_half[leaf], dx_whole[leaf]), f"leaf {leaf}"
    if stacked:
        unknown, _ = run(0, 4, 0, 8, total_leaves=4)
        assert torch.isnan(unknown[~mine]).any(), "the poisoned rows did not reach the slots: the test sees nothing"


def test_bad_inputs_name_the_argument(dev):
    x, ids, w, ad = _data(torch.float32, dev, n=3)
    gate_up, down = w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"]
    gu_pair, d_pair = ad.pairs["mlp.experts.gate_up_proj"], ad.pairs["mlp.experts.down_proj"]

    def call(*, xs=(x,) * 8, gu=gate_up, lora_gu=gu_pair, lora_d=d_pair, first_leaf=0, first_expert=0, total=8):
        with use_path("triton"):
            return tri.moe_expert_slots(list(xs), ids, gu, down, lora_gu, lora_d, SCALE, first_leaf, 2, first_expert,
                                        total_leaves=total)

    with pytest.raises(ValueError, match="lora_gate_up must be"):
        call(lora_gu=(gu_pair[0], gu_pair[1][:, :INTER]))
    with pytest.raises(ValueError, match="lora_down must be"):
        call(lora_d=(d_pair[0][:, :, :-1], d_pair[1]))
    with pytest.raises(TypeError, match="lora_gate_up factors must have x's dtype"):
        call(lora_gu=(gu_pair[0].bfloat16(), gu_pair[1].bfloat16()))
    with pytest.raises(ValueError, match=r"need x \[T, D\], gate_up \[E, 2I, D\]"):
        call(gu=gate_up[:, :, :-1])
    with pytest.raises(ValueError, match="must cover leaves 4 ... 7"):
        call(xs=(x,) * 4, first_leaf=4, first_expert=10)
    with pytest.raises(ValueError, match="leaves 4 ... 7 do not lie in the model's 6 expert leaves"):
        call(xs=(x,) * 4, first_leaf=4, first_expert=0, total=6)


def test_grouped_launches_take_8_warps_only_where_two_128_by_128_tiles_would_spill():
    grouped = importlib.import_module("zmrl.batch_invariant.triton.grouped")
    from zmrl.batch_invariant.triton.matmul import config_for

    small = config_for(256, 1024, torch.bfloat16)  # the small preset's experts: 128-row groups
    assert grouped._warps_stages(small, 128, 128, 2) == (8, small.num_stages)
    assert grouped._warps_stages(small, 128, 128, 1) == (small.num_warps, 3)
    assert grouped._warps_stages(small, 128, 16, 1) == (small.num_warps, small.num_stages)  # a LoRA rank
    k31 = config_for(2048, 7168, torch.bfloat16)  # a K3.1 layer's experts: 64-row groups, as measured
    assert grouped._warps_stages(k31, k31.block_m, 128, 2) == (k31.num_warps, k31.num_stages)


def test_grouped_launches_run_expert_major_unless_k_is_a_lora_rank():
    grouped = importlib.import_module("zmrl.batch_invariant.triton.grouped")
    assert grouped.PROGRAM_ORDER is None  # the rule, unless a benchmark or test forces an order
    assert [grouped._program_order(k) for k in (8, 32, 64)] == [grouped.COLUMN_TILE_MAJOR] * 3
    assert [grouped._program_order(k) for k in (256, 512, 1024, 7168)] == [grouped.EXPERT_MAJOR] * 4


@pytest.mark.parametrize("order", ["ROW_TILE_MAJOR", "EXPERT_MAJOR"])
def test_other_program_orders_give_the_loops_forward_and_the_same_gradients(dev, monkeypatch, order):
    # 16-column tiles, so every launch has several column tiles (2-6), and every token routed to
    # expert 3, so that expert has two 16-row tiles: the orders really differ in which program
    # computes which tile (and the expert-major order's block arithmetic meets a many-tile expert)
    grouped = importlib.import_module("zmrl.batch_invariant.triton.grouped")
    monkeypatch.setattr(grouped, "_block_n", lambda n, base_n: 16)
    n = 24
    x, _, w, ad = _data(torch.bfloat16, dev, n=n)
    g = torch.Generator().manual_seed(5)
    others = torch.tensor([e for e in range(E) if e != 3])
    ids = torch.stack([torch.cat([torch.tensor([3]), others[torch.randperm(E - 1, generator=g)[:K - 1]]]).sort().values
                       for _ in range(n)]).to(dev)
    d_slot = randn(n, K, D, device=dev, seed=9)
    monkeypatch.setattr(grouped, "PROGRAM_ORDER", grouped.COLUMN_TILE_MAJOR)
    column_major = _train(x, ids, w, ad, d_slot)
    monkeypatch.setattr(grouped, "PROGRAM_ORDER", getattr(grouped, order))
    with torch.no_grad():
        out, looped = _slots(x, ids, w, ad), _slots(x, ids, w, ad, looped=True)
    assert torch.equal(out, looped), first_difference(out, looped)
    other = _train(x, ids, w, ad, d_slot)
    assert torch.equal(other[1], column_major[1]), first_difference(other[1], column_major[1])
    for name, grad in column_major[2].items():
        assert torch.equal(other[2][name], grad), name
