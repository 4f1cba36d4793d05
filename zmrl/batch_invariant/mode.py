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

from zmrl.batch_invariant._paths import path_for
from zmrl.batch_invariant.matmul import bmm, matmul
from zmrl.batch_invariant.rowwise import log_softmax, mean, softmax

_lock = threading.Lock()
_library: torch.library.Library | None = None


_CONTRACT_DTYPES = (torch.float32, torch.bfloat16)


def _in_contract(*tensors) -> bool:
    """fp32/bf16 run zmrl's kernels; other dtypes (float64 in a reference backward, fp16,
    integers) keep torch's own kernel, reached through the `out=` overloads, which `enable()`
    leaves alone (so the fallback cannot recurse into the override). So does everything while
    the "torch" or the "reference" path is forced: those paths' ops are compositions of these very
    aten ops (the reference matmul is one `@` per row), which would otherwise come back here."""
    return all(t.dtype in _CONTRACT_DTYPES for t in tensors) and path_for(tensors[0]) not in ("torch", "reference")


def _aten_mm(a, b):
    if not _in_contract(a, b):
        return torch.mm(a, b, out=a.new_empty(a.shape[0], b.shape[1]))
    return matmul(a, b)


def _aten_addmm(bias, a, b, *, beta=1, alpha=1):
    if not _in_contract(bias, a, b):
        out = a.new_empty(a.shape[0], b.shape[1])
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=out)
    # bias added after the GEMM at one fixed point, as in zmrl.batch_invariant.linear
    out = matmul(a, b)
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    return out + (bias if beta == 1 else bias * beta)


def _aten_bmm(a, b):
    if not _in_contract(a, b):
        return torch.bmm(a, b, out=a.new_empty(a.shape[0], a.shape[1], b.shape[2]))
    return bmm(a, b)


def _aten_softmax(x, dim, half_to_float):
    if not _in_contract(x):
        out = x.new_empty(x.shape, dtype=torch.float32 if half_to_float else x.dtype)
        return torch.ops.aten._softmax.out(x, dim, half_to_float, out=out)
    out = softmax(x, dim)
    return out.float() if half_to_float else out


def _aten_log_softmax(x, dim, half_to_float):
    if not _in_contract(x):
        out = x.new_empty(x.shape, dtype=torch.float32 if half_to_float else x.dtype)
        return torch.ops.aten._log_softmax.out(x, dim, half_to_float, out=out)
    out = log_softmax(x, dim)
    return out.float() if half_to_float else out


def _aten_mean_dim(x, dim, keepdim=False, *, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 else list(dim)
    if not _in_contract(x) or x.dim() == 0:
        return torch.ops.aten.mean.out(x, dims, keepdim, out=x.new_empty(0))
    return mean(x, dims, keepdim)


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
