"""The fp32 workspace of a planned split-K call, kept for the next call instead of allocated anew.

A split-K GEMM writes its K ranges' partial sums to an fp32 workspace that the fixed-order sum
reads right after (_splitk.py); the workspace is dead once the sum has run. An eager call used to
allocate it afresh (a caching-allocator round trip, ~1.5 us of host time on a call of ~20 us).
Here one buffer per (device, stream, host thread) serves every planned split-K call made there:

- the stream's order makes the reuse safe: a call's partial GEMM and its sum are queued on one
  stream, one right after the other by one thread, so the next call's partial GEMM on that stream
  starts after this call's sum has read the buffer. Another stream or another thread (whose
  launches could interleave with this thread's on a shared stream) has a buffer of its own;
- a buffer is allocated while its stream is current, so when a larger one replaces it, the
  caching allocator hands the old block out again only in that stream's order;
- while a CUDA graph is being captured every call allocates its own workspace, as before: a
  graph replays its addresses later, beside calls that may have regrown (and freed) the buffer;
- a workspace of more than KEEP_MAX_BYTES is never kept (split-K serves a narrow GEMM's small
  and mid row counts; the largest table entry's workspace at M = 256 is ~6 MiB), and at most
  KEEP_MAX_BUFFERS are kept (a process that makes new threads keeps making new keys): past that
  the kept ones are dropped. Dropping one is safe for the same reason as regrowing it: the
  allocator hands its block out again only to a later allocation on the stream it was made on.

The buffer only changes where the partials live, never which values are added in which order:
the bits are the bits of a fresh workspace.
"""
from __future__ import annotations

import threading

import torch

KEEP_MAX_BYTES = 64 << 20
KEEP_MAX_BUFFERS = 64

_KEPT: dict[tuple[int, int, int], torch.Tensor] = {}


def workspace(numel: int, device: torch.device, device_index: int, stream: int) -> torch.Tensor:
    """An fp32 buffer of at least `numel` elements for a split-K call queued now on `stream` (the
    device's current stream): the kept buffer of this device, stream and thread, or a fresh one
    (during a capture, or past KEEP_MAX_BYTES). Only its address is read; keep the tensor alive
    until the call's kernels are queued."""
    if numel * 4 > KEEP_MAX_BYTES or not _may_keep(device):
        return torch.empty(numel, dtype=torch.float32, device=device)
    key = (device_index, stream, threading.get_ident())
    buf = _KEPT.get(key)
    if buf is None or buf.numel() < numel:
        if buf is None and len(_KEPT) >= KEEP_MAX_BUFFERS:
            _KEPT.clear()
        buf = _KEPT[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf


def _may_keep(device: torch.device) -> bool:
    """A CUDA call outside a graph capture."""
    return device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def release() -> None:
    """Drop every kept buffer (the caching allocator gets the memory back)."""
    _KEPT.clear()
