"""Tensor parallel is bit-exact: TP = 2 and 4 (processes over gloo) equal TP = 1 in the base and adapted
log-probs, the LoRA gradient and the adapter after a PPO step; the same TP = 2 run with an ordinary
all-reduce in place of the canonical tree (the negative control) differs.

Each run is `python -m zmrl.trainer.megatron.tp_check` (spawns the ranks; on a CUDA machine with
enough GPUs it runs NCCL, one GPU per rank).
"""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def _tp_check(model_dir, *args) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "zmrl.trainer.megatron.tp_check", "--model",
                           str(model_dir), "--json", *args], capture_output=True, text=True, timeout=1200)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    return report


def test_tp2_and_tp4_equal_tp1_bitwise(model_dir):
    report = _tp_check(model_dir, "--tp", "2", "4")
    for tp in (2, 4):
        for key in ("base", "lora", "grad", "adapter_after_step"):
            r = report[f"tp{tp}"][key]
            assert r["total"] > 0
            assert r["equal"], f"TP={tp} {key}: {r['differing']}/{r['total']} differ, max |diff| {r['max_abs_diff']}"


def test_tp2_with_an_ordinary_all_reduce_differs(model_dir):
    report = _tp_check(model_dir, "--tp", "2", "--ordinary")
    r = report["tp2"]
    assert not r["lora"]["equal"] and not r["grad"]["equal"], "the ordinary all-reduce matched the canonical tree"
