"""bf16 through vLLM and Megatron: with the tiny model stored in bf16 (`zmrl init-model --dtype
bfloat16`), the log-prob vLLM reports for every sampled token equals the reference host's and the
Megatron trainer's, bit for bit, for prompts of mixed lengths past index_topk (chunked prefill: the
session engine's budget is 48 tokens), for the base model and with a nonzero LoRA adapter synced
into the engine; and `zmrl check` passes for every rollout/trainer pair.

These tests share the session's one engine (tests/conftest.py `engines`), which serves the bf16
model while they run."""
import pytest
import torch

import zmrl.batch_invariant as bi
from tests.bitwise import first_difference as first_diff
from zmrl.commands.check import check

pytestmark = [pytest.mark.vllm, pytest.mark.megatron]

T = 0.8
PAIRS = [(r, t) for r in ("vllm", "reference") for t in ("reference", "megatron")]
CHECK_PROMPTS = ["What is 12 + 30? The answer is",
                 "Compute 7 * 8 = 56. Therefore 56 - 6 equals, step by step, then 3 + 4 is",
                 "1+34\n1+56\n1+23\n1+78\n1+7"]


@pytest.fixture(scope="module")
def bf16_prompts():
    gen = torch.Generator().manual_seed(17)
    # 3 < index_topk = 16 < the rest; 100 exceeds the engine's 48-token budget (chunked prefill)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 21, 40, 100)]


@pytest.fixture(scope="module")
def bf16_adapter(tiny_bf16_dir):
    """A nonzero canonical adapter in bf16 (every factor random, B included)."""
    from zmrl.lora import LoraAdapter, LoraConfig
    from zmrl.model.checkpoint import read_config

    adapter = LoraAdapter(read_config(tiny_bf16_dir), LoraConfig(r=4, lora_alpha=8.0), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(23)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
    return adapter.requires_grad_(False)


@pytest.fixture(scope="module")
def bf16_megatron(tiny_bf16_dir, bf16_adapter):
    from zmrl.trainer.megatron import MegatronTrainer

    return MegatronTrainer.from_dir(tiny_bf16_dir, bf16_adapter.lcfg, seed=0)


def _rollout(engine, prompts, seed):
    samples = engine.generate(prompts, n=2, max_tokens=12, temperature=T, seed=seed)
    flat = [s for ss in samples for s in ss]
    assert all(s.logprobs.dtype == torch.float32 for s in flat)
    return [p for p, ss in zip(prompts, samples) for _ in ss], flat


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "lora"])
def test_bf16_vllm_equals_reference_and_megatron(bf16_engine, tiny_bf16_dir, bf16_prompts, bf16_adapter,
                                                 bf16_megatron, with_adapter):
    from zmrl.rollout.reference import ReferenceEngine

    assert bf16_engine.model_config.torch_dtype == "bfloat16"
    reference = ReferenceEngine.from_dir(tiny_bf16_dir)
    if with_adapter:
        reference.projections = bf16_adapter.projections
        bf16_megatron.load_adapter_tensors(dict(bf16_adapter.factors.items()))
        bf16_engine.set_adapter(bf16_adapter.lcfg)
        bf16_engine.sync_weights(adapter=bf16_adapter)
    try:
        prompts, flat = _rollout(bf16_engine, bf16_prompts, seed=5)
        # the same prompts in another batch composition: the long one alone, then reversed
        alone_p, alone = _rollout(bf16_engine, bf16_prompts[3:], seed=6)
        rev_p, rev = _rollout(bf16_engine, bf16_prompts[::-1], seed=7)
    finally:
        if with_adapter:
            bf16_engine.set_adapter(None)
    prompts, flat = prompts + alone_p + rev_p, flat + alone + rev
    assert max(len(p) for p in prompts) > 48 and min(len(p) for p in prompts) < 16
    bi.enable()  # the trainer side runs with the aten overrides on, as the engine's process does
    megatron = bf16_megatron.logprobs(prompts, [s.token_ids for s in flat], temperature=T, adapter=with_adapter)
    for i, (p, s) in enumerate(zip(prompts, flat)):
        want = reference.score(p, s.token_ids, T)
        assert torch.equal(s.logprobs, want), f"sample {i} (prompt {len(p)}): vllm vs reference: " \
                                             f"{first_diff(s.logprobs, want)}"
        assert torch.equal(megatron[i], want), f"sample {i}: megatron vs reference: {first_diff(megatron[i], want)}"
    if with_adapter:  # the adapter really changed the model
        base = ReferenceEngine.from_dir(tiny_bf16_dir)
        assert any(not torch.equal(base.score(p, s.token_ids, T), s.logprobs) for p, s in zip(prompts, flat))


@pytest.mark.parametrize("rollout, trainer", PAIRS)
def test_bf16_zmrl_check_passes_for_every_pair(bf16_engine, tiny_bf16_dir, rollout, trainer):
    report = check(tiny_bf16_dir, CHECK_PROMPTS, engine=bf16_engine, rollout=rollout, trainer=trainer,
                   n=2, max_tokens=12, temperature=T, seed=0)
    assert report["total_tokens"] > 0
    assert (report["differing_tokens"], report["max_abs_diff"], report["kl_k1"]) == (0, 0.0, 0.0)


@pytest.mark.parametrize("rollout, trainer", PAIRS)
def test_bf16_zmrl_check_with_invariance_off_differs(bf16_engine, tiny_bf16_dir, rollout, trainer):
    """The negative control of the test above: the same call with every op on torch's defaults."""
    report = check(tiny_bf16_dir, CHECK_PROMPTS, engine=bf16_engine, rollout=rollout, trainer=trainer,
                   n=2, max_tokens=12, temperature=T, seed=0, batch_invariant=False)
    assert report["differing_tokens"] > 0, report
    assert bf16_engine.config.batch_invariant is True
