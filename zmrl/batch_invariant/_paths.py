"""Which implementation of an op runs: the readable reference, the CPU fast path, or Triton.

The public ops call `path_for(tensor)`; tests force a path with `use_path(...)`.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

PATHS = ("reference", "cpu", "triton")

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("zmrl_bi_path", default=None)


@contextlib.contextmanager
def use_path(name: str) -> Iterator[None]:
    """Force every zmrl.batch_invariant op inside the block onto one implementation."""
    if name not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {name!r}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def path_for(tensor) -> str:
    forced = _forced.get()
    if forced is not None:
        return forced
    return "triton" if tensor.is_cuda else "cpu"


def triton_ops():
    """The Triton implementations (imported on first use: only kernel files import triton)."""
    from zmrl.batch_invariant import triton as triton_impl

    return triton_impl
