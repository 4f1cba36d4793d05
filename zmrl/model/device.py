"""Where a host runs: one resolution of "auto" | "cpu" | "cuda" (or "cuda:N") for every engine.

    from zmrl.model.device import resolve_device
    device = resolve_device("auto")       # cuda when a CUDA GPU is visible, else cpu

The rollout engines and trainers take the resolved `torch.device`; the kernels then pick their
implementation from the tensors' device (zmrl.batch_invariant: Triton on CUDA, the CPU path on
the CPU), so nothing above this line branches on the device.
"""
from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None): cuda when available, else cpu; "cpu"; "cuda" / "cuda:N": a CUDA GPU, or a
    one-line error saying none is visible."""
    if isinstance(name, torch.device):
        name = str(name)
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)} (or cuda:N), got {name!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)} (or cuda:N), got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}; use device \"cpu\" or \"auto\")")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return device
