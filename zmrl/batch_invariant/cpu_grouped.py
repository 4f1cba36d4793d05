"""CPU GEMMs of a few rows against several weights in one `bmm`: the routed experts and a
projection's canonical leaves at decode sizes.

A decode step multiplies a handful of rows by many small weights, one `linear` call each: 3 x E
per MoE layer (an expert's gate, up and down), and one per canonical leaf of every column- and
row-parallel projection (collectives.py: 8 leaves, so that TP 1 and TP 8 compute the same GEMMs).
The tiny model's decode step made ~190 such calls, and their Python cost more than their
arithmetic (hidden 128: ~20 us a call around a ~5 us GEMM). Where every group's rows fit one
[TILE, K] tile, the rows are copied into a zero-padded [G, TILE, K] block (group g's rows first in
entry g) and multiplied by the G weights in one fp32 `bmm` whose B is w.transpose(1, 2) over a
[G, N, K] view of the weights, each entry laid out as the per-group call's B.

A row must keep the bits of its per-group call (the trainer's autograd path runs those calls).
That a batched bmm gives entry g the bits of the same rows in a call of their own is, like every
tile property of cpu_gemm.py, a fact about one CPU, BLAS build and thread count, not a promise: it
is checked once per (groups, N, K, weight strides, GEMM mode, threads) against `cpu_gemm.mm`, the
per-group call itself, on random weights in the real layout and probe rows (every row count 1 ...
TILE, several tile positions, an entry alone among zero entries). Where it fails, or where the
per-group call takes another route (the exact GEMM), the calls run one by one.

fp32 only: a bf16 batched bmm leaves oneDNN's per-tile kernels (_tiles.py). Experts are grouped
only while all E weights of a kind are small: every expert's weight is read whether or not it got
a row, free while they sit in cache (the tiny preset: 8 experts x 64 x 128), dearer than the calls
it saves when they do not (the small preset, 64 x 256 x 1024 at 8 tokens: 17.9 ms grouped against
14.7 ms per expert on a 2-core AMD EPYC). Leaves have no such waste: every leaf is needed.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import torch

from zmrl.batch_invariant import cpu_gemm
from zmrl.batch_invariant._paths import path_for, records_graph
from zmrl.batch_invariant._tiles import SMALL_ROW_TILE

TILE = SMALL_ROW_TILE  # rows per entry: a decode step of up to TILE tokens always fits
MAX_EXPERT_WEIGHT_BYTES = 4 << 20  # one weight of all experts (E x N x K): grouped up to this size


@dataclasses.dataclass(frozen=True)
class GroupedDecision:
    """Whether the GEMMs of one [G, N, K] weight view run as one bmm in this process, and why."""
    groups: int
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


def bmm_grouped(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [G, TILE, K] x each w[g] [N, K] transposed -> [G, TILE, N], one bmm (out=: see _tiles.py)."""
    out = a.new_empty(a.shape[0], a.shape[1], w.shape[1])
    return torch.bmm(a, w.transpose(1, 2), out=out)


def check_grouped(gemm, groups: int, n: int, k: int,
                  strides: tuple[int, int, int] | None = None) -> tuple[bool, str]:
    """`gemm(a [G, TILE, K], w [G, N, K])` against the per-group calls `cpu_gemm.mm(rows, w[g].t())`,
    bit for bit, on random weights laid out with `strides` (the real weights': a BLAS may pick its
    kernel by the layout; default contiguous) -> (equal?, what was compared or what differed)."""
    g = torch.Generator().manual_seed(0x5EED)
    strides = strides or (n * k, k, 1)
    storage = 1 + sum((size - 1) * stride for size, stride in zip((groups, n, k), strides))
    w = (torch.randn(storage, generator=g) * k ** -0.5).as_strided((groups, n, k), strides)
    x = cpu_gemm.probe_rows(groups * TILE + 1, k, torch.float32)
    # (entry, first probe row, rows): every entry with 1 ... TILE rows, taken from alternately
    # shifted probe rows; then one entry alone with one row, every other entry zero
    patterns = [[(e, e * TILE + rows % 2, rows) for e in range(groups)] for rows in range(1, TILE + 1)]
    patterns.append([(groups - 1, 0, 1)])
    compared = 0
    for pattern in patterns:
        a = x.new_zeros(groups, TILE, k)
        for e, first, rows in pattern:
            a[e, :rows] = x[first:first + rows]
        got = gemm(a, w)
        for e, first, rows in pattern:
            want = cpu_gemm.mm(x[first:first + rows], w[e].t())
            if not torch.equal(got[e, :rows], want):
                return False, (f"entry {e}'s {rows} rows in one bmm over {groups} weights differ from the same rows "
                               "in a call of their own")
            compared += rows
    return True, f"{compared} probe rows over {len(patterns)} bmm calls equal the per-group calls bit for bit"


