"""The loop on other CPUs than this one: every mismatch key exactly 0 at both steps of `zmrl train`
with a vLLM rollout and the Megatron trainer.

A CPU without AVX-512: oneDNN capped at its AVX2 kernels (`ONEDNN_MAX_CPU_ISA=AVX2`, what such a CPU
runs, selectable on any x86 CPU), the tiny model in bf16, a rollout of 16 tokens.

Those kernels give a bmm's rows other bits for a k-major B than for the same B dense; before the CPU
tiles handed the BLAS one layout (zmrl/batch_invariant/_tiles.py), this run differed at 12 of 64
tokens of step 1 (max |diff| 2.3e-3). The layout itself is tested in
tests/batch_invariant/test_cpu_gemm_layouts.py, with the control that the two layouts differ.

More cores: 4 torch threads (on a 2-core machine too), the tiny model in fp32. The CPU GEMM's
self-check once ran against the caller's weight only, and a LoRA B is zero until the first update:
the shape K = 8, N = 24 passed on zeros, and on the 2-core AMD EPYC at 3, 4, 6 and 8 threads step 2
differed at 148 of 279 tokens of the main job (cpu_gemm.probe_weights; the control that a zero
weight vouches for any GEMM is in tests/batch_invariant/test_cpu_gemm.py).
"""
import os

import pytest

from tests.loop.test_loop import MISMATCH
from tests.loop.test_parallel_engines import _train

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]


def test_vllm_and_megatron_agree_in_bf16_on_onednn_avx2(tiny_bf16_model, dataset, tmp_path):
    # vLLM at TP 1 (the later set replaces _train's TP 2), Megatron at its default TP 1
    steps = _train(tiny_bf16_model, dataset, tmp_path / "run", "rollout.extra={}",
                   env=dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2"))
    _assert_zero_mismatch(steps)


def test_vllm_and_megatron_agree_at_four_threads(tiny_model, dataset, tmp_path):
    steps = _train(tiny_model, dataset, tmp_path / "run", "rollout.extra={}", "run.num_threads=4")
    _assert_zero_mismatch(steps)


def _assert_zero_mismatch(steps: list[dict]) -> None:
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        for key in MISMATCH:
            assert m[key] == 0, f"step {m['step']}: {key} = {m[key]!r}"
