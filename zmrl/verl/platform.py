"""A CPU platform for verl: gloo, no accelerators, so verl's Ray workers and vLLM server run on a CPU.

verl 0.9.1 asks its platform object (`verl.plugin.platform.get_platform()`) for the device,
the collective backend, the Ray resource and the torch device module. Its built-in platforms
are CUDA, ROCm and Ascend; a CPU-only machine falls back to "nvidia" and fails ("Distributed
package doesn't have NCCL built in"). This one is chosen with `VERL_PLATFORM=cpu`, or by
verl's auto-detection on a CPU-only torch build (it is probed after the built-in platforms).

Two places in verl assume an accelerator whatever the platform says; `register()` fixes each
by wrapping the one function, and each wrapper changes nothing unless the platform is this one:

- `verl.utils.distributed.initialize_global_process_group(_ray)` build the backend string
  "cpu:gloo,<device>:<backend>", which for device "cpu" is "cpu:gloo,cpu:gloo": torch refuses
  it ("Duplicate device type cpu"). On this platform the group is created with plain "gloo".
- `ray.get_runtime_context().get_accelerator_ids()[<resource>][0]` is how verl's vLLM replica
  (and verl's worker when Ray does not set visible devices) learns a worker's device id; a CPU
  actor has none, so the lookup raises. On this platform the dict also answers for this
  platform's resource name with the worker's local rank: the "device" a CPU worker owns is its
  slot on the node, which is all the replica uses the id for.
"""
from __future__ import annotations

import contextlib
import functools
import os
from types import SimpleNamespace
from typing import Any

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform

PLATFORM_NAME = "cpu"
# verl writes the replica's device ids into this variable; nothing on a CPU reads it
VISIBLE_DEVICES_ENVVAR = "VERL_CPU_VISIBLE_DEVICES"


def _nothing(*args, **kwargs) -> None:
    return None


def _zero(*args, **kwargs) -> int:
    return 0


def _memory_info(*args, **kwargs) -> tuple[int, int]:
    """(free, total) bytes of host memory, what mem_get_info means for a CPU."""
    pages, free_pages, page = (os.sysconf(k) for k in ("SC_PHYS_PAGES", "SC_AVPHYS_PAGES", "SC_PAGE_SIZE"))
    return free_pages * page, pages * page


def _device_module() -> Any:
    """torch.cpu plus the torch.cuda calls verl makes on its device module (caches, memory
    statistics, RNG, IPC), answered as a CPU would: no cache to empty, no device memory."""
    extras = dict(
        empty_cache=_nothing, ipc_collect=_nothing, set_per_process_memory_fraction=_nothing,
        reset_peak_memory_stats=_nothing, memory_allocated=_zero, memory_reserved=_zero,
        max_memory_allocated=_zero, max_memory_reserved=_zero, mem_get_info=_memory_info,
        get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
        get_device_name=lambda *a, **k: "cpu", is_available=lambda: True,
    )
    names = {n: getattr(torch.cpu, n) for n in dir(torch.cpu) if not n.startswith("_")}
    return SimpleNamespace(**{**names, **extras})


class CpuPlatform(PlatformBase):
    """verl's platform interface answered for a CPU."""

    _module = None

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        if CpuPlatform._module is None:
            CpuPlatform._module = _device_module()
        return CpuPlatform._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # auto-detection: a CPU-only torch build; on a GPU build it takes VERL_PLATFORM=cpu
        return torch.version.cuda is None and torch.version.hip is None

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return VISIBLE_DEVICES_ENVVAR

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        # Ray refuses "CPU" as a custom resource; a CPU worker's share is counted in CPUs
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        # no CUDA IPC: verl's weight transfer falls back to shared memory
        return False

    def cudart(self) -> Any:
        return None


def is_cpu_platform() -> bool:
    return isinstance(get_platform(), CpuPlatform)


def _gloo_group() -> None:
    if torch.distributed.is_initialized():
        return
    # verl's own backend string would be "cpu:gloo,cpu:gloo" ("Duplicate device type cpu")
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        # one process needs no rendezvous: verl picked MASTER_PORT by binding and releasing it, and
        # on a busy machine another process (a second run's Ray, any outgoing connection) may hold
        # it by now, which would fail the TCP store with EADDRINUSE
        torch.distributed.init_process_group(backend="gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
        return
    torch.distributed.init_process_group(backend="gloo", rank=int(os.environ.get("RANK", 0)),
                                         world_size=world_size)


def _gloo_process_group_ray(init):
    @functools.wraps(init)
    def initialize(*args, **kwargs):
        if is_cpu_platform():
            _gloo_group()  # verl's function then finds the group and skips its own set-up
        return init(*args, **kwargs)

    initialize.zmrl_cpu_patch = True
    return initialize


def _gloo_process_group(init):
    @functools.wraps(init)
    def initialize(*args, **kwargs):
        if not is_cpu_platform():
            return init(*args, **kwargs)
        _gloo_group()  # verl's function would create a second group: return what it returns
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    initialize.zmrl_cpu_patch = True
    return initialize


def _accelerator_ids_with_cpu_slot(get_ids):
    @functools.wraps(get_ids)
    def get_accelerator_ids(self):
        ids = get_ids(self)
        if is_cpu_platform() and not ids.get(PLATFORM_NAME.upper()):
            # a CPU actor owns no accelerator; its "device" is its slot on the node
            ids = {**ids, PLATFORM_NAME.upper(): [os.environ.get("LOCAL_RANK", "0")]}
        return ids

    get_accelerator_ids.zmrl_cpu_patch = True
    return get_accelerator_ids


def _patch(owner, name: str, wrap) -> None:
    current = getattr(owner, name)
    if not getattr(current, "zmrl_cpu_patch", False):
        setattr(owner, name, wrap(current))


def register() -> None:
    """Register the platform under VERL_PLATFORM=cpu and install the two CPU fixes (idempotent)."""
    import ray.runtime_context

    import verl.utils.distributed as distributed

    if PlatformRegistry.get(PLATFORM_NAME) is not CpuPlatform:
        PlatformRegistry.register(platform=PLATFORM_NAME)(CpuPlatform)
    _patch(distributed, "initialize_global_process_group_ray", _gloo_process_group_ray)
    _patch(distributed, "initialize_global_process_group", _gloo_process_group)
    _patch(ray.runtime_context.RuntimeContext, "get_accelerator_ids", _accelerator_ids_with_cpu_slot)


register()
