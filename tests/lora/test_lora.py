"""The canonical LoRA: zero adapter is a no-op, invariance holds with an adapter, gradients
reach every expert's factors, PEFT files round-trip and load into the host through peft."""
import pytest
import torch

from tests.bitwise import first_difference as first_diff
from tests.model.test_invariance import _decode_logits, _padded, _seqs
from zmrl.lora import LoraAdapter, LoraConfig, load_peft, save_peft


def _random_adapter(cfg, seed=1, r=4):
    ad = LoraAdapter(cfg, LoraConfig(r=r, lora_alpha=8))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ad.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return ad


def test_fresh_adapter_is_bitwise_noop(tiny_model):
    ad = LoraAdapter(tiny_model.zcfg, LoraConfig(r=4))
    seq = _seqs(tiny_model.zcfg.vocab_size, [30])[0][None]
    with torch.no_grad():
        base, with_ad = tiny_model(seq).logits, tiny_model(seq, adapter=ad).logits
    assert torch.equal(base, with_ad), first_diff(base, with_ad)


def test_composed_expert_path_equals_moe_experts(tiny_model):
    """The adapter's expert path (zero adapter) reproduces the kernel's moe_experts bitwise."""
    from zmrl.model.mlp import _experts_composed, moe_mlp, route
    from zmrl.model.projections import BASE

    cfg = tiny_model.zcfg
    _, w_layers = tiny_model.weight_maps()
    x = torch.randn(37, cfg.hidden_size)
    with torch.no_grad():
        weights, ids = route(cfg, w_layers[1], x)
        composed = _experts_composed(cfg, w_layers[1], x, ids, weights, BASE)
        kernel = moe_mlp(cfg, w_layers[1], x, BASE)
    assert torch.equal(composed, kernel), first_diff(composed, kernel)


def test_adapter_changes_logits_and_keeps_padded_batch_invariance(tiny_model):
    cfg = tiny_model.zcfg
    ad = _random_adapter(cfg)
    seqs = _seqs(cfg.vocab_size, [5, 41, 23])
    ids, mask = _padded(seqs, cfg.pad_token_id, left=True)
    with torch.no_grad():
        batch = tiny_model(ids, mask, adapter=ad).logits
        assert not torch.equal(batch, tiny_model(ids, mask).logits), "the adapter had no effect"
        for b, s in enumerate(seqs):
            alone = tiny_model(s[None], adapter=ad).logits[0]
            got = batch[b][mask[b].bool()]
            assert torch.equal(got, alone), f"sequence {b}: {first_diff(got, alone)}"


def test_adapter_prefill_then_decode_equals_full(tiny_model):
    ad = _random_adapter(tiny_model.zcfg)
    seq = _seqs(tiny_model.zcfg.vocab_size, [30])[0]
    tiny_model.set_adapter(ad)
    try:
        with torch.no_grad():
            full = tiny_model(seq[None]).logits[0]
            dec = _decode_logits(tiny_model, seq, 9)
    finally:
        tiny_model.set_adapter(None)
    assert torch.equal(dec, full), first_diff(dec, full)


def test_gradients_reach_every_expert_factor(tiny_model, monkeypatch):
    import zmrl.model.mlp as mlp

    cfg = tiny_model.zcfg
    ad = _random_adapter(cfg)
    routed = []
    real_route = mlp.route
    monkeypatch.setattr(mlp, "route", lambda *a: routed.append(real_route(*a)[1]) or real_route(*a))
    seqs = _seqs(cfg.vocab_size, [64, 64, 64], seed=3)
    ids, mask = _padded(seqs, cfg.pad_token_id, left=False)
    loss = tiny_model(ids, mask, labels=ids, adapter=ad).loss
    loss.backward()
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    used = {layer: set(ids_.unique().tolist()) for layer, ids_ in zip(moe_layers, routed)}
    from zmrl.lora.adapter import EXPERTS, SHARED
    for layer, target, a, b in ad.items():  # every default target trains: none is a dead weight
        for name, p in (("A", a), ("B", b)):
            assert p.grad is not None, f"layer {layer} {target}.{name}: no grad"
            if target in EXPERTS:
                with_grad = set((p.grad.flatten(1).abs().sum(-1) > 0).nonzero().flatten().tolist())
                assert with_grad == used[layer], f"layer {layer} {target}.{name}: grads on experts " \
                    f"{sorted(with_grad)}, routed {sorted(used[layer])}"
                assert len(used[layer]) >= cfg.n_routed_experts - 1, f"layer {layer}: only {used[layer]} routed"
            else:
                assert p.grad.abs().sum() > 0, f"layer {layer} {target}.{name}: zero grad"
    assert any(t in SHARED for _, t, _, _ in ad.items())


