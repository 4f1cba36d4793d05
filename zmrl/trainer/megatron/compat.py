"""Every patch zmrl applies to megatron-core 0.16.1, in one place, each with its reason.

`import_megatron()` is the only entry: it imports megatron.core (raising the install command when
it is missing), silences its import-time warnings and, on a machine without CUDA, applies the CPU
patches below before any Megatron module is built. The patches are idempotent and change nothing
on a CUDA machine. zmrl's own attention and MoE modules replace Megatron's CUDA-bound ones
(MLASelfAttention's TE checks, TopKRouter's CUDA buffers, the alltoall dispatcher's streams), so
the patches needed here are fewer than research/integration.md section 4.1 lists for the stock
GPTModel; the ones below are what the zmrl modules still hit.
"""
from __future__ import annotations

import warnings

_PATCHED = False

INSTALL_HINT = "pip install 'megatron-core==0.16.1' (or `pip install -e .[cpu]`)"


def import_megatron():
    """-> the megatron.core module, patched for CPU when there is no CUDA."""
    global _PATCHED
    try:
        with warnings.catch_warnings():
            # "Transformer Engine and Apex are not installed. Falling back to ...": expected here,
            # zmrl uses neither (its linears call zmrl.batch_invariant; its optimizer is torch's AdamW)
            warnings.simplefilter("ignore", UserWarning)
            import megatron.core
            import megatron.core.parallel_state  # noqa: F401
            import megatron.core.tensor_parallel  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the megatron trainer needs megatron-core: {INSTALL_HINT} ({e})") from e
    if not _PATCHED:
        _apply_cpu_patches()
        _PATCHED = True
    return megatron.core


def _apply_cpu_patches() -> None:
    import torch

    if torch.cuda.is_available():
        return
    # (1) megatron-core calls torch.cuda.current_device() unconditionally in a few constructors
    # and helpers reached from GPTModel (e.g. parallel_state's RNG helpers, the embedding and
    # output layers' non-cpu-initialization branch). With use_cpu_initialization=True the tensors
    # are made on CPU anyway; this makes the remaining calls name the CPU instead of raising
    # "Torch not compiled with CUDA enabled".
    torch.cuda.current_device = lambda: torch.device("cpu")
