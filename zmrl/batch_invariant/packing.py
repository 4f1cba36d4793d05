"""Sequences packed end to end (cu_seqlens-style offsets), as every layer of one forward reads them.

A packed forward needs its offsets twice: as host ints (output shapes, the longest sequence,
argument checks) and as device tensors (which sequence a row belongs to, where that sequence
starts). Reading host ints back from a GPU tensor waits for the whole GPU queue, and deriving the
device tensors again in every layer costs launches and copies per layer. A `Packing` is built
once per forward from the host ints, where the offsets come from (the batch the trainer packs),
with one host-to-device copy of the B + 1 offsets (the per-row tensors derived on the device), and
handed down to every layer:

    packing = Packing.from_bounds([0, 5, 12], device)     # two sequences of 5 and 7 rows
    packing.bounds        (0, 5, 12)                      # host ints
    packing.cu_seqlens    [0, 5, 12]                      # int64 on the device
    packing.local         [0 1 2 3 4 0 1 2 3 4 5 6]       # row within its sequence
    packing.first_row     [0 0 0 0 0 5 5 5 5 5 5 5]       # packed row where its sequence starts
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True, eq=False)
class Packing:
    bounds: tuple[int, ...]
    """cu_seqlens as host ints [B + 1], rising from 0 to the number of packed rows T."""
    cu_seqlens: torch.Tensor
    """[B + 1] int64 on the device."""
    seq: torch.Tensor
    """[T] int64 on the device: the sequence of each row."""
    local: torch.Tensor
    """[T] int64 on the device: each row's index within its sequence (a fresh sequence's position)."""
    first_row: torch.Tensor
    """[T] int64 on the device: the packed row of the first token of each row's sequence."""
    width: int | None = None
    """The longest sequence the kernels plan for (their grids, the indexer's score columns), or
    None: the longest sequence held. A wider one gives the same bits (a row never reads past its
    own sequence); a CUDA graph fixes it, so that packings refilled with other lengths replay.
    With a width set, what a kernel would derive from the host bounds is derived on the device
    from `cu_seqlens` instead (the sparse-MLA backward's key tiles)."""

    @property
    def num_rows(self) -> int:
        return self.bounds[-1]

    @property
    def num_seqs(self) -> int:
        return len(self.bounds) - 1

    @property
    def max_len(self) -> int:
        return longest_run(self.bounds) if self.width is None else self.width

    def refill(self, bounds: Sequence[int]) -> None:
        """Hold other sequences of the same count, rows and width: the device tensors rewritten in
        place (a graph that reads them sees the new packing), the host ints replaced."""
        bounds = _checked(bounds)
        if len(bounds) != len(self.bounds) or bounds[-1] != self.bounds[-1]:
            raise ValueError(f"a refill keeps {self.num_seqs} sequences of {self.num_rows} rows in all, got "
                             f"{len(bounds) - 1} of {bounds[-1]}")
        if self.width is not None and longest_run(bounds) > self.width:
            raise ValueError(f"a refill's sequences must fit the packing's width {self.width}, got {list(bounds)}")
        cu = _to_device(bounds, self.cu_seqlens.device)
        self.cu_seqlens.copy_(cu)
        for dst, src in zip((self.seq, self.local, self.first_row), _row_tensors(self.cu_seqlens, bounds[-1])):
            dst.copy_(src)
        object.__setattr__(self, "bounds", bounds)

    def vouch(self, indices: torch.Tensor) -> torch.Tensor:
        """Record that `indices` [T, k] is this packing's DSA selection by zmrl's own indexer and
        top-k (zmrl.model.attention.select_tokens_packed): each row's entries lie in its own
        sequence at or before the row, strictly ascending, -1 padded after them. Sparse MLA then
        skips the value checks of exactly those properties for this tensor (a dozen launches per
        layer) while it is unmodified: an in-place change bumps its version and voids the mark.
        An inference-mode tensor has no version counter, so it is not marked (and stays checked).
        -> indices."""
        if not indices.is_inference():
            indices._zmrl_vouched = (self, indices._version)
        return indices

    def vouches_for(self, indices: torch.Tensor) -> bool:
        """Whether `vouch` marked this very tensor, for this packing, and it has not changed since."""
        mark = getattr(indices, "_zmrl_vouched", None)
        return mark is not None and mark[0] is self and mark[1] == indices._version

    @staticmethod
    def from_bounds(bounds: Sequence[int], device: torch.device | str, width: int | None = None) -> "Packing":
        """cu_seqlens as host ints [B + 1] -> the Packing on `device` (one small host-to-device copy).
        width: see `Packing.width` (at least the longest sequence)."""
        bounds = _checked(bounds)
        longest = longest_run(bounds)
        if width is not None and width < longest:
            raise ValueError(f"width={width} is narrower than the longest sequence ({longest} rows)")
        cu = _to_device(bounds, torch.device(device))
        seq, local, first_row = _row_tensors(cu, bounds[-1])
        return Packing(bounds, cu, seq, local, first_row, width)

    @staticmethod
    def of(cu_seqlens: "torch.Tensor | Packing", device: torch.device | str) -> "Packing":
        """A Packing as given, or built from a cu_seqlens tensor: free from a CPU tensor; a GPU
        tensor's offsets cost one host sync, so a caller that calls per layer should build the
        Packing once and pass it."""
        if isinstance(cu_seqlens, Packing):
            have, want = cu_seqlens.cu_seqlens.device, torch.device(device)
            if have.type != want.type or (want.index is not None and have.index != want.index):
                raise ValueError(f"the packing lives on {cu_seqlens.cu_seqlens.device}, its rows on {device}")
            return cu_seqlens
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            shape = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
            raise ValueError(f"cu_seqlens must be a [B + 1] tensor, got {shape}")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
        return Packing.from_bounds(cu_seqlens.tolist(), device)


def longest_run(bounds: Sequence[int]) -> int:
    """The most rows between two consecutive offsets (0 for no sequence)."""
    return max((b - a for a, b in zip(bounds, bounds[1:])), default=0)


def _checked(bounds: Sequence[int]) -> tuple[int, ...]:
    bounds = tuple(int(b) for b in bounds)
    if not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens={list(bounds)} must rise from 0 (one offset per sequence, then the total)")
    return bounds


def _to_device(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    cu = torch.tensor(bounds, dtype=torch.int64)
    if device.type == "cuda":  # B + 1 offsets pinned (an asynchronous copy), the rows derived there
        cu = cu.pin_memory()
    return cu.to(device, non_blocking=True)


def _row_tensors(cu: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens [B + 1] (on its device) -> (seq, local, first_row) [rows] on that device, by a
    few launches that wait for nothing (the row count is passed, not read back). Built where the
    offsets are: copying T-long index tensors from pinned host memory cost more host time
    (a T-sized pinned allocation per forward) than deriving them on the GPU."""
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=rows)
    first_row = cu[:-1][seq]
    local = torch.arange(rows, device=cu.device) - first_row
    return seq, local, first_row
