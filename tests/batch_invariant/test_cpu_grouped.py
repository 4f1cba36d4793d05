"""The CPU's grouped GEMMs: routed experts and canonical leaves in one bmm per weight where their rows fit a tile,
with the bits of one call per expert or leaf."""
import pytest
import torch

import zmrl.batch_invariant as bi
from tests.batch_invariant.invariance import assert_bitwise, torch_threads
from zmrl.batch_invariant import cpu_gemm, cpu_grouped, moe
from zmrl.batch_invariant.matmul import linear_leaves

E, D, I, K = 8, 64, 32, 2


def _weights(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(dtype)  # noqa: E731
    return mk(E, I, D), mk(E, I, D), mk(E, D, I)


def _ids(tokens: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K].sort().values for _ in range(tokens)])


def _x(tokens: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(tokens, D, generator=torch.Generator().manual_seed(2)).to(dtype)


@pytest.fixture
def bmm_calls(monkeypatch):
    """Counts the grouped GEMM's calls outside its own check."""
    calls = []
    real = cpu_grouped.bmm_grouped

    def counted(a, w):
        calls.append(tuple(w.shape))
        return real(a, w)

    monkeypatch.setattr(cpu_grouped, "bmm_grouped", counted)
    cpu_gemm.reset_decisions()
    yield calls
    cpu_gemm.reset_decisions()


def _reversed_k(a, w):
    """Variant on every machine: each row reduces K backwards."""
    return torch.bmm(a.flip(-1), w.flip(-1).transpose(1, 2))


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_grouped_experts_give_the_per_expert_bits(tokens, bmm_calls):
    w = _weights()
    x, ids = _x(tokens), _ids(tokens)
    grouped = moe._slot_outputs_sorted(x, ids, *w)  # the first call checks each weight shape once
    assert {(d["n"], d["k"], d["grouped"]) for d in cpu_grouped.decisions()} == {(I, D, True), (D, I, True)}
    bmm_calls.clear()
    assert_bitwise(moe._slot_outputs_sorted(x, ids, *w), grouped, "again")
    assert bmm_calls == [(E, I, D), (E, I, D), (E, D, I)]  # one bmm per weight, no per-expert call
    assert_bitwise(grouped, moe._slot_outputs_by_expert(x, ids, *w), f"{tokens} tokens vs the per-expert loop")


def test_the_models_fused_gate_up_halves_are_grouped_with_their_own_layout(bmm_calls):
    # the model passes gate and up as the halves of one [E, 2I, D] weight: strided views, checked as such
    gate, up, down = _weights()
    gate_up = torch.cat([gate, up], 1)
    halves = (gate_up[:, :I], gate_up[:, I:])
    x, ids = _x(6), _ids(6)
    got = moe._slot_outputs_sorted(x, ids, *halves, down)
    assert {d["strides"] for d in cpu_grouped.decisions() if d["grouped"]} == {(2 * I * D, D, 1), (D * I, I, 1)}
    assert (E, I, D) in bmm_calls
    assert_bitwise(got, moe._slot_outputs_by_expert(x, ids, gate, up, down), "fused halves vs the loop")


def test_a_variant_grouped_gemm_fails_its_check_and_the_loop_runs(monkeypatch):
    w = _weights()
    x, ids = _x(5), _ids(5)
    loop = moe._slot_outputs_by_expert(x, ids, *w)
    # negative control: the variant, were it used, changes the rows
    block = torch.zeros(E, cpu_grouped.TILE, D)
    block[:, :1] = x[:1]
    assert not torch.equal(_reversed_k(block, w[0]), cpu_grouped.bmm_grouped(block, w[0]))
    ok, detail = cpu_grouped.check_grouped(_reversed_k, E, I, D)
    assert not ok and "differ from the same rows in a call of their own" in detail
    monkeypatch.setattr(cpu_grouped, "bmm_grouped", _reversed_k)
    cpu_gemm.reset_decisions()
    assert_bitwise(moe._slot_outputs_sorted(x, ids, *w), loop, "after a failed check")
    assert {d["grouped"] for d in cpu_grouped.decisions()} == {False}
    cpu_gemm.reset_decisions()


def test_the_exact_gemm_keeps_the_loop(bmm_calls):
    # the per-expert call's route decides the bits: under the exact GEMM a BLAS bmm is not it
    w = _weights()
    x, ids = _x(4), _ids(4)
    with bi.use_cpu_gemm("exact"):
        got = moe._slot_outputs_sorted(x, ids, *w)
        assert_bitwise(got, moe._slot_outputs_by_expert(x, ids, *w), "exact")
    (dec, *_) = cpu_grouped.decisions()
    assert dec["mode"] == "exact" and not dec["grouped"], dec


@pytest.mark.parametrize("why", ["an expert past a tile", "bf16", "weights too large"])
def test_calls_outside_the_grouped_case_take_the_loop(why, bmm_calls, monkeypatch):
    dtype = torch.bfloat16 if why == "bf16" else torch.float32
    w = _weights(dtype)
    tokens = cpu_grouped.TILE + 1 if why == "an expert past a tile" else 4
    x = _x(tokens, dtype)
    ids = torch.tensor([[0, 1]] * tokens) if why == "an expert past a tile" else _ids(tokens)
    if why == "weights too large":
        monkeypatch.setattr(cpu_grouped, "MAX_EXPERT_WEIGHT_BYTES", E * I * D * 4 - 1)
    got = moe._slot_outputs_sorted(x, ids, *w)
    assert bmm_calls == [] and cpu_grouped.decisions() == []
    assert_bitwise(got, moe._slot_outputs_by_expert(x, ids, *w), why)
    # control: the same call inside the grouped case takes the bmm
    if why == "an expert past a tile":
        moe._slot_outputs_sorted(x[:cpu_grouped.TILE], ids[:cpu_grouped.TILE], *w)
        assert bmm_calls


def test_grouped_rows_are_batch_invariant_at_every_thread_count():
    # decode-sized batches (grouped) and a long one (the loop) give every token the same bits
    w = _weights()
    x = _x(40)
    ids = _ids(40)
    for threads in (1, 2):
        with torch_threads(threads):
            cpu_gemm.reset_decisions()
            full = moe._slot_outputs_sorted(x, ids, *w)  # 40 tokens: experts past a tile, the loop
            for start, n in ((0, 1), (7, 3), (20, 8), (33, 7)):
                assert_bitwise(moe._slot_outputs_sorted(x[start:start + n], ids[start:start + n], *w),
                               full[start:start + n], f"{n} tokens from {start}, {threads} threads")
            assert all(d["grouped"] for d in cpu_grouped.decisions())
    cpu_gemm.reset_decisions()


# ----------------------------------------------------------------------------- canonical leaves
LEAVES, N_LEAF, K_IN = 8, 24, 64


def _leaf_data(rows, dtype=torch.float32, lead=()):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*lead, rows, K_IN, generator=g).to(dtype)
    w = (torch.randn(LEAVES * N_LEAF, K_IN, generator=g) * K_IN ** -0.5).to(dtype)
    return x, w


