"""Helpers for invariance tests: bitwise comparison that reports the first difference."""
from __future__ import annotations

import contextlib

import torch

from tests.bitwise import assert_bitwise, first_difference  # noqa: F401  (re-exported)

BATCH_SIZES = (1, 2, 3, 7, 31, 32, 33, 63, 64, 65, 127, 128, 129, 200)  # both sides of several 32-row tile boundaries


def count_variant_rows(fn, x: torch.Tensor, sizes=BATCH_SIZES, seed: int = 0) -> int:
    """Run fn on many sub-batches of x (each size, several start offsets, shuffled
    companions) and count rows whose result differs from that row computed alone."""
    gen = torch.Generator().manual_seed(seed)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
    bad = 0
    for m in sizes:
        if m > x.shape[0]:
            continue
        for trial in range(3):
            rows = torch.randperm(x.shape[0], generator=gen)[:m] if trial else torch.arange(m)
            out = fn(x[rows])
            bad += int((out != alone[rows]).reshape(m, -1).any(-1).sum())
    return bad


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with exactly n torch threads (other conftests may have pinned 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op once an engine starts;
    # a thread test that silently ran with another count would prove nothing
    assert torch.get_num_threads() == n, f"could not set {n} torch threads (vLLM started first?)"
    try:
        yield
    finally:
        torch.set_num_threads(before)
