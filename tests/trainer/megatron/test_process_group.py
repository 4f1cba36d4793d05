"""A process group the trainer opened itself is closed when the process exits (NCCL warns about,
and may leak, one left open); a group someone else opened stays theirs to close."""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.megatron

_SCRIPT = textwrap.dedent("""
    import atexit
    import torch.distributed as dist
    # registered first, so it runs last (atexit is last in, first out): after the trainer's own
    atexit.register(lambda: print("open at exit" if dist.is_initialized() else "closed at exit", flush=True))
    from zmrl.model.config import ModelConfig
    from zmrl.model.presets import PRESETS
    from zmrl.trainer.megatron.parallel import init_parallel
    if {caller_opens}:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_parallel(ModelConfig(**PRESETS["tiny"]), tp=1, backend="gloo")
    print("initialized", flush=True)
""")


def _run(caller_opens: bool) -> list[str]:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _SCRIPT.format(caller_opens=caller_opens)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_a_group_the_trainer_opened_is_closed_at_exit():
    assert " ".join(_run(caller_opens=False)) == "initialized closed at exit"


def test_a_group_the_caller_opened_is_left_open():
    assert " ".join(_run(caller_opens=True)) == "initialized open at exit"
