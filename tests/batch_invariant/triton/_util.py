"""Shared by the Triton kernel tests: seeded data, row-invariance checks, error reporting."""
from __future__ import annotations

import torch

from tests.batch_invariant.invariance import first_difference


def randn(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def poisoned(*shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def variant_rows(fn, pool: torch.Tensor, sizes, trials: int = 2, seed: int = 0) -> list[str]:
    """Every row of `pool` is first computed alone; then batches of each size are drawn from
    the pool at random (repeats allowed, so a row meets random companions at every
    position) and every row of every batch is compared with its result alone.
    Returns one line per differing row (empty when invariant)."""
    gen = torch.Generator().manual_seed(seed)
    alone = torch.cat([fn(pool[i:i + 1]) for i in range(pool.shape[0])])
    bad = []
    for m in sizes:
        for _ in range(trials):
            pick = torch.randint(0, pool.shape[0], (m,), generator=gen).to(pool.device)
            out = fn(pool[pick])
            want = alone[pick]
            for pos in range(m):
                if not torch.equal(out[pos], want[pos]):
                    bad.append(f"M={m} pos={pos}: {first_difference(out[pos], want[pos])}")
    return bad


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.detach().double().cpu(), ref.detach().double().cpu()
    return float((g - r).norm() / r.norm().clamp_min(1e-30))
