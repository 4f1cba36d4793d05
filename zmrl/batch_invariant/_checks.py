"""Argument validation shared by the ops: every bad input gets an error naming the argument."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def check_float(name: str, t: torch.Tensor, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")


def check_index(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64/int32 tensor, got {t.dtype}")


def check_dim(name: str, t: torch.Tensor, ndim: int, shape_doc: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape_doc}, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"arguments are on different devices: {devices}")


def check_same_dtype(**tensors: torch.Tensor | None) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"arguments must share one dtype, got {dtypes}")


def check_size(name: str, actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{name}: {what} is {actual}, expected {expected}")