def _per_leaf_columns(x, w):
    return torch.cat([bi.linear(x, wc) for wc in w.chunk(LEAVES, 0)], -1)


@pytest.mark.parametrize("rows,lead", [(1, ()), (5, ()), (8, ()), (3, (2,))])
def test_column_leaves_in_one_bmm_give_the_per_leaf_bits(rows, lead, bmm_calls):
    x, w = _leaf_data(rows, lead=lead)
    want = _per_leaf_columns(x, w)
    got = linear_leaves([x] * LEAVES, w)  # the first call checks the shape
    bmm_calls.clear()
    assert_bitwise(linear_leaves([x] * LEAVES, w), got, "again")
    assert bmm_calls == [(LEAVES, N_LEAF, K_IN)]  # one bmm for the eight leaves
    assert_bitwise(got, want, f"{rows} rows {lead}")


def test_row_leaves_in_one_bmm_give_the_per_leaf_bits(bmm_calls):
    from zmrl.batch_invariant import collectives

    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, LEAVES * 16, generator=g)
    w = torch.randn(40, LEAVES * 16, generator=g) * 0.1
    got = collectives.row_linear(x, w, LEAVES)
    assert bmm_calls and all(d["grouped"] for d in cpu_grouped.decisions())
    want = collectives.reduce_leaves([bi.linear(xc, wc) for xc, wc in zip(x.chunk(LEAVES, -1), w.chunk(LEAVES, 1))])
    assert_bitwise(got, want, "row leaves")


