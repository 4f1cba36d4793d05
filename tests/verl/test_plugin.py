"""verl loads zmrl's plugin through the `verl.plugins` entry point, and the plugin registers the
CPU platform and the rollout name "zmrl". verl logs a plugin's load error at debug level only,
so each registration is checked here, in a fresh interpreter that only ran `import verl`, with
a negative control that turns verl's plugin discovery off (VERL_USE_EXTERNAL_PLUGINS=none).
"""
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
import verl
from verl.plugin.platform import PlatformRegistry
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
from verl.workers.rollout.replica import RolloutReplicaRegistry
import verl.utils.distributed as distributed
cpu = PlatformRegistry.get("cpu")
print(json.dumps({
    "plugin_loaded": "zmrl.verl.plugin" in sys.modules,
    "cpu_platform": None if cpu is None else f"{cpu.__module__}.{cpu.__qualname__}",
    "replica": "zmrl" in RolloutReplicaRegistry._registry,
    "adapter": _ROLLOUT_REGISTRY.get(("zmrl", "async")),
    "gloo_patch": getattr(distributed.initialize_global_process_group_ray, "zmrl_cpu_patch", False),
}))
"""


def _probe(plugins: str) -> dict:
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": plugins, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_verl_registers_zmrl_through_the_entry_point():
    got = _probe("auto")
    assert got == {"plugin_loaded": True, "cpu_platform": "zmrl.verl.platform.CpuPlatform", "replica": True,
                   "adapter": "verl.workers.rollout.vllm_rollout.ServerAdapter", "gloo_patch": True}, (
        f"{got}: is zmrl installed (`pip install -e .`) so that its verl.plugins entry point exists?")


def test_negative_control_without_plugin_discovery_nothing_is_registered():
    got = _probe("none")
    assert got == {"plugin_loaded": False, "cpu_platform": None, "replica": False, "adapter": None,
                   "gloo_patch": False}
