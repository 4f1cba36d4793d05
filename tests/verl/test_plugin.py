"""verl loads zmrl's plugin through the `verl.plugins` entry point, and the plugin registers the
CPU platform and the rollout name "zmrl". verl logs a plugin's load error at debug level only,
so each registration is checked in a fresh interpreter that only ran `import verl`
(tests/verl/conftest.py), with a negative control that turns verl's plugin discovery off."""
import pytest

pytestmark = pytest.mark.verl

REGISTRATIONS = ("plugin_loaded", "cpu_platform", "replica", "adapter", "gloo_patch")


def test_import_verl_registers_zmrl_through_the_entry_point(verl_probe):
    got = {k: verl_probe[k] for k in REGISTRATIONS}
    assert got == {"plugin_loaded": True, "cpu_platform": "zmrl.verl.platform.CpuPlatform", "replica": True,
                   "adapter": "zmrl.verl.adapter.ZmrlServerAdapter", "gloo_patch": True}, (
        f"{got}: is zmrl installed (`pip install -e .`) so that its verl.plugins entry point exists?")


def test_negative_control_without_plugin_discovery_nothing_is_registered(verl_probe_without_plugins):
    got = {k: verl_probe_without_plugins[k] for k in REGISTRATIONS}
    assert got == {"plugin_loaded": False, "cpu_platform": None, "replica": False, "adapter": None,
                   "gloo_patch": False}