@pytest.mark.parametrize("why", ["past a tile", "autograd", "bf16", "two tensors"])
def test_leaves_outside_the_grouped_case_take_one_call_each(why, bmm_calls):
    x, w = _leaf_data(cpu_grouped.TILE + 1 if why == "past a tile" else 4,
                      torch.bfloat16 if why == "bf16" else torch.float32)
    if why == "autograd":
        w.requires_grad_()
    if why == "two tensors":  # leaves that are not chunks of one weight, or chunks out of order
        chunks = [c.clone() for c in w.chunk(LEAVES, 0)]
        assert cpu_grouped.leaf_products([x] * LEAVES, chunks) is None
        assert cpu_grouped.leaf_products([x] * LEAVES, list(reversed(w.chunk(LEAVES, 0)))) is None
        assert bmm_calls == []
        return
    got = linear_leaves([x] * LEAVES, w)
    assert bmm_calls == [] and cpu_grouped.decisions() == []
    assert_bitwise(got.detach(), _per_leaf_columns(x, w).detach(), why)
    if why == "autograd":
        got.square().sum().backward()
        assert w.grad is not None and w.grad.abs().sum() > 0


def test_a_variant_leaf_bmm_fails_its_check_and_the_leaves_run_one_by_one(monkeypatch):
    x, w = _leaf_data(4)
    want = _per_leaf_columns(x, w)
    block = torch.zeros(LEAVES, cpu_grouped.TILE, K_IN)
    block[:, :4] = x
    w3 = w.view(LEAVES, N_LEAF, K_IN)
    assert not torch.equal(_reversed_k(block, w3), cpu_grouped.bmm_grouped(block, w3))  # the variant is visible
    monkeypatch.setattr(cpu_grouped, "bmm_grouped", _reversed_k)
    cpu_gemm.reset_decisions()
    assert_bitwise(linear_leaves([x] * LEAVES, w), want, "after a failed check")
    assert [d["grouped"] for d in cpu_grouped.decisions()] == [False]
    cpu_gemm.reset_decisions()


def test_leaf_rows_are_batch_invariant_across_the_tile():
    # calls of up to a tile of rows (one bmm) and a long call (a GEMM per leaf) give every row the
    # same bits; control: through torch's own GEMM, rows alone differ from the same rows in the long call
    x, w = _leaf_data(40)
    cpu_gemm.reset_decisions()
    full = linear_leaves([x] * LEAVES, w)  # 40 rows: past the tile, one call per leaf
    assert cpu_grouped.decisions() == []
    for start, n in ((0, 1), (7, 3), (20, 8), (33, 7)):
        part = x[start:start + n]
        assert_bitwise(linear_leaves([part] * LEAVES, w), full[start:start + n], f"{n} rows from {start}")
    assert [d["grouped"] for d in cpu_grouped.decisions()] == [True]
    with bi.use_path("torch"):
        alone = torch.cat([linear_leaves([x[i:i + 1]] * LEAVES, w) for i in range(x.shape[0])])
        assert not torch.equal(alone, linear_leaves([x] * LEAVES, w))
    cpu_gemm.reset_decisions()
