"""verl on a CPU through zmrl's platform: VERL_PLATFORM=cpu selects it, and verl's own
process-group set-up then gives a gloo group. The control runs verl's unpatched function under
the same platform: its backend string "cpu:gloo,cpu:gloo" is refused by torch.
(The other CPU fix, a worker's accelerator id, is exercised by every replica launch in
test_rollout_sync.py: verl's vLLM replica looks it up for each worker.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, sys
import torch.distributed as dist
import verl.utils.distributed as distributed
from verl.plugin.platform import get_platform

init = distributed.initialize_global_process_group_ray
if sys.argv[1] == "unpatched":
    init = init.__wrapped__
platform = get_platform()
try:
    init(timeout_second=60)
    out = {"backend": dist.get_backend(), "world_size": dist.get_world_size()}
except Exception as e:
    out = {"error": f"{type(e).__name__}: {e}"}
out.update(platform=type(platform).__name__, device=platform.device_name, comm=platform.communication_backend_name(),
           ipc=platform.is_ipc_supported(), empty_cache=platform.device_module.empty_cache() is None)
print(json.dumps(out))
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(mode: str) -> dict:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VERL_PLATFORM": "cpu", "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_verl_process_group_on_the_cpu_platform_is_gloo():
    got = _probe("patched")
    assert got == {"backend": "gloo", "world_size": 1, "platform": "CpuPlatform", "device": "cpu", "comm": "gloo",
                   "ipc": False, "empty_cache": True}


def test_negative_control_verls_own_backend_string_is_refused_on_a_cpu():
    got = _probe("unpatched")
    assert "Duplicate device type cpu" in got.get("error", ""), got
