"""Every patch zmrl applies to megatron-core 0.16.1, in one place, each with its reason.

`import_megatron()` is the only entry: it imports megatron.core (raising the install command when
it is missing), silences its import-time warnings and applies the patches below once, before any
Megatron module is built:

(0) mappings._reduce returns the un-reduced tensor when its input is non-contiguous (all devices;
    a correctness fix, found by the TP=2 gradient check);
(1) mappings._gather_along_last_dim allocates on torch.cuda.current_device() (wrong on CPU) and
    calls all_gather_into_tensor (which torch documents as CPU-only on gloo, and gloo is how several
    ranks share one GPU). Both now go through zmrl.batch_invariant.collectives' all_gather / all_reduce_sum,
    which stage CUDA tensors through host memory on a gloo group (all devices).

That is all the zmrl modules need. The stock GPTModel needs more on CPU (found by running it there:
torch.cuda.current_device for RotaryEmbedding and TopKRouter, MLA's HAVE_TE check,
moe_utils.te_general_gemm, a core-attention module accepting k_channels), but zmrl supplies its
own attention (no rotary module, no TE check, no core attention) and its own router and experts,
so none of those code paths runs. The patches are idempotent.
"""
from __future__ import annotations

import warnings

_PATCHED = False

INSTALL_HINT = "pip install 'megatron-core==0.16.1' (or `pip install -e .[cpu]`)"


def import_megatron():
    """-> the megatron.core module, patched (see the module docstring)."""
    global _PATCHED
    try:
        with warnings.catch_warnings():
            # "Transformer Engine and Apex are not installed. Falling back to ...": expected here,
            # zmrl uses neither (its linears call zmrl.batch_invariant; its optimizer is torch's AdamW)
            warnings.simplefilter("ignore", UserWarning)
            import megatron.core
            import megatron.core.models.gpt  # noqa: F401  ("Apex is not installed ... Torch Norm")
            import megatron.core.parallel_state  # noqa: F401
            import megatron.core.tensor_parallel  # noqa: F401
    except ModuleNotFoundError as e:
        # keeps e.name ("megatron"), which callers (zmrl.rl.engines) test to name the fix
        raise ModuleNotFoundError(f"the megatron trainer needs megatron-core: {INSTALL_HINT} ({e})",
                                  name=e.name) from e
    if not _PATCHED:
        _fix_reduce()
        _patch_gather()
        _PATCHED = True
    return megatron.core


def _fix_reduce() -> None:
    """(0) tensor_parallel.mappings._reduce all-reduces `input_.contiguous()` and returns `input_`:
    for a non-contiguous tensor the reduced copy is dropped and the un-reduced input returned. On
    CPU, gradients reaching copy-to-region (its backward is _reduce) are often non-contiguous (a
    GEMM's transposed result), which silently made TP=2 LoRA gradients partial. Reduce a
    contiguous tensor and return that tensor. Applies on every device: it is a correctness fix."""
    from megatron.core.tensor_parallel import mappings

    from zmrl.batch_invariant.collectives import all_reduce_sum

    def _reduce(input_, group):
        assert group is not None, "group should not be None"
        if group.size() == 1:
            return input_
        return all_reduce_sum(input_, group)

    mappings._reduce = _reduce


def _patch_gather() -> None:
    import torch
    from megatron.core.tensor_parallel import mappings

    from zmrl.batch_invariant.collectives import all_gather

    # (1) mappings._gather_along_last_dim (behind gather_from_tensor_model_parallel_region, which
    # the gathered column-parallel linears and the expert-parallel MoE use) allocates its output on
    # torch.cuda.current_device(): "Torch not compiled with CUDA enabled" on CPU. Allocate on the
    # input's device, through zmrl's all-gather (host-staged for CUDA tensors on gloo). (Patching
    # torch.cuda.current_device itself, which the stock GPTModel would need, would also change what
    # an in-process vLLM sees.)
    def _gather_along_last_dim(input_, group):
        if group.size() == 1:
            return input_
        return torch.cat(all_gather(input_, group), dim=-1).contiguous()

    mappings._gather_along_last_dim = _gather_along_last_dim
