"""Argument validation shared by the ops: every bad input gets an error naming the argument."""
from __future__ import annotations

import os
import re

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


# ----------------------------------------------------------------------------- value checks
# Checks of values (indices in range, no NaN, ascending positions) need the values on the host,
# and for a CUDA tensor `int(t.max())` waits for everything queued on the GPU: a dozen such waits
# per layer stalled eager steps and made a forward impossible to capture in a CUDA graph. So a
# value check on a CUDA tensor can be deferred (opt-in: DEFERRED below): `check_values` adds the failing bit to a per-device
# flag tensor (device ops only, capturable) and queues an asynchronous copy of the flags to
# pinned host memory. The check raises, with its message, at the first later check (of any op)
# that finds the copy arrived (an event query, never a wait), or at `raise_failed_checks()`, which
# waits: call it wherever a step syncs anyway. The ops that gather with such values first make
# bad values harmless (clamped or dropped), so a bad input fails with its message, never with a
# device-side assert or an illegal address. CPU tensors are checked at once (no GPU to wait for).
_MAX_SITES = 64
_sites: dict[str, int] = {}
_last_message: dict[int, str] = {}
_DIGITS = re.compile(r"\d+")
_flags: dict[torch.device, "_DeviceFlags"] = {}


class _DeviceFlags:
    def __init__(self, device: torch.device):
        self.device = device
        # 1 = every call of that check passed so far; a failing call multiplies it by 0 (one kernel)
        self.flags = torch.ones(_MAX_SITES, dtype=torch.int32, device=device)
        cuda = device.type == "cuda"
        self.host = torch.ones(_MAX_SITES, dtype=torch.int32, pin_memory=cuda) if cuda else None
        self.event = torch.cuda.Event() if cuda else None
        self.pending = False

    def poll_and_mirror(self) -> None:
        """Raise for a failure the last arrived copy shows, then queue a new copy; while a copy is
        still in flight, do neither (never waits; at most one copy outstanding)."""
        if self.host is None:
            return
        if self.pending:
            if not self.event.query():
                return
            self.pending = False
            if not bool(self.host.all()):
                self._raise(self.host.clone())
        self.host.copy_(self.flags, non_blocking=True)
        self.event.record()
        self.pending = True

    def check_now(self) -> None:
        found = self.flags.to("cpu", copy=True)
        if not bool(found.all()):
            self._raise(found)

    def _raise(self, found: torch.Tensor) -> None:
        self.flags.fill_(1)
        if self.host is not None:
            if self.pending:
                self.event.synchronize()  # an error path: the copy in flight must not land later
            self.host.fill_(1)
        self.pending = False
        failed = [_last_message[int(i)] for i in (found == 0).nonzero().flatten()]
        more = f" (and {len(failed) - 1} other failed check(s): {'; '.join(failed[1:])})" if len(failed) > 1 else ""
        raise ValueError(f"{failed[0]} (found on {self.device}){more}")


DEFERRED = os.environ.get("ZMRL_DEFER_VALUE_CHECKS", "0") == "1"
"""Deferred checks on CUDA are opt-in (ZMRL_DEFER_VALUE_CHECKS=1): on the H200 (2026-12-01) they
reported failures of checks whose inputs were valid (a top-k NaN check in a bf16 two-rank
tp_check, an index check in a warm-up), not yet explained; by default a CUDA check reads its
flag back at once, as a CPU check does (one host sync per check)."""


def defers_checks(t: torch.Tensor) -> bool:
    """Whether value checks of t are deferred (a CUDA tensor, deferral on) rather than done at once."""
    return t.is_cuda and DEFERRED


def check_values(ok: torch.Tensor, message: str, detail=None) -> None:
    """Raise ValueError(message) where the 0-d bool tensor `ok` is False: at once for a CPU
    tensor (with `detail()` appended: values read back for free), deferred for a CUDA one (see
    above; `message` must not depend on values, it names the check)."""
    if not defers_checks(ok):
        if not bool(ok):
            raise ValueError(message + (f", {detail()}" if detail is not None else ""))
        return
    state = _flags.get(ok.device)
    capturing = ok.is_cuda and torch.cuda.is_current_stream_capturing()
    if state is None:
        if capturing:
            return  # the flags must be allocated outside the graph's memory pool; checked eagerly later
        state = _flags[ok.device] = _DeviceFlags(ok.device)
    # one slot per check, not per message: messages name sizes that change from call to call
    site = _DIGITS.sub("#", message)
    slot = _sites.get(site)
    if slot is None:
        if len(_sites) >= _MAX_SITES:
            raise RuntimeError(f"more than {_MAX_SITES} distinct value checks: raise _MAX_SITES")
        slot = _sites[site] = len(_sites)
    _last_message[slot] = message
    state.flags.select(0, slot).mul_(ok)
    if not capturing:
        state.poll_and_mirror()


def raise_failed_checks() -> None:
    """Wait for every deferred value check queued so far and raise the first failure's message."""
    for state in list(_flags.values()):
        state.check_now()
