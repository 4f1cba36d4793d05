"""The grouped expert GEMMs' tile schedule (moe.Groups) from one Triton launch equals the schedule
written with torch ops (sort, cumulative sums, searchsorted), field by field, exactly: the
interpreter on a CPU, compiled on a GPU (the `dev` fixture)."""
import importlib
import types

import pytest
import torch
import triton

moe = importlib.import_module("zmrl.batch_invariant.triton.moe")


def _torch_schedule(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> dict:
    """The schedule as torch ops: rows grouped by expert, each expert's rows cut into block_m
    tiles, tile p -> (its expert, E past the last tile; its first row)."""
    n, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    end = torch.cumsum(counts, 0)
    start = end - counts
    tiles = (counts + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles, 0)
    max_tiles = max(1, triton.cdiv(n * k, block_m) + num_experts)
    p = torch.arange(max_tiles, device=flat.device)
    e = torch.searchsorted(tiles_end, p, right=True)
    e_safe = e.clamp(max=num_experts - 1)
    first_tile = tiles_end[e_safe] - tiles[e_safe]
    order = torch.argsort(flat, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(n * k, device=flat.device)
    return dict(order=order, src_rows=order // k, pos=pos, counts=counts, end=end,
                end32=end.to(torch.int32), tile_expert=e.to(torch.int32),
                tile_row=(start[e_safe] + (p - first_tile) * block_m).to(torch.int32))


def torch_groups(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> types.SimpleNamespace:
    """A stand-in for moe.Groups built by torch ops alone (for tests that replace Triton's launcher)."""
    fields = _torch_schedule(expert_ids, num_experts, block_m)
    return types.SimpleNamespace(**fields, max_tiles=fields["tile_expert"].numel(), num_real=num_experts,
                                 block_m=block_m)


def _ids(tokens: int, num_experts: int, top: int, seed: int, skew: bool = False) -> torch.Tensor:
    """Ascending distinct experts per token; skew: most tokens pick from the first few experts,
    so many experts get no row and a few get several tiles."""
    g = torch.Generator().manual_seed(seed)
    pool = min(num_experts, top + 2) if skew else num_experts
    rows = [torch.randperm(pool, generator=g)[:top].sort().values for _ in range(tokens)]
    return torch.stack(rows) if rows else torch.zeros(0, top, dtype=torch.int64)


CASES = [  # tokens, experts, top-k, block_m, skew
    (37, 8, 2, 16, False),
    (300, 65, 6, 64, True),
    (5, 1, 1, 64, False),  # the shared expert's one group
    (0, 4, 2, 16, False),  # no rows: every tile past the end
    (200, 897, 16, 128, True),  # K3.1's 896 experts and the sentinel of another host's slots
    (129, 64, 8, 64, False),
]


@pytest.mark.parametrize("tokens, experts, top, block_m, skew", CASES)
def test_the_schedule_kernel_equals_the_torch_schedule(dev, tokens, experts, top, block_m, skew):
    ids = _ids(tokens, experts, top, seed=tokens + experts, skew=skew).to(dev)
    groups = moe.Groups(ids, experts, block_m)
    want = _torch_schedule(ids, experts, block_m)
    assert groups.max_tiles == want["tile_expert"].numel()
    for name, value in want.items():
        got = getattr(groups, name)
        assert got.dtype == value.dtype and torch.equal(got, value), name


def test_negative_control_another_tile_height_is_another_schedule(dev):
    ids = _ids(300, 65, 6, seed=1, skew=True).to(dev)
    groups = moe.Groups(ids, 65, 64)
    other = _torch_schedule(ids, 65, 32)
    assert not torch.equal(groups.tile_row[:50], other["tile_row"][:50])


def test_too_many_rows_for_int32_are_refused():
    class _Huge:
        shape = (1 << 27, 16)

    with pytest.raises(ValueError, match=r"134217728 tokens x 16 slots: .* int32"):
        moe.Groups(_Huge(), 8, 64)
