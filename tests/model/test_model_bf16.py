"""bf16 above the kernels: the tiny preset stored in bf16 (`zmrl init-model --dtype bfloat16`) gives
the same bits in every in-process host, as fp32 does (tests/model, tests/lora): a sequence's logits
alone equal its logits in a padded batch of mixed lengths past index_topk, prefill-then-decode equals
the full forward, and the transformers host, the reference rollout engine and the reference trainer
agree token for token; all of it for the base model and with a nonzero LoRA adapter.

Negative controls differ from the checks only by what is under test, a GEMM whose arithmetic
depends on the batch: torch's own bf16 kernels cannot serve here, because on this CPU they give
the tiny model the same bits alone and in a batch (checked: batch vs alone and decode vs prefill
equal on the "torch" path; its GEMMs accumulate in fp32 and the bf16 rounding hides the order),
so the control splits each GEMM's K dimension into a number of parts that grows with the row
count, as split-K GPU GEMMs do, and shows the checks then fail."""
import pytest
import torch

from tests.bitwise import first_difference as first_diff
from tests.model.test_invariance import LENGTHS, _decode_logits, _padded, _seqs
from zmrl.lora import LoraAdapter, LoraConfig

T = 0.8


@pytest.fixture(scope="module")
def bf16_model(tiny_bf16_dir):
    import zmrl.model.hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_bf16_dir).eval()
    assert model.zcfg.torch_dtype == "bfloat16" and model.model.embed_tokens.weight.dtype == torch.bfloat16
    return model


def _split_k_linear(monkeypatch):
    """The model's base GEMMs with K split into 1 part for <= 8 rows, 2 up to 64, 3 beyond, each
    part's product rounded to bf16 before the parts are summed: batch-variant by construction."""
    import zmrl.batch_invariant.collectives as collectives
    import zmrl.model.projections as projections

    def linear(x, w):
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        parts = torch.tensor_split(torch.arange(x.shape[-1]), 1 + (rows > 8) + (rows > 64))
        out = x[..., parts[0]] @ w[:, parts[0]].t()
        for k in parts[1:]:
            out = out + x[..., k] @ w[:, k].t()
        return out

    # every model GEMM goes through one of these names (projections' own and the canonical-leaf
    # GEMMs of zmrl.batch_invariant.collectives)
    monkeypatch.setattr(projections, "linear", linear)
    monkeypatch.setattr(collectives, "linear", linear)


def random_adapter(cfg, seed=1, r=4) -> LoraAdapter:
    """Nonzero A and B in the model's dtype (as the rollout side holds a trained adapter)."""
    adapter = LoraAdapter(cfg, LoraConfig(r=r, lora_alpha=8), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    return adapter.requires_grad_(False)


@pytest.fixture(scope="module", params=["base", "lora"])
def adapter(request, bf16_model):
    return None if request.param == "base" else random_adapter(bf16_model.zcfg)


def _batch_and_alone(model, seqs, adapter):
    ids, mask = _padded(seqs, model.zcfg.pad_token_id, left=True)
    with torch.no_grad():
        batch = model(ids, mask, adapter=adapter).logits
        return [(batch[b][mask[b].bool()], model(s[None], adapter=adapter).logits[0]) for b, s in enumerate(seqs)]


def test_bf16_logits_are_bf16_and_not_the_fp32_models(bf16_model, tiny_model):
    seq = _seqs(bf16_model.zcfg.vocab_size, [30])[0][None]
    with torch.no_grad():
        bf16, fp32 = bf16_model(seq).logits, tiny_model(seq).logits
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert not torch.equal(bf16.float(), fp32), "the bf16 model computed in fp32"


def test_bf16_padded_batch_logits_equal_alone(bf16_model, adapter):
    seqs = _seqs(bf16_model.zcfg.vocab_size)
    assert max(LENGTHS) > bf16_model.zcfg.index_topk
    for b, (got, alone) in enumerate(_batch_and_alone(bf16_model, seqs, adapter)):
        assert torch.equal(got, alone), f"sequence {b} (length {len(seqs[b])}): {first_diff(got, alone)}"


def test_bf16_padded_batch_negative_control(bf16_model, adapter, monkeypatch):
    _split_k_linear(monkeypatch)
    pairs = _batch_and_alone(bf16_model, _seqs(bf16_model.zcfg.vocab_size), adapter)
    assert any(not torch.equal(got, alone) for got, alone in pairs), \
        "a batch-variant GEMM gave identical bf16 logits: this test cannot detect batch variance"


def test_bf16_prefill_then_decode_equals_full_sequence(bf16_model, adapter):
    seq = _seqs(bf16_model.zcfg.vocab_size, [40])[0]
    bf16_model.set_adapter(adapter)
    try:
        with torch.no_grad():
            full = bf16_model(seq[None]).logits[0]
            for prefill in (1, 20):
                dec = _decode_logits(bf16_model, seq, prefill)
                assert torch.equal(dec, full), f"prefill={prefill}: {first_diff(dec, full)}"
    finally:
        bf16_model.set_adapter(None)


def test_bf16_prefill_decode_negative_control(bf16_model, adapter, monkeypatch):
    _split_k_linear(monkeypatch)
    seq = _seqs(bf16_model.zcfg.vocab_size, [40])[0]
    bf16_model.set_adapter(adapter)
    try:
        with torch.no_grad():
            full = bf16_model(seq[None]).logits[0]
            dec = _decode_logits(bf16_model, seq, 7)
    finally:
        bf16_model.set_adapter(None)
    assert not torch.equal(dec, full), "a batch-variant GEMM: bf16 decode equals prefill, the control detects nothing"


def test_bf16_transformers_host_reference_engine_and_trainer_agree(bf16_model, tiny_bf16_dir, adapter):
    """One packed trainer call over mixed lengths == the reference engine's per-sequence score ==
    log_softmax of the transformers host's logits in a padded batch."""
    from zmrl.model.logprobs import token_logprobs
    from zmrl.rollout.reference import ReferenceEngine
    from zmrl.trainer.reference import ReferenceTrainer

    cfg = bf16_model.zcfg
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 21, 40)]
    completions = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in (12, 5, 9)]
    trainer = ReferenceTrainer.from_dir(tiny_bf16_dir, LoraConfig(r=4, lora_alpha=8), seed=0)
    engine = ReferenceEngine.from_dir(tiny_bf16_dir)
    if adapter is not None:
        with torch.no_grad():
            for k, p in trainer.adapter.factors.items():
                p.copy_(adapter.factors[k])
        engine.projections = adapter.projections
    assert trainer.weights["lm_head.weight"].dtype == torch.bfloat16
    got = trainer.logprobs(prompts, completions, temperature=T, adapter=adapter is not None)
    seqs = [torch.tensor(p + c) for p, c in zip(prompts, completions)]
    ids, mask = _padded(seqs, cfg.pad_token_id, left=False)
    with torch.no_grad():
        logits = bf16_model(ids, mask, adapter=adapter).logits
    for i, (p, c) in enumerate(zip(prompts, completions)):
        want = engine.score(p, c, T)
        assert torch.equal(got[i], want), f"sequence {i}: trainer vs engine: {first_diff(got[i], want)}"
        host = token_logprobs(logits[i, len(p) - 1:len(p) + len(c) - 1], torch.tensor(c), T)
        assert torch.equal(host, want), f"sequence {i}: transformers host vs engine: {first_diff(host, want)}"
