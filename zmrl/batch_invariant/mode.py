"""One switch that makes third-party code batch-invariant without edits.

`enable()` registers zmrl's implementations for aten mm, addmm, bmm, _softmax, _log_softmax
and mean.dim on the CPU dispatch key (and on CUDA once the Triton path is present), so
vLLM's sampler or Megatron's linears route through the invariant kernels. `disable()`
restores torch's own kernels. Both are idempotent; `batch_invariant_mode()` is the scoped form.
Autograd sits above these kernels, so gradients of overridden ops still flow.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

import torch

from zmrl.batch_invariant.matmul import bmm, matmul
from zmrl.batch_invariant.rowwise import log_softmax, mean, softmax

_lock = threading.Lock()
_library: torch.library.Library | None = None


def _aten_mm(a, b):
    return matmul(a, b)


def _aten_addmm(bias, a, b, *, beta=1, alpha=1):
    # bias added after the GEMM at one fixed point, as in zmrl.batch_invariant.linear
    out = matmul(a, b)
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    return out + (bias if beta == 1 else bias * beta)


def _aten_bmm(a, b):
    return bmm(a, b)


def _aten_softmax(x, dim, half_to_float):
    out = softmax(x, dim)
    return out.float() if half_to_float else out


def _aten_log_softmax(x, dim, half_to_float):
    out = log_softmax(x, dim)
    return out.float() if half_to_float else out


def _aten_mean_dim(x, dim, keepdim=False, *, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    if x.dtype not in (torch.float32, torch.bfloat16):
        return _unpatched_mean(x, dim, keepdim)
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 else list(dim)
    if x.dim() == 0:
        return x.clone()
    return mean(x, dims, keepdim)


def _unpatched_mean(x, dim, keepdim):
    # float16/float64 are outside the contract: sum in their own dtype without recursion
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 else list(dim)
    count = 1
    for d in dims:
        count *= x.shape[d]
    return x.sum(dims, keepdim=keepdim) / count


_OVERRIDES = {
    "mm": _aten_mm,
    "addmm": _aten_addmm,
    "bmm": _aten_bmm,
    "_softmax": _aten_softmax,
    "_log_softmax": _aten_log_softmax,
    "mean.dim": _aten_mean_dim,
}


def _dispatch_keys() -> list[str]:
    keys = ["CPU"]
    if torch.cuda.is_available():
        keys.append("CUDA")
    return keys


def enable() -> None:
    """Route aten matmuls, softmaxes and means through zmrl.batch_invariant (idempotent)."""
    global _library
    with _lock:
        if _library is not None:
            return
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel" is the point
            warnings.simplefilter("ignore", UserWarning)
            for op, fn in _OVERRIDES.items():
                for key in _dispatch_keys():
                    lib.impl(op, fn, key)
        _library = lib
        # TF32 would round fp32 GEMM inputs; invariant mode means exact fp32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def disable() -> None:
    """Restore torch's kernels (idempotent)."""
    global _library
    with _lock:
        if _library is None:
            return
        _library._destroy()
        _library = None


def is_enabled() -> bool:
    return _library is not None


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Scoped enable (or disable): restores the previous state on exit."""
    was = is_enabled()
    (enable if enabled else disable)()
    try:
        yield
    finally:
        (enable if was else disable)()
