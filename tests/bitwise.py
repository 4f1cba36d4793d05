"""Bitwise comparison for tests: equality that reports the first difference when it fails."""
from __future__ import annotations

import torch


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a != b) & ~(torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a != b
    where = diff.nonzero()
    if not len(where):
        return "equal"
    idx = tuple(where[0].tolist())
    return f"{int(diff.sum())} elements differ; first at {idx}: {a[idx].item()!r} vs {b[idx].item()!r}"


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert torch.equal(a, b), f"{what}: not bitwise equal: {first_difference(a, b)}"


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """t's raw bits as integers: torch.equal calls -0.0 and +0.0 equal, these do not."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])
