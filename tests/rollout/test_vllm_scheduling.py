"""The log-prob of a sampled token does not depend on when its request arrived or on vLLM
preempting it and recomputing its context (docs/design.md, "The numerics contract").

Both tests drive vLLM's scheduler for real on the session engine: requests are added between
engine steps (so they join a batch already decoding), and the KV pool (conftest.KV_BLOCKS) is
small enough that a few long requests force vLLM 0.32's scheduler to preempt the newest running
request (free its blocks, re-queue it, prefill its prompt + generated tokens again).
"""
import pytest
import torch

import zmrl.batch_invariant as bi
from zmrl.rollout.vllm.engine import sampling_params, to_sample

pytestmark = pytest.mark.vllm

T = 0.8


def _assert_equal_to_reference(reference, prompts, samples):
    bi.enable()  # the trainer runs with the aten overrides on, as the engine's process does
    for i, (prompt, s) in enumerate(zip(prompts, samples)):
        ref = reference.score(prompt, s.token_ids, T)
        if not torch.equal(ref, s.logprobs):
            k = int((ref != s.logprobs).nonzero()[0])
            pytest.fail(f"request {i}, token {k}: vllm {float(s.logprobs[k])!r} != reference {float(ref[k])!r}")


def _staggered(engine, prompts, arrive_at, seeds, max_tokens):
    """Add request i before engine step arrive_at[i] -> Samples in request order."""
    llm = engine.llm.llm_engine
    done, step = {}, 0
    pending = sorted(range(len(prompts)), key=lambda i: arrive_at[i])
    while pending or llm.has_unfinished_requests():
        while pending and arrive_at[pending[0]] <= step:
            i = pending.pop(0)
            llm.add_request(f"stagger-{step}-{i}", {"prompt_token_ids": prompts[i]},
                            sampling_params(max_tokens, T, seeds[i]))
        for out in llm.step():
            if out.finished:
                done[int(out.request_id.rsplit("-", 1)[1])] = to_sample(out)
        step += 1
    return [done[i] for i in range(len(prompts))]


def test_logprobs_do_not_depend_on_arrival_order(engine, reference, prompts):
    batch = prompts[1:]  # 21, 40, 100, 150 tokens: chunked prefills overlap other requests' decodes
    seeds = [101, 102, 103, 104]
    runs = [_staggered(engine, batch, arrive, seeds, max_tokens=10)
            for arrive in ([0, 0, 0, 0], [0, 2, 4, 6], [6, 4, 2, 0], [3, 0, 5, 1])]
    for samples in runs:
        _assert_equal_to_reference(reference, batch, samples)
    # per-request seeds and invariant logits: the same tokens and bits whatever the arrival order
    for samples in runs[1:]:
        for a, b in zip(runs[0], samples):
            assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)


@pytest.fixture
def preemptions(engine):
    """Counts vLLM's preemptions while the test runs (the in-process EngineCore's scheduler)."""
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    original = scheduler._preempt_request
    count = [0]

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    scheduler._preempt_request = counting
    yield count
    scheduler._preempt_request = original


def test_logprobs_survive_preemption_and_recompute(engine, reference, preemptions):
    gen = torch.Generator().manual_seed(11)
    # 6 distinct prompts (no shared prefix blocks) of 120 tokens growing to 160: ~60 blocks > 48
    batch = [torch.randint(2, 512, (120,), generator=gen).tolist() for _ in range(6)]
    outputs = engine.generate(batch, n=1, max_tokens=40, temperature=T, seed=5, stop_at_eos=False)
    assert preemptions[0] > 0, "no request was preempted: the pool is not small enough to test this"
    _assert_equal_to_reference(reference, batch, [ss[0] for ss in outputs])