def grouped_ok(w: torch.Tensor) -> bool:
    """Whether one bmm over the [G, N, K] weight view w gives each entry its per-group call's bits
    here (decided once per shape, layout, GEMM mode and thread count)."""
    groups, n, k = w.shape
    key = (groups, n, k, w.stride(), cpu_gemm.gemm_mode(), torch.get_num_threads())
    dec = _DECISIONS.get(key)
    if dec is None:
        # checked outside the lock (the check takes cpu_gemm's, whose reset_decisions takes this
        # one); two threads may both check a new shape, and the first decision stays
        t0 = time.perf_counter()
        ok, reason = check_grouped(bmm_grouped, groups, n, k, w.stride())
        dec = GroupedDecision(groups, n, k, w.stride(), key[4], key[5], ok, reason, time.perf_counter() - t0)
        with _LOCK:
            dec = _DECISIONS.setdefault(key, dec)
    return dec.grouped


class ExpertTiles:
    """The [E, TILE, K] layout of one MoE call's rows, sorted by expert (see the module docstring)."""

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
        if any(w.numel() * 4 > MAX_EXPERT_WEIGHT_BYTES for w in weights):
            return None
        if not all(grouped_ok(w) for w in {(w.shape, w.stride()): w for w in weights}.values()):
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


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """[G, *shape] over equal views of one storage at evenly spaced offsets (a weight's chunks; one
    tensor or its aliases G times: offset step 0), without a copy; None where they are not."""
    first, last = parts[0], parts[-1]
    step = parts[1].storage_offset() - first.storage_offset()
    if step < 0 or last.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
        return None  # evenly spaced views of one storage lie between its first and last
    shape, stride, offset = first.shape, first.stride(), first.storage_offset()
    for g, p in enumerate(parts):
        if p.shape != shape or p.stride() != stride or p.storage_offset() != offset + g * step:
            return None
    return first.as_strided((len(parts), *shape), (step, *stride), offset)


def leaf_products(xs: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor | None:
    """linear(xs[g], weights[g]) for every g (xs [*, K] of one shape, weights [N, K] evenly spaced
    views of one tensor, as its chunks are) as one bmm -> [G, *, N], each product with its own
    call's bits; None where that does not apply (autograd records the calls, more than TILE rows,
    not fp32 on the CPU path, a failed check)."""
    first = xs[0]
    if len(xs) < 2 or path_for(first) != "cpu" or first.dtype != torch.float32 or first.device.type != "cpu":
        return None
    k = first.shape[-1]
    rows = first.numel() // k if k else 0
    if not 0 < rows <= TILE or records_graph(*xs, *weights):
        return None
    x, w = _stacked(xs), _stacked(weights)
    if x is None or w is None or w.dim() != 3 or w.dtype != torch.float32 or w.device.type != "cpu":
        return None
    if not grouped_ok(w):
        return None
    block = first.new_zeros(len(xs), TILE, k)
    block[:, :rows] = x.reshape(len(xs), rows, k)
    return bmm_grouped(block, w)[:, :rows].view(len(xs), *first.shape[:-1], w.shape[1])
