"""vLLM's reported log-probs are the trainer's, bit for bit (docs/design.md, "The numerics contract").

The oracle is ReferenceEngine.score: one full-sequence forward over prompt + completion
(zmrl.model.packed.forward_packed) and log_softmax(logits / T) by zmrl.batch_invariant.
"""
import pytest
import torch

import zmrl.batch_invariant as bi

pytestmark = pytest.mark.vllm

T = 0.8


def _mismatches(reference, prompts, outputs, temperature):
    """-> list of (prompt, sample, first differing index, vllm value, reference value)."""
    bi.enable()  # the trainer runs with the aten overrides on, as the engine's process does
    bad = []
    for i, (prompt, samples) in enumerate(zip(prompts, outputs)):
        for j, s in enumerate(samples):
            ref = reference.score(prompt, s.token_ids, temperature)
            if not torch.equal(ref, s.logprobs):
                k = int((ref != s.logprobs).nonzero()[0])
                bad.append((i, j, k, float(s.logprobs[k]), float(ref[k])))
    return bad


def test_logprobs_equal_reference_in_one_mixed_batch(engine, reference, prompts):
    outputs = engine.generate(prompts, n=2, max_tokens=10, temperature=T, seed=0)
    assert [len(s) for s in outputs] == [2] * len(prompts)
    assert all(len(s.token_ids) == 10 and s.logprobs.dtype == torch.float32 for ss in outputs for s in ss)
    assert _mismatches(reference, prompts, outputs, T) == []


def test_logprobs_equal_reference_alone_and_in_other_batches(engine, reference, prompts):
    # the same long prompt alone, with one short batchmate, and last in a reversed batch
    for batch in ([prompts[4]], [prompts[0], prompts[4]], prompts[::-1], [prompts[3], prompts[2]]):
        outputs = engine.generate(batch, n=1, max_tokens=8, temperature=T, seed=3)
        assert _mismatches(reference, batch, outputs, T) == []


def test_same_seed_same_batch_position_same_tokens(engine, prompts):
    a = engine.generate(prompts[:3], n=1, max_tokens=6, temperature=1.0, seed=11)
    b = engine.generate(prompts[:3], n=1, max_tokens=6, temperature=1.0, seed=11)
    assert [s[0].token_ids for s in a] == [s[0].token_ids for s in b]


def test_greedy_logprobs_use_temperature_one(engine, reference, prompts):
    outputs = engine.generate(prompts[1:4], n=1, max_tokens=6, temperature=0.0, seed=0)
    assert _mismatches(reference, prompts[1:4], outputs, 0.0) == []


def test_logprobs_equal_reference_after_weight_sync(engine, reference, prompts):
    # warm the prefix cache with the old weights, then change them: a stale hit would show
    engine.generate(prompts[3:], n=1, max_tokens=4, temperature=T, seed=0)
    gen = torch.Generator().manual_seed(5)
    names = ["model.layers.0.self_attn.kv_b_proj.weight", "model.layers.2.mlp.experts.gate_up_proj",
             "model.layers.1.self_attn.indexer.wk.weight", "lm_head.weight"]
    old = {k: reference.weights[k].clone() for k in names}
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in old.items()}
    engine.sync_weights(new)
    reference.sync_weights(new)
    try:
        outputs = engine.generate(prompts[3:], n=2, max_tokens=8, temperature=T, seed=1)
        assert _mismatches(reference, prompts[3:], outputs, T) == []
    finally:
        engine.sync_weights(old)
        reference.sync_weights(old)


def test_bad_requests_are_rejected_and_engine_stays_usable(engine, reference, prompts):
    for eng in (engine, reference):  # one rule for both engines, naming the argument
        with pytest.raises(ValueError, match="n must be >= 1"):
            eng.generate(prompts[:1], n=0)
        with pytest.raises(ValueError, match="max_tokens must be >= 1"):
            eng.generate(prompts[:1], max_tokens=0)
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            eng.generate(prompts[:1], temperature=-0.5)
    with pytest.raises(ValueError):
        engine.generate([[]], n=1)
    with pytest.raises(Exception, match="does not fit"):
        engine.sync_weights({"lm_head.weight": torch.zeros(3, 3)})
    outputs = engine.generate(prompts[1:2], n=1, max_tokens=4, temperature=T, seed=0)
    assert _mismatches(reference, prompts[1:2], outputs, T) == []


def _batched_vs_alone(engine, prompts, max_tokens: int = 8) -> list[int]:
    """The prompts whose greedy completion (tokens or log-probs) differs between one call holding
    every prompt and a call holding that prompt alone. Greedy, so that no sampling seed depends on
    the prompt's place in the call; the prefix cache is dropped before every call, so each call
    computes all of its prompts itself."""
    def run(batch):
        engine.llm.reset_prefix_cache()
        out = engine.generate(batch, n=1, max_tokens=max_tokens, temperature=0.0, stop_at_eos=False)
        return [samples[0] for samples in out]

    together = run(prompts)
    differ = []
    for i, prompt in enumerate(prompts):
        alone = run([prompt])[0]
        if alone.token_ids != together[i].token_ids or not torch.equal(alone.logprobs, together[i].logprobs):
            differ.append(i)
    return differ


