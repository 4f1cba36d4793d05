"""The sequence-tiled key kernel's selection bitmap (sparse_mla_backward.selection_bits) from one
Triton launch on a zeroed bitmap equals the bitmap written with torch ops (a scatter-add of distinct
bits), word for word, exactly: the interpreter on a CPU, compiled on a GPU. Packed selections of
several sequences, k not a power of two, empty rows, keys on word edges and on the sign bit, lengths
on and off multiples of 64; a first_row off by one gives another bitmap (the comparison can fail)."""
import importlib

import pytest
import torch

bw = importlib.import_module("zmrl.batch_invariant.triton.sparse_mla_backward")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
WORD = 64


def _composed_bits(indices: torch.Tensor, first_row: torch.Tensor, max_len: int) -> torch.Tensor:
    """The bitmap as torch ops: each selection's word and bit, empty slots sent to a spare column
    that is cut off, bits added per word (distinct keys: the sum is their OR, no carry)."""
    words = -(-max_len // WORD)
    rel = indices - first_row[:, None]
    picked = indices >= 0
    column = torch.where(picked, torch.div(rel, WORD, rounding_mode="floor"), words).clamp(0, words)
    bit = torch.where(picked, torch.ones_like(rel) << rel.remainder(WORD), 0)
    bits = torch.zeros(indices.shape[0], words + 1, dtype=torch.int64, device=indices.device)
    return bits.scatter_add_(1, column, bit)[:, :words]


def _first_rows(lengths) -> torch.Tensor:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return torch.tensor([s for s, n in zip(starts, lengths) for _ in range(n)], dtype=torch.int64)


def _selection(lengths, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Packed sequences of these lengths; each row picks up to k distinct positions of its own sequence
    (ascending, -1 padded after them; some rows pick none, some fill all k slots when they can)."""
    g = torch.Generator().manual_seed(seed)
    first = _first_rows(lengths)
    rows = []
    for start, n in zip(first.tolist(), [n for n in lengths for _ in range(n)]):
        count = int(torch.randint(0, min(k, n) + 1, (1,), generator=g))
        picked = (torch.randperm(n, generator=g)[:count].sort().values + start).tolist()
        rows.append(picked + [-1] * (k - count))
    idx = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), k)
    return idx.to(DEV), first.to(DEV), max(lengths, default=0)


def _check(idx: torch.Tensor, first: torch.Tensor, max_len: int) -> torch.Tensor:
    got = bw.selection_bits(idx, first, max_len)
    want = _composed_bits(idx, first, max_len)
    assert got.dtype == torch.int64 and got.shape == want.shape == (idx.shape[0], -(-max_len // WORD))
    assert torch.equal(got, want), (got ^ want).nonzero()[:8].tolist()
    return got


LENGTHS = [  # max_len 1, 63, 64 (a multiple of 64), 65, 128, 200
    [1, 1, 1],
    [63, 7, 1],
    [3, 64, 20],
    [65, 2],
    [128, 5, 64],
    [17, 200, 130, 1],
]


@pytest.mark.parametrize("k", [1, 5, 64])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda n: "-".join(map(str, n)))
def test_bitmap_equals_the_torch_formulation(lengths, k):
    _check(*_selection(lengths, k, seed=len(lengths) * 100 + k))


def test_more_slots_than_one_step():
    """k = 300: more slots than one program's step (up to 256 under the interpreter, 1024 compiled)."""
    _check(*_selection([320, 9, 301], 300, seed=11))


@pytest.mark.parametrize("block_t,block_k", [(1, 1), (4, 2), (8, 64)])
def test_any_blocking_gives_the_same_bitmap(monkeypatch, block_t, block_k):
    """Rows and slots cut into other blocks (a program's rows past T, a row's slots in several steps,
    a step past k): the same words."""
    monkeypatch.setattr(bw, "_bits_config", lambda k: dict(BLOCK_T=block_t, BLOCK_K=block_k))
    _check(*_selection([70, 13, 128], 5, seed=5))


def test_word_edges_and_the_sign_bit():
    """Keys 63 (the sign bit of word 0), 64 and 127 (first and sign bit of word 1), in a second
    sequence so the positions are relative to its own first row; max_len 130 is not a multiple of 64."""
    lengths = [3, 130]
    first = _first_rows(lengths)
    idx = torch.full((sum(lengths), 5), -1, dtype=torch.int64)
    idx[3, :5] = torch.tensor([0, 63, 64, 127, 129]) + 3
    idx[4, :2] = torch.tensor([63, 127]) + 3
    idx[0, 0] = 0
    got = _check(idx.to(DEV), first.to(DEV), max(lengths)).cpu()
    sign = -(1 << 63)
    assert got[3].tolist() == [1 | sign, 1 | sign, 2]
    assert got[4].tolist() == [sign, sign, 0]
    assert got[0].tolist() == [1, 0, 0]
    assert not got[5:].any()  # rows of -1 only


def test_rows_of_empty_slots_and_empty_shapes():
    first = _first_rows([4, 9]).to(DEV)
    _check(torch.full((13, 3), -1, dtype=torch.int64, device=DEV), first, 9)  # nothing selected
    _check(torch.zeros(0, 5, dtype=torch.int64, device=DEV), first[:0], 70)  # T = 0
    _check(torch.full((13, 0), -1, dtype=torch.int64, device=DEV), first, 9)  # k = 0


def test_strided_indices():
    idx, first, max_len = _selection([70, 33, 128], 5, seed=7)
    column_major = idx.t().contiguous().t()  # strides (1, T)
    assert column_major.stride() == (1, idx.shape[0])
    assert torch.equal(bw.selection_bits(column_major, first, max_len), _composed_bits(idx, first, max_len))


def test_a_first_row_off_by_one_gives_another_bitmap():
    """Negative control: shifting every row's sequence start by one moves each bit, so the
    comparison that the tests above pass can fail."""
    idx, first, max_len = _selection([65, 40, 128], 5, seed=3)
    got = bw.selection_bits(idx, first - 1, max_len)
    assert not torch.equal(got, _composed_bits(idx, first, max_len))
    assert torch.equal(got, _composed_bits(idx, first - 1, max_len))  # both sides agree on the shifted input


def test_one_kernel_launch_and_one_torch_op(monkeypatch):
    """A call is the zeroed bitmap (the one torch op) and one launch of the kernel; T = 0 launches nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    launches = []
    monkeypatch.setattr(bw, "keyed", lambda kernel, name, **opts: lambda grid, args, consts: launches.append(
        (kernel, name, grid)))
    idx, first, max_len = _selection([65, 40], 5, seed=1)
    with Ops() as ops:
        bw.selection_bits(idx, first, max_len)
    assert ops.seen == ["aten.zeros.default"]
    assert [(k, n) for k, n, _ in launches] == [(bw._selection_bits_kernel, "selection_bits")]
    launches.clear()
    bw.selection_bits(idx[:0], first[:0], max_len)
    assert launches == []
