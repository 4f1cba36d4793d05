"""Megatron's recomputed log-probs equal vLLM's rollout log-probs bit for bit: for sampled
completions of mixed-length prompts (contexts past index_topk), and after LoRA updates pushed to
the engine through its weight-sync API. Uses the session's one vLLM engine (tests/conftest.py)."""
import pytest
import torch

from tests.bitwise import first_difference as first_diff
from tests.trainer.megatron.conftest import T
from zmrl.commands.check import check
from zmrl.trainer.base import TrainBatch, UpdateSettings

pytestmark = [pytest.mark.megatron, pytest.mark.vllm]


def _rollout(engine, prompts, seed, max_tokens=20):
    samples = engine.generate(prompts, n=2, max_tokens=max_tokens, temperature=T, seed=seed)
    flat = [s for ss in samples for s in ss]
    return [p for p, ss in zip(prompts, samples) for _ in ss], flat


def _assert_equal(mt, prompts, flat):
    got = mt.logprobs(prompts, [s.token_ids for s in flat], temperature=T)
    for i, (lp, s) in enumerate(zip(got, flat)):
        assert torch.equal(lp, s.logprobs), f"sample {i} (prompt {len(prompts[i])}): {first_diff(lp, s.logprobs)}"


def test_logprobs_equal_vllm_rollout_bitwise(engine, mt, prompt_ids):
    prompts, flat = _rollout(engine, prompt_ids, seed=0)
    assert max(len(p) + len(s.token_ids) for p, s in zip(prompts, flat)) > mt.cfg.index_topk
    _assert_equal(mt, prompts, flat)


def test_logprobs_equal_vllm_after_lora_updates(engine, mt, prompt_ids):
    prompts, flat = _rollout(engine, prompt_ids, seed=1, max_tokens=12)
    settings = UpdateSettings(lr=1e-2, temperature=T)
    batch = TrainBatch(prompts=prompts, completions=[s.token_ids for s in flat],
                       old_logprobs=[s.logprobs for s in flat], advantages=torch.linspace(-1.0, 1.0, len(flat)))
    metrics = mt.train_step(batch, settings, step=0)
    assert metrics["mismatch/ratio_first_minibatch_max_abs_dev"] == 0.0  # rollout == trainer before the step
    tensors = mt.adapter_tensors()
    assert max(float(t.abs().max()) for k, t in tensors.items() if k.endswith("__B")) > 0
    engine.set_adapter(mt.lora)
    try:
        engine.sync_weights({"lora:" + k: v for k, v in tensors.items()})
        prompts, flat = _rollout(engine, prompt_ids, seed=2, max_tokens=12)
        _assert_equal(mt, prompts, flat)
    finally:
        engine.set_adapter(None)


def test_zmrl_check_with_the_megatron_trainer(engine, model_dir):
    prompts = ["What is 12 + 30? The answer is", "Compute 7 * 8 = 56. Therefore 56 - 6 equals, step by step,"]
    report = check(model_dir, prompts, engine=engine, trainer="megatron", n=2, max_tokens=10, temperature=T, seed=0)
    assert report["trainer"] == "megatron" and report["total_tokens"] > 0
    assert (report["differing_tokens"], report["max_abs_diff"], report["kl_k1"]) == (0, 0.0, 0.0)
