"""Argument validation shared by the ops: every bad input gets an error naming the argument."""
from __future__ import annotations

import os
import sys
import time
from collections import deque

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
# value check on a CUDA tensor is deferred: `fail_if` gives the call a serial number and,
# where the check fails, writes that number into the check's slot of a per-device tensor (device
# ops only: capturable, no wait). After an eager check the slots are copied asynchronously to
# pinned host memory, one copy in flight at a time and at most one per COPY_INTERVAL_S; a later
# check that finds the copy arrived (an event query, never a wait) raises the failing call's
# message, and so does `raise_failed_checks()`, which waits: call it wherever a step syncs anyway
# (the trainer does at the end of `logprobs` and `train_step`, the RL loop after rollout and
# update). The ops that gather with such values first make bad values harmless (clamped or
# dropped), so a bad input fails with its message, never with a device-side assert or an illegal
# address.
#
# The state only grows: a slot holds the serial of the latest failing call of its check and is
# never reset, and the host remembers the serial it last reported per slot, so a copy that lands
# late, or was taken on another stream before a report, can only show serials already reported,
# never a failure that did not happen. CPU tensors are checked at once (nothing to wait for), and
# ZMRL_DEFER_VALUE_CHECKS=0 checks CUDA tensors at once too (one host sync per check: debugging).
_MAX_SITES = 64
# A GPU runs a step's checks a few ms apart while the host is ahead of it, so a copy per check
# (a launch and an event each) would report no sooner in practice; one copy per interval keeps the
# reports prompt and their cost a few launches per step.
COPY_INTERVAL_S = 0.02
_sites: dict[tuple, int] = {}  # a check's call site (code object, line) -> its slot
_serial = 0  # the serial number of the latest deferred call, over every device
_states: dict[torch.device, "_DeviceChecks"] = {}


def _defer_from_env() -> bool:
    value = os.environ.get("ZMRL_DEFER_VALUE_CHECKS", "1")
    if value not in ("0", "1"):
        raise ValueError(f"ZMRL_DEFER_VALUE_CHECKS={value!r} must be 1 (defer CUDA value checks, the default) "
                         f"or 0 (check at once, a host sync per check)")
    return value == "1"


DEFERRED = _defer_from_env()
"""Whether value checks of CUDA tensors are deferred (the default; ZMRL_DEFER_VALUE_CHECKS=0: not)."""