def test_completions_do_not_depend_on_the_batch(engine, prompts):
    assert _batched_vs_alone(engine, prompts) == []


def test_negative_control_invariance_off_depends_on_the_batch(engine, prompts):
    """The same comparison with invariance off (default torch kernels in the same engine: MKL
    picks its algorithm by row count, so a prompt's rows get other bits beside other prompts)
    must fail, and only because of the batch: off, one call repeated gives the same bits."""
    engine.set_batch_invariant(False)
    try:
        assert _batched_vs_alone(engine, prompts[-1:]) == [], "off is not even repeatable: the control proves nothing"
        differ = _batched_vs_alone(engine, prompts)
    finally:
        engine.set_batch_invariant(True)
    assert differ, "invariance off still gave each prompt the same bits alone and batched"


def test_logprobs_equal_reference_after_lora_sync(engine, reference, prompts):
    from zmrl.lora import LoraAdapter, LoraConfig
    from zmrl.rollout.reference import ReferenceEngine

    lcfg = LoraConfig(r=4, lora_alpha=8.0)  # every attention projection, routed expert and shared expert
    adapter = LoraAdapter(reference.cfg, lcfg, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in adapter.factors.values():  # nonzero B everywhere: every delta term is live
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    engine.generate(prompts[3:4], n=1, max_tokens=4, temperature=T, seed=0)  # warm the prefix cache
    engine.set_adapter(lcfg)
    engine.sync_weights(adapter=adapter)
    try:
        with_lora = ReferenceEngine(reference.cfg, reference.weights, projections=adapter.projections)
        outputs = engine.generate(prompts[2:], n=2, max_tokens=8, temperature=T, seed=4)
        assert _mismatches(with_lora, prompts[2:], outputs, T) == []
        # and the adapter really changes the log-probs (the sync is not a no-op)
        base = reference.score(prompts[2], outputs[0][0].token_ids, T)
        assert not torch.equal(base, outputs[0][0].logprobs)
    finally:
        engine.set_adapter(None)


def test_adapter_that_does_not_fit_is_rejected_and_engine_stays_usable(engine, reference, prompts):
    from zmrl.lora import LoraAdapter, LoraConfig

    engine.set_adapter(LoraConfig(r=4, lora_alpha=8.0))
    try:
        wrong_rank = LoraAdapter(reference.cfg, LoraConfig(r=8, lora_alpha=8.0), seed=1)
        with pytest.raises(ValueError, match="does not fit"):
            engine.sync_weights(adapter=wrong_rank)
        # nothing was copied: the served adapter's B is still zero, so outputs are the base model's
        outputs = engine.generate(prompts[1:3], n=1, max_tokens=4, temperature=T, seed=0)
        assert _mismatches(reference, prompts[1:3], outputs, T) == []
    finally:
        engine.set_adapter(None)


def test_lora_still_applies_with_invariance_off(engine, reference, prompts):
    """Off swaps kernels, not the model: the served adapter's terms run on the torch path too.
    (Against a reference this is a tolerance check: off is not bitwise by design.)"""
    from zmrl.lora import LoraAdapter, LoraConfig
    from zmrl.rollout.reference import ReferenceEngine

    lcfg = LoraConfig(r=4, lora_alpha=8.0)
    adapter = LoraAdapter(reference.cfg, lcfg, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in adapter.factors.values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)  # large: off-mode noise must not hide it
    engine.set_adapter(lcfg)
    engine.sync_weights(adapter=adapter)
    engine.set_batch_invariant(False)
    try:
        s = engine.generate(prompts[2:3], n=1, max_tokens=6, temperature=T, seed=4)[0][0]
    finally:
        engine.set_batch_invariant(True)
        engine.set_adapter(None)
    bi.enable()
    with_lora = ReferenceEngine(reference.cfg, reference.weights, projections=adapter.projections)
    to_lora = (s.logprobs - with_lora.score(prompts[2], s.token_ids, T)).abs().max()
    to_base = (s.logprobs - reference.score(prompts[2], s.token_ids, T)).abs().max()
    print(f"off-mode log-probs: max |diff| {float(to_lora):.3e} to the LoRA model, {float(to_base):.3e} to the base")
    assert to_lora < to_base / 4


def test_model_dir_that_does_not_match_its_config_is_rejected_before_vllm_starts(tmp_path, model_dir):
    import json
    import shutil
    from pathlib import Path

    from zmrl.rollout.vllm import VllmEngine

    with pytest.raises(FileNotFoundError, match="config.json"):
        VllmEngine(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(Path(model_dir), bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    with pytest.raises(ValueError, match="missing tensors: model.layers.4"):
        VllmEngine(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "vocab_size": 600}))
    with pytest.raises(ValueError, match="tokenizer .* has 512 tokens but config vocab_size is 600"):
        VllmEngine(bad)
