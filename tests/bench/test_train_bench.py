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

@pytest.mark.slow
@pytest.mark.megatron
def test_k31_layer_structure_builds_the_trainer_from_one_expert_matrix_and_trains(monkeypatch):
    """The k31-layer path of `zmrl bench train`, its structure shrunk to the tiny dims (1 layer, no
    dense layer, NoPE, 56 experts top-8 (k31's 896 / 16), 2 shared experts): the routed experts share one random
    matrix per projection (expanded: the weights hold no per-expert copy), the trainer's stacked
    expert parameters hold that matrix for every expert, and the timed passes run."""
    import argparse

    import torch

    import zmrl.bench.train_throughput as bench
    from zmrl.lora import LoraConfig
    from zmrl.model.config import ModelConfig
    from zmrl.model.layers import param_shapes
    from zmrl.model.presets import PRESETS
    from zmrl.trainer.megatron import MegatronTrainer

    cfg = ModelConfig(**{**PRESETS["tiny"], "num_hidden_layers": 1, "first_k_dense_replace": 0,
                         "qk_rope_head_dim": 0, "n_routed_experts": 56, "num_experts_per_tok": 8,
                         "n_shared_experts": 2})
    monkeypatch.setattr(bench, "SHARED_EXPERT_BYTES", 0)
    weights, shared = bench.random_weights(cfg, torch.float32, seed=0, device=torch.device("cpu"))
    assert shared
    gate_up = weights["model.layers.0.mlp.experts.gate_up_proj"]
    one_matrix = 2 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    assert gate_up.untyped_storage().nbytes() == one_matrix  # not E copies
    # the control: the experts materialized would be E matrices
    assert gate_up.contiguous().untyped_storage().nbytes() == cfg.n_routed_experts * one_matrix

    trainer = MegatronTrainer(cfg, weights, LoraConfig(r=4, lora_alpha=8.0), seed=0)  # where time_zmrl builds it
    experts = trainer.model.mlp(0).experts
    assert torch.equal(experts.linear_fc1.weight.cpu(), gate_up)
    assert torch.equal(experts.linear_fc2.weight.cpu(), weights["model.layers.0.mlp.experts.down_proj"])
    del trainer

    prompts, completions = bench.make_batch(cfg, 2, 12, 6, seed=0)
    args = argparse.Namespace(seed=0, warmup=0, iters=1)
    times, base_params = bench.time_zmrl(cfg, weights, 4, prompts, completions, args, torch.device("cpu"))
    assert set(times) == {"on", "off"} and all(t > 0 for pair in times.values() for t in pair)
    router_bias = cfg.n_routed_experts  # a buffer, not a parameter
    assert base_params == sum(torch.Size(s).numel() for s in param_shapes(cfg).values()) - router_bias


def test_varied_calls_never_repeat_a_token_count_and_scale_to_the_whole_batch(monkeypatch):
    import itertools

    import torch

    from zmrl.bench import train_throughput
    from zmrl.bench.train_throughput import Calls, time_calls

    lengths = (5, 9, 11, 20)
    varied, same = Calls(lengths, True), Calls(lengths, False)
    runs = [varied.sequences(i) for i in range(4)]
    assert all(len(r) == 3 for r in runs) and len({tuple(r) for r in runs}) == 4  # another one left out each call
    assert sorted(sum(lengths[j] for j in r) for r in runs) == [25, 34, 36, 40]  # four token counts
    assert varied.sequences(4) == varied.sequences(0)
    assert same.sequences(3) == [0, 1, 2, 3] and same.share(3) == 1.0
    assert varied.share(0) == 40 / 45
    # each call's time divided by its share: a call over 40 of 45 tokens counts as 45 tokens' time
    clock = itertools.count()  # every call takes one second by this clock
    monkeypatch.setattr(train_throughput.time, "perf_counter", lambda: float(next(clock)))
    seen = []
    t = time_calls(seen.append, 1, 3, torch.device("cpu"), {0: 0.0, 1: 0.5, 2: 0.25, 3: 0.5}.get)
    assert seen == [0, 1, 2, 3] and t == 2.0  # warm-up call 0 untimed; 1 s over half the tokens: 2 s a batch
    assert time_calls(seen.append, 0, 3, torch.device("cpu")) == 1.0  # unscaled without shares


def test_interleaved_calls_run_call_i_of_every_system_back_to_back(monkeypatch):
    import itertools

    import torch

    from zmrl.bench import train_throughput

    clock = itertools.count()
    monkeypatch.setattr(train_throughput.time, "perf_counter", lambda: float(next(clock)))
    seen = []
    fns = {name: (lambda i, name=name: seen.append((name, i))) for name in ("baseline", "on")}
    times = train_throughput.interleaved_times(fns, 1, 2, torch.device("cpu"), {1: 0.5, 2: 1.0}.get)
    assert seen == [("baseline", 0), ("on", 0), ("baseline", 1), ("on", 1), ("baseline", 2), ("on", 2)]
    assert times == {"baseline": [2.0, 1.0], "on": [2.0, 1.0]}  # 1 s each, call 1 over half the tokens
    # negative control: the sequential timer runs every call of one system first
    seen.clear()
    train_throughput.time_calls(fns["baseline"], 1, 2, torch.device("cpu"))
    train_throughput.time_calls(fns["on"], 1, 2, torch.device("cpu"))
    assert seen == [("baseline", 0), ("baseline", 1), ("baseline", 2), ("on", 0), ("on", 1), ("on", 2)]


@pytest.mark.slow
@pytest.mark.megatron
def test_bench_train_interleaved_prints_rows_and_paired_ratios(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "zmrl.cli", "bench", "train", "--preset", "tiny", "--num-seqs", "4",
           "--prompt-len", "24", "--completion-len", "12", "--warmup", "1", "--iters", "2", "--device", "cpu",
           "--systems", "baseline,on", "--interleave", "--vary-batches"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for row in ("| zmrl, invariance on |", "| transformers DeepseekV3 + PEFT |", "ratio zmrl on / baseline",
                "paired ratio zmrl, invariance on / baseline, call by call", "--interleave: call i of every system"):
        assert row in out, f"missing {row!r} in:\n{out}"
    assert out.count("| zmrl, invariance on |") == 1  # timed once, not again sequentially
    paired = next(line for line in out.splitlines() if line.startswith("paired ratio"))
    assert paired.count(",") >= 2  # two timed calls per pass
