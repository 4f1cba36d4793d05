"""Invariance of the host's logits: padded batches, prefill vs decode, sparse selection."""
import pytest
import torch

from zmrl.batch_invariant import batch_invariant_mode
from zmrl.model.packed import forward_packed, split_layer_weights
from tests.bitwise import first_difference as first_diff

LENGTHS = [5, 41, 23, 1]  # 41 and 23 exceed index_topk=16: selection is really sparse


def _seqs(vocab, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g) for n in lengths]


def _padded(seqs, pad, left):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        ids[b, sl], mask[b, sl] = s, 1
    return ids, mask


def _plain_torch_linear(monkeypatch):
    """Negative control: the model's GEMMs through torch's default (batch-variant) matmul. The
    controls run under `batch_invariant_mode(False)`: an in-process vLLM engine started by an
    earlier test switches zmrl's aten overrides on, and `x @ w.t()` would then be invariant too."""
    import zmrl.batch_invariant.collectives as collectives
    import zmrl.lora.adapter as adapter
    import zmrl.model.projections as projections

    # every model GEMM goes through one of these names (projections' own, the canonical leaf GEMMs
    # of zmrl.batch_invariant.collectives, and a LoRA adapter's expert GEMMs)
    for module in (projections, collectives, adapter):
        monkeypatch.setattr(module, "linear", lambda x, w: x @ w.t())


@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
def test_padded_batch_logits_equal_alone(tiny_model, left):
    cfg = tiny_model.zcfg
    seqs = _seqs(cfg.vocab_size)
    ids, mask = _padded(seqs, cfg.pad_token_id, left)
    with torch.no_grad():
        batch = tiny_model(ids, mask).logits
        for b, s in enumerate(seqs):
            alone = tiny_model(s[None]).logits[0]
            got = batch[b][mask[b].bool()]
            assert torch.equal(got, alone), f"sequence {b} (length {len(s)}): {first_diff(got, alone)}"


def test_padded_batch_negative_control(tiny_model, monkeypatch):
    _plain_torch_linear(monkeypatch)
    seqs = _seqs(tiny_model.zcfg.vocab_size)
    ids, mask = _padded(seqs, tiny_model.zcfg.pad_token_id, left=False)
    with torch.no_grad(), batch_invariant_mode(False):
        batch = tiny_model(ids, mask).logits
        differs = [not torch.equal(batch[b][mask[b].bool()], tiny_model(s[None]).logits[0])
                   for b, s in enumerate(seqs)]
    assert any(differs), "plain torch matmul gave identical logits: this test cannot detect batch variance"


def _decode_logits(model, seq, prefill):
    out = model(seq[None, :prefill], use_cache=True)
    rows, caches = [out.logits[0]], out.past_key_values
    for t in range(prefill, len(seq)):
        step = model(seq[None, t:t + 1], past_key_values=caches, use_cache=True)
        rows.append(step.logits[0])
    return torch.cat(rows)


def test_prefill_then_decode_equals_full_sequence(tiny_model):
    seq = _seqs(tiny_model.zcfg.vocab_size, [40])[0]
    with torch.no_grad():
        full = tiny_model(seq[None]).logits[0]
        for prefill in (1, 7, 20):
            dec = _decode_logits(tiny_model, seq, prefill)
            for t in range(len(seq)):
                assert torch.equal(dec[t], full[t]), f"prefill={prefill}, position {t}: {first_diff(dec[t], full[t])}"


def test_prefill_decode_negative_control(tiny_model, monkeypatch):
    _plain_torch_linear(monkeypatch)
    seq = _seqs(tiny_model.zcfg.vocab_size, [40])[0]
    with torch.no_grad(), batch_invariant_mode(False):
        full = tiny_model(seq[None]).logits[0]
        dec = _decode_logits(tiny_model, seq, 7)
    assert not torch.equal(dec, full), "plain torch matmul: decode equals prefill, the control detects nothing"


def test_generate_uses_cache_and_matches_full_forward(tiny_model):
    """zmrl's generate: the prompt in one forward, then one token per forward through the cache; each
    step's logits are the full forward's at that position, bit for bit."""
    seq = _seqs(tiny_model.zcfg.vocab_size, [20])[0]
    calls = []  # (tokens fed, logits of the last position) per forward

    def record(module, args, output):
        calls.append((args[0].shape[1], output.logits[0, -1]))

    hook = tiny_model.register_forward_hook(record)
    try:
        with torch.no_grad():
            out = tiny_model.generate(seq[None], max_new_tokens=6, eos_token_id=-1)
    finally:
        hook.remove()
    assert [n for n, _ in calls][:6] == [20, 1, 1, 1, 1, 1]
    with torch.no_grad():
        full = tiny_model(out[:, :-1]).logits[0]
    steps = torch.stack([logits for _, logits in calls[:6]])
    assert torch.equal(steps, full[19:]), first_diff(steps, full[19:])
    assert torch.equal(out[0, 20:], full[19:].argmax(-1))


def test_sparse_selection_is_exercised_and_differs_from_dense(tiny_model):
    cfg = tiny_model.zcfg
    w_model, w_layers = tiny_model.weight_maps()
    seq = _seqs(cfg.vocab_size, [40])[0]
    selections = []
    with torch.no_grad():
        sparse = forward_packed(cfg, w_model, w_layers, [seq], selections=selections)[0]
        import dataclasses
        dense_cfg = dataclasses.replace(cfg, index_topk=1024)
        dense = forward_packed(dense_cfg, w_model, w_layers, [seq])[0]
    for layer, _, idx in selections:
        assert idx.shape == (40, cfg.index_topk)
        valid = (idx >= 0).sum(-1)
        assert torch.equal(valid, torch.arange(1, 41).clamp(max=cfg.index_topk)), f"layer {layer}"
        # some late query skipped an earlier token: the selection is really sparse
        assert not bool((idx[39] == torch.arange(16)).all()), f"layer {layer} selected a trivial prefix"
    assert torch.equal(sparse[:16], dense[:16]), "up to index_topk tokens the selection is dense"
    assert not torch.equal(sparse[16:], dense[16:]), "sparse selection gave the dense logits"


def _nope_decode_and_prefill():
    """The no-RoPE variant (qk_rope_head_dim = 0): its logits decoded after a 5-token prefill, and
    from one full-sequence forward."""
    import dataclasses

    from zmrl.model.layers import init_weights
    from zmrl.model.packed import SequenceCache
    from zmrl.model.presets import PRESETS
    from zmrl.model.config import ModelConfig

    cfg = dataclasses.replace(ModelConfig(**PRESETS["tiny"]), qk_rope_head_dim=0)
    w = init_weights(cfg, seed=1)
    w_layers = split_layer_weights(cfg, w)
    seq = _seqs(cfg.vocab_size, [24])[0]
    with torch.no_grad():
        full = forward_packed(cfg, w, w_layers, [seq])[0]
        cache = SequenceCache(cfg.num_hidden_layers)
        rows = forward_packed(cfg, w, w_layers, [seq[:5]], [cache])
        for t in range(5, 24):
            rows += forward_packed(cfg, w, w_layers, [seq[t:t + 1]], [cache])
    return torch.cat(rows), full


def test_nope_variant_decode_equals_prefill():
    decoded, full = _nope_decode_and_prefill()
    assert torch.equal(decoded, full), first_diff(decoded, full)


def test_nope_variant_negative_control(monkeypatch):
    _plain_torch_linear(monkeypatch)
    with batch_invariant_mode(False):
        decoded, full = _nope_decode_and_prefill()
    assert not torch.equal(decoded, full), "plain torch matmul: decode equals prefill, the control detects nothing"
