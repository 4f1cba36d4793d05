"""TP=2 (two processes, gloo) runs, and how close it is to TP=1 is measured and printed.

Bitwise equality of TP=2 with TP=1 is not yet a property (a later goal; known causes: row-parallel
partial sums, sparse MLA's per-query [heads, C] GEMM whose M is the rank's head count, and column
splits of very narrow outputs); this test requires that TP=2 runs end to end (forward, backward,
PPO step) and stays within float32 rounding of TP=1, and prints whether it is bitwise equal.
"""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def test_tp2_runs_and_matches_tp1_within_rounding(model_dir):
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "zmrl.trainer.megatron.tp_check", "--model",
                           str(model_dir), "--tp", "2", "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\nTP=2 vs TP=1:", json.dumps(report, indent=1))
    assert report["lora"]["total"] > 0 and report["grad"]["total"] > 0
    assert report["base"]["max_abs_diff"] < 1e-4 and report["lora"]["max_abs_diff"] < 1e-4
    assert report["grad"]["max_abs_diff"] < 1e-3
    assert report["adapter_after_step"]["max_abs_diff"] < 1e-4
