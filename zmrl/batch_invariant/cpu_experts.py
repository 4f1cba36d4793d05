"""CPU routed experts in one GEMM call per weight (gate, up, down) where every expert fits a tile.

A decode step sends a few rows to each expert. Through one `linear` call per expert and weight, a
tiny model's MoE layer makes 3 x E GEMM calls, and their Python costs more than their arithmetic
(hidden 128: ~20 us a call around a ~5 us GEMM). When no expert has more than TILE rows, each
expert's rows fit one [TILE, K] tile: the rows, sorted by expert, are scattered into a zero-padded
[E, TILE, K] block (expert e's rows first in entry e) and multiplied by all the experts' weights in
one fp32 `bmm` whose B is w.transpose(1, 2), each entry laid out as w[e].t(), the per-expert
call's B.

A row must keep the bits of its per-expert call (the trainer's autograd path runs that loop). That
a batched bmm gives entry e the bits of the same rows in a call of their own is, like every tile
property of cpu_gemm.py, a fact about one CPU, BLAS build and thread count, not a promise: it is
checked once per (experts, N, K, weight strides, GEMM mode, threads) against `cpu_gemm.mm`, the
per-expert call itself, on random weights and probe rows (every expert at several row counts and tile positions,
experts without rows among them). Where it fails, or where the per-expert call takes another route
(the exact GEMM), the loop runs.

Only fp32 and small weight sets are grouped. Every expert's weight is read whether or not it got a
row: free while they sit in cache (the tiny preset: 8 experts x 64 x 128), dearer than the calls it
saves when they do not (the small preset, 64 x 256 x 1024 at 8 tokens: 17.9 ms grouped against
14.7 ms per expert on a 2-core AMD EPYC). A bf16 batched bmm leaves oneDNN's per-tile kernels
(_tiles.py), so bf16 keeps the loop.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import torch

from zmrl.batch_invariant import cpu_gemm
from zmrl.batch_invariant._tiles import SMALL_ROW_TILE

TILE = SMALL_ROW_TILE  # rows per expert entry: a decode step of up to TILE tokens always fits
MAX_WEIGHT_BYTES = 4 << 20  # one weight of all experts (E x N x K): grouped up to this size


@dataclasses.dataclass(frozen=True)
class GroupedDecision:
    """Whether one weight shape's experts run as one bmm in this process, and why."""
    experts: int
    n: int
    k: int
    strides: tuple[int, int, int]
    mode: str
    threads: int
    grouped: bool
    reason: str
    seconds: float


_DECISIONS: dict[tuple, GroupedDecision] = {}
_LOCK = threading.Lock()


def decisions() -> list[dict]:
    with _LOCK:
        return [dataclasses.asdict(d) for d in _DECISIONS.values()]


def forget() -> None:
    with _LOCK:
        _DECISIONS.clear()


def bmm_experts(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [E, TILE, K] x each w[e] [N, K] transposed -> [E, TILE, N], one bmm (out=: see _tiles.py)."""
    out = a.new_empty(a.shape[0], a.shape[1], w.shape[1])
    return torch.bmm(a, w.transpose(1, 2), out=out)


def check_grouped(gemm, experts: int, n: int, k: int,
                  strides: tuple[int, int, int] | None = None) -> tuple[bool, str]:
    """`gemm(a [E, TILE, K], w [E, N, K])` against the per-expert calls `cpu_gemm.mm(rows, w[e].t())`,
    bit for bit, on random weights laid out with `strides` (the real weight's: a BLAS may pick its
    kernel by the layout; default contiguous) -> (equal?, what was compared or what differed)."""
    g = torch.Generator().manual_seed(0x5EED)
    strides = strides or (n * k, k, 1)
    storage = 1 + sum((size - 1) * stride for size, stride in zip((experts, n, k), strides))
    w = (torch.randn(storage, generator=g) * k ** -0.5).as_strided((experts, n, k), strides)
    x = cpu_gemm.probe_rows(experts * TILE + 1, k, torch.float32)
    # (expert, first probe row, rows): every entry full; row counts 1..TILE from shifted rows; one
    # expert alone with one row, the rest of the block zero
    patterns = [[(e, e * TILE, TILE) for e in range(experts)],
                [(e, e * TILE + 1, 1 + e % TILE) for e in range(experts)],
                [(experts - 1, 0, 1)]]
    compared = 0
    for pattern in patterns:
        a = x.new_zeros(experts, TILE, k)
        for e, first, rows in pattern:
            a[e, :rows] = x[first:first + rows]
        got = gemm(a, w)
        for e, first, rows in pattern:
            want = cpu_gemm.mm(x[first:first + rows], w[e].t())
            if not torch.equal(got[e, :rows], want):
                return False, (f"expert {e}'s {rows} rows in one bmm over {experts} experts differ from the same rows "
                               "in a call of their own")
            compared += rows
    return True, f"{compared} probe rows over {len(patterns)} bmm calls equal the per-expert calls bit for bit"


def _decide(w: torch.Tensor) -> GroupedDecision:
    experts, n, k = w.shape
    key = (experts, n, k, w.stride(), cpu_gemm.gemm_mode(), torch.get_num_threads())
    dec = _DECISIONS.get(key)
    if dec is not None:
        return dec
    # checked outside the lock (the check takes cpu_gemm's, whose reset_decisions takes this one);
    # two threads may both check a new shape, and the first decision stays
    t0 = time.perf_counter()
    ok, reason = check_grouped(bmm_experts, experts, n, k, w.stride())
    dec = GroupedDecision(experts, n, k, w.stride(), key[4], key[5], ok, reason, time.perf_counter() - t0)
    with _LOCK:
        return _DECISIONS.setdefault(key, dec)


class ExpertTiles:
    """The [E, TILE, K] layout of one call's rows, sorted by expert (see the module docstring)."""

    __slots__ = ("pos", "slots")

    def __init__(self, pos: torch.Tensor, slots: int):
        self.pos, self.slots = pos, slots

    @classmethod
    def fit(cls, counts: list[int], sorted_experts: torch.Tensor, x: torch.Tensor,
            *weights: torch.Tensor) -> ExpertTiles | None:
        """The layout for rows of x sorted by expert (`sorted_experts`: each row's expert, ascending;
        `counts`: rows per expert), or None where the per-expert loop must run: no rows, an expert
        with more than TILE rows, x or a weight not fp32 on the CPU, a weight too large to group, or
        one whose check (for its shape and layout) failed."""
        if not 0 < max(counts, default=0) <= TILE:
            return None
        for t in (x, *weights):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                return None
        if any(w.numel() * 4 > MAX_WEIGHT_BYTES for w in weights):
            return None
        if not all(_decide(w).grouped for w in {(w.shape, w.stride()): w for w in weights}.values()):
            return None
        starts = torch.tensor([0, *counts[:-1]]).cumsum(0)
        pos = sorted_experts * TILE + (torch.arange(sorted_experts.numel()) - starts[sorted_experts])
        return cls(pos, len(counts) * TILE)

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [P, K] (sorted by expert) -> [E, TILE, K], each expert's rows first, zeros after."""
        block = rows.new_zeros(self.slots, rows.shape[1])
        block[self.pos] = rows
        return block.view(-1, TILE, rows.shape[1])

    def gather(self, block: torch.Tensor) -> torch.Tensor:
        """[E, TILE, N] -> the rows' [P, N], in the sorted order."""
        return block.reshape(self.slots, block.shape[-1])[self.pos]
