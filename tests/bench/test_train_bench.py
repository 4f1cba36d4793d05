"""`zmrl bench train` runs end to end on CPU (tiny preset, one timed iteration): every row and
ratio is printed and the command exits 0. No timing is asserted."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.megatron
def test_bench_train_prints_every_row_on_the_tiny_preset(tmp_path):
    # a `vllm` that cannot be imported shadows the real one: the GPU machine has no vllm
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('zmrl bench train must not import vllm')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "zmrl.cli", "bench", "train", "--preset", "tiny", "--num-seqs", "4",
           "--prompt-len", "24", "--completion-len", "12", "--warmup", "0", "--iters", "1", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for row in ("| zmrl, invariance on |", "| zmrl, invariance off |", "| transformers DeepseekV3 + PEFT |",
                "ratio invariance on / off", "ratio zmrl on / baseline", "zmrl without the indexer equals transformers",
                "1 timed iteration"):
        assert row in out, f"missing {row!r} in:\n{out}"


def test_flop_count_of_a_dense_one_layer_model_by_hand():
    from zmrl.bench.train_flops import count_flops
    from zmrl.model.config import ModelConfig
    from zmrl.model.presets import PRESETS

    cfg = ModelConfig(**{**PRESETS["tiny"], "num_hidden_layers": 1, "first_k_dense_replace": 1})
    f = count_flops(cfg, [3], lora_r=0, lora_on_experts=False, absorbed_sparse=False)
    d, q, c, r, h, n, v = 128, 64, 64, 16, 4, 32, 32
    per_token = d * q + q * h * (n + r) + d * (c + r) + h * v * d + c * h * (n + v) + 3 * d * 256 + d * 512
    assert f.gemm == 2 * 3 * per_token
    assert f.attention == 2 * (1 + 2 + 3) * (h * (n + r) + h * v)  # causal: 1, 2, 3 keys
    assert f.lora == 0 and f.train == f.forward + f.gemm + 2 * f.attention


def test_systems_option_is_checked_and_keeps_its_order():
    from zmrl.bench.train_throughput import parse_systems

    assert parse_systems("off, baseline") == ["off", "baseline"]
    assert parse_systems("baseline,on,off", skip_baseline=True) == ["on", "off"]
    for bad in ("on,on", "fast", "", "baseline,gpu"):
        with pytest.raises(ValueError, match="--systems must list"):
            parse_systems(bad)
    with pytest.raises(ValueError, match="leaves nothing"):
        parse_systems("baseline", skip_baseline=True)
