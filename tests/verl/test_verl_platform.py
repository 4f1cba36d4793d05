"""verl on a CPU through zmrl's platform (probed in a fresh interpreter, tests/verl/conftest.py):
VERL_PLATFORM=cpu selects it, and verl's own process-group set-up then gives a gloo group. The
control runs verl's unpatched function under the same platform: torch refuses its backend string
"cpu:gloo,cpu:gloo". (The other CPU fix, a worker's accelerator id, is exercised by every replica
launch in test_rollout_sync.py: verl's vLLM replica looks it up for each worker.)"""
import pytest

pytestmark = pytest.mark.verl


def test_verl_process_group_on_the_cpu_platform_is_gloo(verl_probe):
    assert verl_probe["platform"] == {"class": "CpuPlatform", "device": "cpu", "comm": "gloo", "ipc": False,
                                      "empty_cache": True}
    assert verl_probe["patched"] == {"backend": "gloo", "world_size": 1}


def test_one_process_group_needs_no_free_master_port(verl_probe):
    # verl picks MASTER_PORT by binding and releasing it; the probe holds it as another process could
    assert "EADDRINUSE" in verl_probe["env_rendezvous"], verl_probe["env_rendezvous"]  # the port is taken
    assert verl_probe["patched"] == {"backend": "gloo", "world_size": 1}  # and the group is made anyway


def test_negative_control_verls_own_backend_string_is_refused_on_a_cpu(verl_probe):
    assert "Duplicate device type cpu" in verl_probe["unpatched"], verl_probe["unpatched"]
