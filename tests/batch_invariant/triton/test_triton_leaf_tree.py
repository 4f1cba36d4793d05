"""The canonical leaf tree in one launch (triton/leaf_tree.py): bit for bit the torch expression
in zmrl.batch_invariant.collectives (every leaf cast to fp32, rows 2i and 2i + 1 added level by
level, one cast), for 2, 4 and 8 leaves, fp32 and bf16 leaves, both output dtypes, sizes that end
inside a program; negative controls: the same leaves added left to right, or rounded to bf16 at
every level, give other bits on these data, so the comparison can fail."""
import pytest
import torch

import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant import collectives
from zmrl.batch_invariant._paths import use_path

from tests.bitwise import assert_bitwise
from tests.bitwise import bit_pattern as bits
from tests.batch_invariant.triton._util import randn

BF16 = torch.bfloat16


def leaves(count, shape, dtype, device, seed=0):
    """Leaves of very different magnitudes (as a gradient's per-head parts are): fp32 additions
    of them round, so the order of the additions shows in the bits."""
    return [randn(*shape, dtype=dtype, device=device, seed=seed + i, scale=10.0 ** (i % 4 - 1)) for i in range(count)]


def expression(parts, out_dtype):
    return collectives._fp32_tree(parts).to(out_dtype)


@pytest.mark.parametrize("count", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("shape", [(1,), (3, 333), (2100,)])  # 2100: two programs of 1024 and a partial one
def test_the_expressions_bits(dev, count, dtype, shape):
    parts = leaves(count, shape, dtype, dev)
    for out_dtype in {dtype, torch.float32}:
        got = tri.leaf_tree(parts, out_dtype)
        want = expression(parts, out_dtype)
        assert got.dtype == out_dtype and got.shape == want.shape
        assert_bitwise(bits(got), bits(want), f"{count} leaves {dtype} -> {out_dtype}")


def test_strided_leaves(dev):
    wide = leaves(8, (40, 96), BF16, dev)
    parts = [p[:, 16:80] for p in wide]  # views with a row pitch of 96
    assert_bitwise(bits(tri.leaf_tree(parts, BF16)), bits(expression(parts, BF16)), "strided leaves")


def test_negative_controls_differ(dev):
    parts = leaves(8, (2100,), torch.float32, dev)
    got = tri.leaf_tree(parts, torch.float32)
    sequential = parts[0].float()
    for p in parts[1:]:
        sequential = sequential + p.float()
    assert not torch.equal(bits(got), bits(sequential)), "left to right gave the tree's bits on these data"
    bf = [p.to(BF16) for p in parts]
    level = bf
    while len(level) > 1:  # rounded to bf16 after every level
        level = [(a.float() + b.float()).to(BF16) for a, b in zip(level[0::2], level[1::2])]
    assert not torch.equal(bits(tri.leaf_tree(bf, BF16)), bits(level[0])), "per-level rounding gave the same bits"


def test_reduce_across_on_the_triton_path_keeps_its_bits(dev):
    """collectives.reduce_across picks the kernel on the Triton path; the expression elsewhere."""
    parts = leaves(8, (5, 70), BF16, dev, seed=3)
    with use_path("triton"):
        got = collectives.reduce_across(parts, collectives.LOCAL)
    assert_bitwise(bits(got), bits(expression(parts, BF16)), "reduce_across")


def test_bad_leaf_counts_and_shapes_are_refused(dev):
    parts = leaves(4, (8,), BF16, dev)
    with pytest.raises(ValueError, match="adds 2, 4 or 8 leaves, got 3"):
        tri.leaf_tree(parts[:3], BF16)
    with pytest.raises(ValueError, match="first leaf's shape"):
        tri.leaf_tree([parts[0], parts[1][:4]], BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("count", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_gpu_model_sized_leaves(count, dtype):
    """A fan-out's gradient at the small preset's size: leaves of [7,400, 1,024]. (With two bf16
    leaves and a bf16 result the compiler emits one bf16 add: the fp32 sum of two bf16 values
    rounded to bf16 is their correctly rounded sum, so the bits are the same; this checks it.)"""
    parts = leaves(count, (7400, 1024), dtype, "cuda", seed=5)
    for out_dtype in {dtype, torch.float32}:
        got = tri.leaf_tree(parts, out_dtype)
        assert_bitwise(bits(got), bits(expression(parts, out_dtype)), f"{count} x [7400, 1024] {dtype} -> {out_dtype}")
