"""The canonical cross-rank reductions give the same bits on 1, 2 and 4 ranks; an ordinary all-reduce does not.

Each property runs the same computation on one process (Shards LOCAL: every leaf) and on a group of
2 or 4 processes (gloo on CPU; NCCL on as many GPUs, and gloo with two ranks sharing one GPU, marker
`gpu`), each rank holding its leaves,
and compares with torch.equal: a row-parallel GEMM (forward and both gradients), a column-parallel
GEMM with LoRA (forward and the input's and A's gradients), and a fan-out's tree-summed gradient.
The negative control, in the same runs, is the row-parallel GEMM under ordinary_all_reduce(): one
local GEMM per rank, then torch.distributed.all_reduce, which is not bitwise the one-process sum.
"""
from __future__ import annotations

import pytest
import torch

from tests.bitwise import assert_bitwise
from tests.ranks import run_ranks
from zmrl.batch_invariant.collectives import LOCAL, Shards, column_linear, fan_out, num_leaves, \
    ordinary_all_reduce, row_linear, tree_sum

T, IN, OUT, R = 37, 256, 96, 4


def _inputs(device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    t = {"x_row": torch.randn(T, IN, generator=gen), "w_row": torch.randn(OUT, IN, generator=gen),
         "x_col": torch.randn(T, IN, generator=gen), "w_col": torch.randn(OUT, IN, generator=gen),
         "a": torch.randn(R, IN, generator=gen) * 0.1, "b": torch.randn(OUT, R, generator=gen) * 0.1,
         "g": torch.randn(T, OUT, generator=gen)}
    return {k: v.to(device) for k, v in t.items()}


def _shard(t: torch.Tensor, shards: Shards, dim: int) -> torch.Tensor:
    return t.chunk(shards.size, dim)[shards.rank].contiguous()


def compute(shards: Shards, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor whole on every rank (gathered back where a rank holds a piece)."""
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    t = _inputs(device)
    out = {}
    # row-parallel: this rank's input columns
    x = _shard(t["x_row"], shards, 1).requires_grad_()
    w = _shard(t["w_row"], shards, 1).requires_grad_()
    y = row_linear(x, w, num_leaves(IN), shards)
    (y * t["g"]).sum().backward()
    out["row"], out["row_grad_x"], out["row_grad_w"] = y.detach(), x.grad, w.grad
    with ordinary_all_reduce():  # the negative control: one GEMM per rank, then all_reduce
        out["row_ordinary"] = row_linear(x.detach(), w.detach(), num_leaves(IN), shards)
    # column-parallel with LoRA: this rank's output rows of W and B, whole x and A
    x = t["x_col"].clone().requires_grad_()
    a = t["a"].clone().requires_grad_()
    y = column_linear(x, _shard(t["w_col"], shards, 0), num_leaves(OUT), shards,
                      (a, _shard(t["b"], shards, 0)), 2.0)
    (y * _shard(t["g"], shards, 1)).sum().backward()
    out["col"], out["col_grad_x"], out["col_grad_a"] = y.detach(), x.grad, a.grad
    # a fan-out: leaf i's gradient is (i + 1) * g[:, :IN // 8]-shaped noise
    z = t["x_col"][:, :OUT].clone().requires_grad_()
    copies = fan_out(z, 8, shards)
    leaves = shards.local(8)
    sum(((c * t["g"]) * (i + 1.37)).sum() for i, c in zip(leaves, copies)).backward()
    out["fan_out_grad"] = z.grad
    return {k: v.cpu() for k, v in out.items()}


def _gather_pieces(results: list[dict]) -> dict[str, torch.Tensor]:
    """Rank pieces -> whole tensors (x and w of the row-parallel GEMM, the column outputs)."""
    first = dict(results[0])
    first["row_grad_x"] = torch.cat([r["row_grad_x"] for r in results], 1)
    first["row_grad_w"] = torch.cat([r["row_grad_w"] for r in results], 1)
    first["col"] = torch.cat([r["col"] for r in results], 1)
    for r in results[1:]:  # every rank holds the whole of these
        for k in ("row", "row_ordinary", "col_grad_x", "col_grad_a", "fan_out_grad"):
            assert_bitwise(r[k], first[k], f"rank disagreement on {k}")
    return first


def _check_equal(world: int, backend: str, device: str) -> None:
    one = compute(LOCAL, device)
    many = _gather_pieces(run_ranks(compute, world, (device,), backend))
    for k in one:
        if k != "row_ordinary":
            assert_bitwise(many[k], one[k], f"{k}: {world} ranks vs one")
    # the negative control: an ordinary all-reduce of the ranks' GEMMs is not the one-process sum
    assert not torch.equal(many["row_ordinary"], one["row"]), "an ordinary all-reduce happened to match the tree"


def test_tree_sum_is_the_balanced_tree():
    parts = [torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0)]
    # ((1e8 + 1) + (-1e8 + 1)) = 1e8 + -1e8 (the +1s are lost to rounding) = 0; left to right gives 1
    assert tree_sum(parts).item() == 0.0
    assert (((parts[0] + parts[1]) + parts[2]) + parts[3]).item() == 1.0
    with pytest.raises(ValueError, match="power-of-two"):
        tree_sum(parts[:3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reduce_across_adds_the_same_pairs_as_one_add_per_pair(dtype):
    """reduce_across stacks the leaves into fp32 and adds rows 2i, 2i + 1 per level: the bits of
    ((l0 + l1) + (l2 + l3)) + ... written out one add at a time."""
    from zmrl.batch_invariant.collectives import reduce_across

    gen = torch.Generator().manual_seed(0)
    # magnitudes 16^i: the fp32 sums round (eight bf16 values of one magnitude would add exactly)
    parts = [(torch.randn(37, 19, generator=gen) * 16.0 ** i).to(dtype) for i in range(8)]
    f = [p.float() for p in parts]
    by_hand = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]))
    assert_bitwise(reduce_across(parts, LOCAL), by_hand.to(dtype), "stacked tree")
    left_to_right = f[0]
    for x in f[1:]:
        left_to_right = left_to_right + x
    # the control: the same fp32 sum in another order has other bits (so the order above is what matched)
    assert not torch.equal(left_to_right, by_hand), "the control order happened to match the tree"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_column_linear_lora_is_each_leafs_own_delta(dtype, device):
    """column_linear scales and adds the LoRA delta over all leaves at once; each leaf's columns
    must be that leaf's own base GEMM + (its B GEMM) * scale, as bits, with B's gradient alike."""
    from zmrl.batch_invariant import linear

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=gen).to(device, dtype)
    w = torch.randn(96, 64, generator=gen).to(device, dtype)
    a = (torch.randn(8, 64, generator=gen) * 0.1).to(device, dtype)
    b = (torch.randn(96, 8, generator=gen) * 0.1).to(device, dtype).requires_grad_()
    probe = torch.randn(37, 96, generator=gen).to(device, dtype)
    y = column_linear(x, w, 8, lora=(a, b), scale=0.37)
    (grad_b,) = torch.autograd.grad((y.float() * probe.float()).sum(), b)
    b_leaves = [bl.detach().requires_grad_() for bl in b.chunk(8, 0)]
    h = linear(x, a)
    per_leaf = [linear(x, wl) + linear(h, bl) * 0.37 for wl, bl in zip(w.chunk(8, 0), b_leaves)]
    grads = torch.autograd.grad((torch.cat(per_leaf, -1).float() * probe.float()).sum(), b_leaves)
    assert_bitwise(y, torch.cat(per_leaf, -1).detach(), "output")
    assert_bitwise(grad_b, torch.cat(grads, 0), "B's gradient")


@pytest.mark.parametrize("world", [2, 4])
def test_canonical_reductions_equal_single_process_gloo(world):
    _check_equal(world, "gloo", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_canonical_reductions_equal_single_process_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    _check_equal(world, "nccl", "cuda")


@pytest.mark.gpu
def test_canonical_reductions_equal_single_process_two_ranks_on_one_gpu():
    # NCCL refuses two ranks on one device; gloo takes CUDA tensors through host memory
    _check_equal(2, "gloo", "cuda")


def test_leaves_and_shards_refuse_a_tp_that_does_not_divide():
    assert [num_leaves(n) for n in (4, 12, 96, 7)] == [4, 4, 8, 1]
    with pytest.raises(ValueError, match="cannot be split over 8 ranks"):
        Shards(8, 0).local(num_leaves(4))
