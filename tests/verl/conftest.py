"""One fresh interpreter per verl set-up that the plugin and platform tests inspect (`import verl`
takes ~10-30 s here, so each probe runs once per session):

- `verl_probe`: plugin discovery on (the default) and VERL_PLATFORM=cpu. It records what
  `import verl` registered, then calls verl's process-group set-up twice: first verl's own,
  unpatched function (the control: torch refuses its backend string), then verl's function as
  zmrl's platform leaves it (a gloo group), with MASTER_PORT held by a listening socket as another
  process may hold it by then (the control: torch's own env:// rendezvous fails on that port).
- `verl_probe_without_plugins`: VERL_USE_EXTERNAL_PLUGINS=none, the control for registration.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, sys
import verl
import verl.utils.distributed as distributed
from verl.plugin.platform import PlatformRegistry, get_platform
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
from verl.workers.rollout.replica import RolloutReplicaRegistry

cpu = PlatformRegistry.get("cpu")
out = {
    "plugin_loaded": "zmrl.verl.plugin" in sys.modules,
    "cpu_platform": None if cpu is None else f"{cpu.__module__}.{cpu.__qualname__}",
    "replica": "zmrl" in RolloutReplicaRegistry._registry,
    "adapter": _ROLLOUT_REGISTRY.get(("zmrl", "async")),
    "gloo_patch": getattr(distributed.initialize_global_process_group_ray, "zmrl_cpu_patch", False),
}
if cpu is not None:
    import torch.distributed as dist

    platform = get_platform()
    out["platform"] = {"class": type(platform).__name__, "device": platform.device_name,
                       "comm": platform.communication_backend_name(), "ipc": platform.is_ipc_supported(),
                       "empty_cache": platform.device_module.empty_cache() is None}
    try:
        distributed.initialize_global_process_group_ray.__wrapped__(timeout_second=60)
        out["unpatched"] = f"a group with backend {dist.get_backend()}"
    except Exception as e:
        out["unpatched"] = f"{type(e).__name__}: {e}"
    # MASTER_PORT taken by another process since verl picked it: a one-process group must not need it
    import os, socket
    squatter = socket.socket()
    squatter.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    squatter.listen()
    try:
        dist.init_process_group(backend="gloo", rank=0, world_size=1)
        out["env_rendezvous"] = "a group"
        dist.destroy_process_group()
    except Exception as e:
        out["env_rendezvous"] = f"{type(e).__name__}: {e}"
    distributed.initialize_global_process_group_ray(timeout_second=60)
    out["patched"] = {"backend": dist.get_backend(), "world_size": dist.get_world_size()}
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(plugins: str) -> dict:
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": plugins, "PYTHONPATH": str(ROOT), "VERL_PLATFORM": "cpu",
           "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def verl_probe() -> dict:
    return _probe("auto")


@pytest.fixture(scope="session")
def verl_probe_without_plugins() -> dict:
    return _probe("none")
