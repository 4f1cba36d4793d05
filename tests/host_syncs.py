"""Counting the host reads that would wait for a GPU, on any device (tests only).

On a GPU, reading a value back (`.item()`, `int(t)`, `bool(t)`, `.tolist()`) or running an op whose
output size depends on values (`nonzero`, `unique`, `masked_select`, `repeat_interleave` without
`output_size`) waits for everything queued before it. On a CPU nothing waits, but the same calls
are made: `HostReads` counts them (a dispatch mode for the aten ops, a wrapper for `tolist`, which
reads a CPU tensor without dispatching), so a CPU test can prove a property of the GPU run, such
as "the number of host reads does not grow with the number of layers".
"""
from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default: "item", aten.nonzero.default: "nonzero",
         aten.masked_select.default: "masked_select", aten._unique2.default: "unique",
         aten.unique_dim.default: "unique", aten.unique_consecutive.default: "unique"}


class HostReads(TorchDispatchMode):
    """with HostReads() as reads: ...  -> reads.counts: Counter of the read kinds made inside."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            if func in READS:
                self.counts[READS[func]] += 1
            elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                self.counts["repeat_interleave"] += 1
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def paused_in(self, owner, name: str):
        """Reads made inside owner.name are not counted (an op another change is rewriting)."""
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            self.paused += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.paused -= 1

        own = name in vars(owner)  # else inherited (a method of an instance's class)
        setattr(owner, name, wrapped)
        try:
            yield
        finally:
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

    def __enter__(self):
        tolist = torch.Tensor.tolist
        mode = self

        def counted(t):
            if not mode.paused:
                mode.counts["tolist"] += 1
            return tolist(t)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        del torch.Tensor.tolist  # torch.Tensor inherits its own again
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
