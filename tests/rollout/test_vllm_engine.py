"""vLLM's reported log-probs are the trainer's, bit for bit (DESIGN.md section 2).

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
    with pytest.raises(ValueError):
        engine.generate(prompts[:1], n=0)
    with pytest.raises(ValueError):
        engine.generate([[]], n=1)
    with pytest.raises(Exception, match="does not fit"):
        engine.sync_weights({"lm_head.weight": torch.zeros(3, 3)})
    outputs = engine.generate(prompts[1:2], n=1, max_tokens=4, temperature=T, seed=0)
    assert _mismatches(reference, prompts[1:2], outputs, T) == []


def test_negative_control_invariance_off_differs(engine, reference, prompts):
    """With default torch kernels in the engine (MKL picks its algorithm by row count, so decode
    rows differ from prefill rows), the same comparison must fail: the test above proves something."""
    engine.set_batch_invariant(False)
    try:
        outputs = engine.generate(prompts, n=1, max_tokens=8, temperature=T, seed=0)
    finally:
        engine.set_batch_invariant(True)
    bad = _mismatches(reference, prompts, outputs, T)
    assert len(bad) > 0, "invariance off still matched bitwise: the positive tests prove nothing"


def test_logprobs_equal_reference_after_lora_sync(engine, reference, prompts):
    from zmrl.lora import LoraAdapter, LoraConfig
    from zmrl.rollout.reference import ReferenceEngine

    lcfg = LoraConfig(r=4, lora_alpha=8.0)  # attention, indexer, every routed expert, shared expert
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
