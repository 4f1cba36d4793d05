"""Tensors a CUDA graph reads that were made outside its capture.

A graph records addresses, not references. A tensor made during capture lives in the graph's own
memory pool for as long as the graph does; a tensor a capture merely reads from a host-side cache
(a layout's key tiles, a forward's RoPE rows, the RoPE table) lives only while its cache holds it,
and once evicted its memory goes to other tensors while the graph still reads it on every replay.
Such caches hand their tensors through `hold_for_graph`, and whoever captures collects them:

    with holding_for_graph() as held:
        with torch.cuda.graph(graph):
            ...                         # cached tensors passed through hold_for_graph land in `held`
    keep = list(held)                   # kept as long as the graph is
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_held: list[torch.Tensor] | None = None


def hold_for_graph(*tensors: torch.Tensor) -> None:
    """While `holding_for_graph` is open and the current CUDA stream is capturing: keep these
    tensors for the graph. Otherwise nothing (a global read's cost)."""
    if _held is not None and torch.cuda.is_current_stream_capturing():
        _held.extend(tensors)


@contextlib.contextmanager
def holding_for_graph() -> Iterator[list[torch.Tensor]]:
    global _held
    outer, _held = _held, []
    try:
        yield _held
    finally:
        _held = outer


def capture_token() -> object | None:
    """While `holding_for_graph` is open and the current CUDA stream is capturing, an object that
    names this capture (another capture's differs); otherwise None. A cache keyed on it hands a
    capture only what that capture made: a graph's inputs (the positions of a refilled packing)
    may be rewritten before each replay, so values derived from them outside the capture would be
    stale on replay."""
    return _held if _held is not None and torch.cuda.is_current_stream_capturing() else None
