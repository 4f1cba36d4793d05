"""The loop on a CPU without AVX-512: `zmrl train` with oneDNN capped at its AVX2 kernels
(`ONEDNN_MAX_CPU_ISA=AVX2`, what such a CPU runs, selectable on any x86 CPU), the tiny model in bf16,
a vLLM rollout of 16 tokens and the Megatron trainer: every mismatch key exactly 0 at both steps.

Those kernels give a bmm's rows other bits for a k-major B than for the same B dense; before the CPU
tiles handed the BLAS one layout (zmrl/batch_invariant/_tiles.py), this run differed at 12 of 64
tokens of step 1 (max |diff| 2.3e-3). The layout itself is tested in
tests/batch_invariant/test_cpu_gemm_layouts.py, with the control that the two layouts differ.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.loop.conftest import RECIPE, ROOT, small_overrides
from tests.loop.test_loop import MISMATCH

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]


def test_vllm_and_megatron_agree_in_bf16_on_onednn_avx2(tiny_bf16_model, dataset, tmp_path):
    run_dir = tmp_path / "run"
    sets = (*small_overrides(tiny_bf16_model, dataset, run_dir), 'rollout.backend="vllm"',
            'trainer.backend="megatron"', "run.steps=2", "rollout.max_tokens=16")
    args = [sys.executable, "-m", "zmrl.cli", "train", str(RECIPE)]
    for s in sets:
        args += ["--set", s]
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        for key in MISMATCH:
            assert m[key] == 0, f"step {m['step']}: {key} = {m[key]!r}"