def test_peft_roundtrip_and_peft_load_matches(tiny_model, tiny_dir, tmp_path):
    import peft
    cfg = tiny_model.zcfg
    ad = _random_adapter(cfg)
    save_peft(ad, tmp_path / "ad", tiny_dir)
    again = load_peft(tmp_path / "ad", cfg)
    for (l1, t1, a1, b1), (l2, t2, a2, b2) in zip(ad.items(), again.items()):
        assert (l1, t1) == (l2, t2) and torch.equal(a1, a2) and torch.equal(b1, b2), (l1, t1)
    seq = _seqs(cfg.vocab_size, [30])[0][None]
    from transformers import AutoModelForCausalLM
    host = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    with torch.no_grad():
        ours = host(seq, adapter=ad).logits
        base = host(seq).logits
        pm = peft.PeftModel.from_pretrained(host, str(tmp_path / "ad"))
        theirs = pm(input_ids=seq).logits
    # PEFT merges W + BA (its own semantics): equal within rounding, not bitwise
    assert (theirs - ours).abs().max() < 1e-4, (theirs - ours).abs().max()
    assert (theirs - base).abs().max() > 1e-2, "PEFT did not apply the adapter"
    pm.save_pretrained(str(tmp_path / "peft"))
    from safetensors.torch import load_file
    mine, peft_saved = load_file(str(tmp_path / "ad/adapter_model.safetensors")), \
        load_file(str(tmp_path / "peft/adapter_model.safetensors"))
    assert set(mine) == set(peft_saved), sorted(set(mine) ^ set(peft_saved))[:6]
    assert all(torch.equal(mine[k], peft_saved[k]) for k in mine)


def test_adapter_for_another_model_is_rejected(tiny_model, tmp_path):
    import dataclasses

    other = dataclasses.replace(tiny_model.zcfg, n_routed_experts=4, num_experts_per_tok=2)
    save_peft(LoraAdapter(other, LoraConfig(r=4)), tmp_path / "other")
    with pytest.raises(ValueError, match="does not fit this model.*experts"):
        load_peft(tmp_path / "other", tiny_model.zcfg)


def test_bad_lora_config():
    with pytest.raises(ValueError, match="unknown LoRA targets.*mlp.gate.weight"):
        LoraConfig(targets=["mlp.gate.weight"])
    with pytest.raises(ValueError, match="r must be"):
        LoraConfig(r=0)
    with pytest.raises(ValueError, match="LoRA target self_attn.indexer.wk.weight would never train .*top-k"):
        LoraConfig(targets=["self_attn.q_a_proj.weight", "self_attn.indexer.wk.weight"])


def test_indexer_weights_get_no_gradient_which_is_why_they_are_refused(tiny_model):
    """The LM loss reaches every attention projection but none of the indexer's: a LoRA there
    would never train. Control: q_a_proj, beside it in the same layer, gets a gradient."""
    cfg = tiny_model.zcfg
    seq = _seqs(cfg.vocab_size, [48], seed=2)[0][None]  # longer than index_topk: sparse selection
    attn = tiny_model.model.layers[1].self_attn
    watched = {"q_a_proj": attn.q_a_proj.weight, "indexer.wq_b": attn.indexer.wq_b.weight,
               "indexer.wk": attn.indexer.wk.weight, "indexer.weights_proj": attn.indexer.weights_proj.weight}
    tiny_model.zero_grad(set_to_none=True)
    try:
        tiny_model(seq, labels=seq).loss.backward()
        grads = {k: None if w.grad is None else float(w.grad.abs().sum()) for k, w in watched.items()}
    finally:
        tiny_model.zero_grad(set_to_none=True)
    assert grads["q_a_proj"], grads
    assert all(not grads[k] for k in watched if k.startswith("indexer.")), grads


def test_peft_adapter_on_the_indexer_is_refused(tiny_model, tmp_path):
    import json

    ad = LoraAdapter(tiny_model.zcfg, LoraConfig(r=4))
    save_peft(ad, tmp_path / "ad")
    config_file = tmp_path / "ad" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["target_modules"].append("indexer.wk")  # as an adapter trained elsewhere could name it
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="ad: LoRA target self_attn.indexer.wk.weight would never train"):
        load_peft(tmp_path / "ad", tiny_model.zcfg)
