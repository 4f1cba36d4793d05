"""Which implementation of an op runs: the readable reference, the CPU fast path, Triton, or
"torch" (torch's default kernels: the batch-variant control, see torch_default.py).

The public ops call `path_for(tensor)`; tests and the `--batch-invariant off` controls force a
path with `use_path(...)` (a block) or `set_path(...)` (this thread, until reset).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

PATHS = ("reference", "cpu", "triton", "torch")

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


def set_path(name: str | None) -> None:
    """Force one path for this thread (None: pick by device again). For engines that run a
    whole session on one path; prefer `use_path` for a block."""
    if name is not None and name not in PATHS:
        raise ValueError(f"path must be one of {PATHS} or None, got {name!r}")
    _forced.set(name)


def forced_path() -> str | None:
    """The path forced in this context (use_path / set_path), or None (by device)."""
    return _forced.get()


def path_for(tensor) -> str:
    forced = _forced.get()
    if forced is not None:
        return forced
    return "triton" if tensor.is_cuda else "cpu"


def torch_ops():
    from zmrl.batch_invariant import torch_default

    return torch_default


_triton_impl = None


def triton_ops():
    """The Triton implementations (imported on first use: only kernel files import triton)."""
    global _triton_impl
    if _triton_impl is None:
        from zmrl.batch_invariant import triton as triton_impl

        _triton_impl = triton_impl
    return _triton_impl


def records_graph(*tensors) -> bool:
    """Whether autograd must record a call on these tensors. Where it need not (inference, a
    rollout step), the CPU ops run their forward math directly: the same function, without
    autograd.Function's per-call host cost, a large part of a small op's time at decode sizes."""
    import torch

    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
