"""vLLM at tensor_parallel_size = 2 (two worker processes over gloo, each holding one TP rank's shard)
serves the TP = 1 bits: the same sampled tokens with the same log-probs as the session's TP = 1
engine, the reference host's log-probs after a base-weight and a LoRA sync (which land on every
worker's shard), and `zmrl check` against the Megatron trainer at TP = 2 passes. The negative
control: with an ordinary all-reduce on both engines, TP = 2 and TP = 1 differ. The same in bf16.

The TP = 2 engine runs in its own process (tests/rollout/vllm_tp_run.py): vLLM spawns its workers,
and one in-process engine (the session's) is all a pytest process may hold.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zmrl.batch_invariant as bi
from tests.rollout.vllm_tp_run import GENERATE, adapter, prompts, synced_weights

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _run_tp2(model_dir, out) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.rollout.vllm_tp_run", str(model_dir), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def tp2(model_dir, tmp_path_factory):
    return _run_tp2(model_dir, tmp_path_factory.mktemp("vllm_tp2") / "tp2.pt")


@pytest.fixture(scope="module")
def tp2_bf16(tiny_bf16_dir, tmp_path_factory):
    return _run_tp2(tiny_bf16_dir, tmp_path_factory.mktemp("vllm_tp2_bf16") / "tp2.pt")


def _differing(a: list, b: list) -> tuple[int, int]:
    """[prompt][n] (token_ids, logprobs) twice -> (sampled tokens whose id or log-prob differ, total)."""
    differing = total = 0
    for sa, sb in zip(a, b, strict=True):
        for (ids_a, lp_a), (ids_b, lp_b) in zip(sa, sb, strict=True):
            total += max(len(ids_a), len(ids_b))
            same = [x == y and torch.equal(p, q) for x, y, p, q in zip(ids_a, ids_b, lp_a, lp_b)]
            differing += same.count(False) + abs(len(ids_a) - len(ids_b))
    return differing, total


def _samples(outputs) -> list:
    return [[(s.token_ids, s.logprobs) for s in ss] for ss in outputs]


def test_tp2_samples_the_tp1_tokens_and_logprobs(tp2, engine):
    differing, total = _differing(tp2["base"], _samples(engine.generate(prompts(), **GENERATE)))
    assert total >= 60 and differing == 0, f"{differing}/{total} sampled tokens differ between vLLM TP 2 and TP 1"


def _ordinary_samples(engine) -> list:
    """The TP = 1 engine's samples with its ordinary all-reduce on (then off again)."""
    engine.set_ordinary_all_reduce(True)
    try:
        return _samples(engine.generate(prompts(), **GENERATE))
    finally:
        engine.set_ordinary_all_reduce(False)


def test_tp2_with_an_ordinary_all_reduce_differs_from_tp1(tp2, engine):
    differing, total = _differing(tp2["ordinary"], _ordinary_samples(engine))
    assert differing > 0, f"with an ordinary all-reduce TP 2 still gave TP 1's bits on all {total} tokens"


def _check_passed(report: dict) -> None:
    assert (report["rollout_tp"], report["trainer_tp"], report["trainer"]) == (2, 2, "megatron")
    assert report["total_tokens"] > 0
    assert (report["differing_tokens"], report["max_abs_diff"], report["kl_k1"]) == (0, 0.0, 0.0)


def test_tp2_check_against_megatron_tp2_passes(tp2):
    _check_passed(tp2["check"])


def test_bf16_tp2_samples_the_tp1_tokens_and_logprobs_and_passes_the_check(tp2_bf16, bf16_engine):
    """The same in bf16 (the tiny model stored in bf16): TP 2 == TP 1, `zmrl check` against Megatron
    at TP 2 passes, and the ordinary all-reduce differs."""
    tp1 = _samples(bf16_engine.generate(prompts(), **GENERATE))
    differing, total = _differing(tp2_bf16["base"], tp1)
    assert total >= 60 and differing == 0, f"{differing}/{total} sampled tokens differ between bf16 TP 2 and TP 1"
    _check_passed(tp2_bf16["check"])
    differing, total = _differing(tp2_bf16["ordinary"], _ordinary_samples(bf16_engine))
    assert differing > 0, f"with an ordinary all-reduce bf16 TP 2 still gave TP 1's bits on all {total} tokens"


def test_tp2_weight_and_lora_sync_land_on_every_shard(tp2, reference):
    """After syncing split weights (o_proj, an expert tensor, the dense down_proj, the LM head) and
    an adapter, every token's log-prob is the reference host's with the same weights and adapter."""
    from zmrl.rollout.reference import ReferenceEngine

    weights = {**reference.weights, **synced_weights(reference.weights)}
    lora = adapter(reference.cfg)
    host = ReferenceEngine(reference.cfg, weights, projections=lora.projections)
    bi.enable()  # the trainer side runs with the aten overrides on, as the engine's workers do
    bad = total = 0
    for prompt, ss in zip(prompts(), tp2["synced"]):
        for ids, lps in ss:
            total += len(ids)
            bad += int((host.score(prompt, ids, GENERATE["temperature"]) != lps).sum())
    assert total > 0 and bad == 0, f"{bad}/{total} log-probs differ from the reference after the syncs"
    # the syncs changed the outputs (neither is a no-op)
    assert _differing(tp2["synced"], tp2["base"])[0] > 0


@pytest.mark.parametrize("tp, message", [
    (3, "rollout.extra.tensor_parallel_size=3 must divide 8"),
    (8, "rollout.extra.tensor_parallel_size=8 must divide the canonical leaves (gcd(8, n)) of every split "
        "dimension; it does not divide those of num_attention_heads=4 (4 leaves)"),
    ("2", "rollout.extra.tensor_parallel_size must be an int >= 1, got '2'"),
])
def test_bad_tensor_parallel_size_is_refused_before_vllm_starts(model_dir, tp, message):
    from zmrl.rollout.vllm import VllmEngine

    with pytest.raises(ValueError) as e:
        VllmEngine(model_dir, extra={"tensor_parallel_size": tp})
    assert message in str(e.value)