class _DeviceChecks:
    """One device's deferred checks: what failed, per slot, on the device, and its mirror on the host.

    Row 0 of `failed` holds the serial of the latest failing eager call of each check; row 1
    counts the failing calls recorded in CUDA graphs (a replay repeats the captured serial, so
    only a count tells a new failure from an old one). Both only grow."""

    def __init__(self, device: torch.device):
        self.device = device
        # created outside inference mode, or an in-place update outside it (a trainer sharing the
        # process with an inference engine) would be refused
        with torch.inference_mode(False):
            self.failed = torch.zeros(2, _MAX_SITES, dtype=torch.int64, device=device)
        cuda = self.mirrored = device.type == "cuda"  # CPU slots are read directly (tests only)
        if cuda:
            self.host = torch.zeros(2, _MAX_SITES, dtype=torch.int64, pin_memory=True)
            with torch.cuda.device(device):
                self.event = torch.cuda.Event()
        self.copy_serial: int | None = None  # the serial when the copy in flight was queued
        self.queued_at = -float("inf")  # time.monotonic() when the latest copy was queued
        self.reported = [[0] * _MAX_SITES, [0] * _MAX_SITES]  # what was already raised, as `failed`
        self.messages: deque[tuple[int, str]] = deque()  # (serial, message) of eager calls not yet known good
        self.captured: dict[int, str] = {}  # per slot, the message of its call recorded in a CUDA graph
        self.latest: dict[int, str] = {}  # per slot, the message of its latest eager call

    def record(self, slot: int, bad: torch.Tensor, message: str, capturing: bool) -> None:
        global _serial
        if capturing:
            self.failed[1].select(0, slot).add_(bad)
            self.captured[slot] = message
            return
        _serial += 1
        # the serial as a Python scalar (a kernel argument): as a CPU tensor it would be copied to
        # the device, a host sync per check
        self.failed[0].select(0, slot).masked_fill_(bad, _serial)  # one launch per check
        self.messages.append((_serial, message))
        self.latest[slot] = message

    def poll(self) -> None:
        """Raise for a failure the last arrived copy shows, then queue a new copy unless one was
        queued less than COPY_INTERVAL_S ago; while a copy is still in flight, do neither (never
        waits)."""
        if self.copy_serial is not None:
            if not self._copy_arrived():
                return
            seen, upto = self._copied(), self.copy_serial
            self.copy_serial = None
            self._report(seen, upto)
        now = time.monotonic()
        if now - self.queued_at < COPY_INTERVAL_S:
            return
        self._queue_copy()
        self.copy_serial, self.queued_at = _serial, now

    def _queue_copy(self) -> None:
        self.host.copy_(self.failed, non_blocking=True)  # on the current stream of self.device
        self.event.record(torch.cuda.current_stream(self.device))  # that stream, whatever the current device

    def _copy_arrived(self) -> bool:
        return self.event.query()

    def _copied(self) -> list[list[int]]:
        return self.host.tolist()

    def check_now(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every stream: checks queued on any of them count
            self.copy_serial = None  # the copy in flight has landed; the read below is newer
        self._report(self.failed.tolist(), _serial)

    def _report(self, seen: list[list[int]], upto: int) -> None:
        """Raise for every slot that failed since the last report, naming the failing call; forget
        the messages of eager calls up to `upto` (the copy read after them)."""
        new = [(serial, slot) for slot, serial in enumerate(seen[0]) if serial > self.reported[0][slot]]
        failed = []
        if new:
            by_serial = dict(self.messages)
            for serial, slot in sorted(new):
                self.reported[0][slot] = serial
                # forgotten only where the check ran on another stream than the copy: then the
                # check's latest message names it (its sizes may be a later call's)
                failed.append(by_serial.get(serial) or self.latest[slot])
        for slot, count in enumerate(seen[1]):
            if count > self.reported[1][slot]:
                self.reported[1][slot] = count
                failed.append(f"{self.captured[slot]} (in a CUDA graph replay)")
        while self.messages and self.messages[0][0] <= upto:
            self.messages.popleft()
        if failed:
            more = f" (and {len(failed) - 1} other failed check(s): {'; '.join(failed[1:])})" if len(failed) > 1 else ""
            raise ValueError(f"{failed[0]} (found on {self.device}){more}")


def defers_checks(t: torch.Tensor) -> bool:
    """Whether value checks of t are deferred (a CUDA tensor, deferral on) rather than done at once."""
    return t.is_cuda and DEFERRED


def fail_if(bad: torch.Tensor, message: str, detail=None) -> None:
    """Raise ValueError(message) where the 0-d bool tensor `bad` is True: at once for a CPU
    tensor (with `detail()` appended: values read back for free), deferred for a CUDA one (see
    above; the report names this call's `message`, so it must not depend on values). A check is
    phrased as what must not be found (`torch.isnan(x).any()`, not `~torch.isnan(x).any()`): the
    deferred record is then one launch, with no negation before it."""
    if not defers_checks(bad):
        if bool(bad):
            raise ValueError(message + (f", {detail()}" if detail is not None else ""))
        return
    caller = sys._getframe(1)
    site = (caller.f_code, caller.f_lineno)
    slot = _sites.get(site)
    if slot is None:
        if len(_sites) >= _MAX_SITES:
            raise RuntimeError(f"more than {_MAX_SITES} distinct value checks: raise _MAX_SITES")
        slot = _sites[site] = len(_sites)
    capturing = bad.is_cuda and torch.cuda.is_current_stream_capturing()
    state = _states.get(bad.device)
    if state is None:
        if capturing:  # allocating here would put the slots in the graph's pool, never filled eagerly
            raise RuntimeError(f"value checks on {bad.device} first ran inside a CUDA graph capture: run the "
                               "forward once eagerly (a warm-up) before capturing it")
        state = _states[bad.device] = _DeviceChecks(bad.device)
    state.record(slot, bad, message, capturing)
    if not capturing and state.mirrored:
        state.poll()


def raise_failed_checks() -> None:
    """Wait for every deferred value check queued so far and raise the failing calls' messages."""
    for state in list(_states.values()):
        state.check_now()
