"""What every Triton kernel module shares: interpreter detection, device checks, TMA helpers.

Triton decides between compiling a kernel and interpreting it with numpy when the
`@triton.jit` decorator runs, i.e. when a kernel module is imported; TRITON_INTERPRET=1 must
therefore be in the environment before `zmrl.batch_invariant.triton` is first imported.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

INTERPRET: bool = bool(triton.knobs.runtime.interpret)


# Host-side grid and block arithmetic. Triton 3.6 makes `triton.cdiv` and `triton.next_power_of_2`
# constexpr functions (callable inside kernels too), and a call from Python pays their argument
# unwrapping, ~2-3 us; a train step makes ~1,500 such calls. These are plain ints, the same values.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0 (triton.cdiv's value)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n for n >= 1, and 0 for n <= 0 (triton.next_power_of_2's values)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def env_reader(name: str) -> Callable[[], object]:
    """A function of no arguments whose value changes exactly when os.environ's value of `name`
    does (None while it is unset), for a key read on every call: `os.environ.get` of an unset name
    raises and catches a KeyError inside Mapping.get (~0.7 us). CPython's os.environ keeps every
    variable in its own dict under the encoded name, which the reader looks up directly (~30 ns);
    another os.environ takes the ordinary lookup."""
    data, encodekey = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and callable(encodekey):
        return functools.partial(data.get, encodekey(name))
    return functools.partial(os.environ.get, name)


def check_runnable(name: str, t: torch.Tensor) -> None:
    if not INTERPRET and not t.is_cuda:
        raise ValueError(
            f"{name} is on {t.device}: the Triton path runs CUDA tensors, or any tensor under "
            "TRITON_INTERPRET=1 set before zmrl.batch_invariant.triton is imported"
        )


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    if INTERPRET or not torch.cuda.is_available():
        return 4  # the interpreter runs programs one after another; a few cover the schedule
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t: torch.Tensor) -> int | None:
    return t.device.index if t.is_cuda else None


def tma_ready(t: torch.Tensor) -> bool:
    """A 2-D tensor a TMA descriptor can address: unit inner stride, 16-byte row pitch and base."""
    es = t.element_size()
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * es) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.stride(0) >= t.shape[1]
    )


def pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    """Copy [R, C] into a fresh zero-filled [R, cols]; the zeros are exactly what a TMA load
    reads past the edge, so a padded operand gives the same tiles as an unpadded one."""
    out = t.new_zeros(t.shape[0], cols)
    out[:, : t.shape[1]] = t
    return out


def aligned_cols(cols: int, element_size: int) -> int:
    step = 16 // element_size
    return cdiv(cols, step) * step


def make_desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

