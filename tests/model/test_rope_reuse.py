"""rope_cos_sin gathers a forward's cos/sin once: every layer passes the same positions tensor, and
the latest result is reused for that very tensor only (not an equal one, not after an in-place
change, not for an inference tensor), with the bits of a fresh gather. GPU: a CUDA graph capture
gathers its own rows (reused within it), so a replay follows positions rewritten in place."""
import pytest
import torch

import zmrl.model.attention as attention
from zmrl.model.attention import _rope_table, rope_cos_sin
from zmrl.model.layers import init_weights
from zmrl.model.packed import forward_packed, split_layer_weights


def _fresh(cfg, positions):
    cos, sin = _rope_table(cfg.qk_rope_head_dim, float(cfg.rope_theta), cfg.max_position_embeddings,
                           str(positions.device))
    return cos[positions], sin[positions]


def _same(got, want):
    return all(torch.equal(g, w) for g, w in zip(got, want))


def test_same_tensor_reuses_the_gather(tiny_model):
    cfg = tiny_model.zcfg
    pos = torch.tensor([0, 3, 1, 7])
    first = rope_cos_sin(cfg, pos)
    again = rope_cos_sin(cfg, pos)
    assert again[0] is first[0] and again[1] is first[1]
    assert _same(again, _fresh(cfg, pos))
    # an equal tensor is another tensor: gathered anew, the same values
    other = rope_cos_sin(cfg, pos.clone())
    assert other[0] is not first[0] and _same(other, first)


def test_in_place_change_is_gathered_anew(tiny_model):
    cfg = tiny_model.zcfg
    pos = torch.tensor([0, 1, 2, 3])
    before = rope_cos_sin(cfg, pos)
    pos.add_(2)
    after = rope_cos_sin(cfg, pos)
    assert _same(after, _fresh(cfg, pos))
    assert not _same(after, before)  # control: the kept result would be stale here


def test_inference_tensors_and_modes_are_not_mixed(tiny_model):
    cfg = tiny_model.zcfg
    with torch.inference_mode():
        pos = torch.arange(4)
        first = rope_cos_sin(cfg, pos)
        assert rope_cos_sin(cfg, pos)[0] is not first[0]  # no version counter: never kept
    plain = torch.arange(4)
    with torch.inference_mode():
        inside = rope_cos_sin(cfg, plain)
    outside = rope_cos_sin(cfg, plain)
    assert inside[0].is_inference() and not outside[0].is_inference()
    assert _same(outside, inside)


def test_bad_positions_raise_every_call(tiny_model):
    cfg = tiny_model.zcfg
    pos = torch.tensor([0, cfg.max_position_embeddings])
    for _ in range(2):
        with pytest.raises(ValueError, match="positions must lie in"):
            rope_cos_sin(cfg, pos)


def test_a_forward_checks_and_gathers_once(tiny_model, monkeypatch):
    cfg = tiny_model.zcfg
    assert cfg.num_hidden_layers >= 2 and cfg.qk_rope_head_dim
    w = init_weights(cfg, seed=0)
    w_layers = split_layer_weights(cfg, w)
    seqs = [torch.randint(2, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 30)]
    with torch.no_grad():
        want = forward_packed(cfg, w, w_layers, seqs)
    checks = []
    real = attention.fail_if
    monkeypatch.setattr(attention, "fail_if",
                        lambda bad, message, detail=None: (checks.append(message), real(bad, message, detail)))
    with torch.no_grad():
        got = forward_packed(cfg, w, w_layers, seqs)
    assert sum("positions must lie" in m for m in checks) == 1
    assert all(torch.equal(g, x) for g, x in zip(got, want))


@pytest.mark.gpu
def test_a_capture_gathers_its_own_rows_and_a_replay_follows_rewritten_positions(tiny_model):
    from zmrl.batch_invariant.graph_refs import holding_for_graph

    cfg = tiny_model.zcfg
    pos = torch.tensor([0, 3, 1, 7], device="cuda")
    eager = rope_cos_sin(cfg, pos)  # kept for pos
    graph = torch.cuda.CUDAGraph()
    with holding_for_graph(), torch.cuda.graph(graph):
        captured = rope_cos_sin(cfg, pos)
        again = rope_cos_sin(cfg, pos)
    assert captured[0] is not eager[0] and again[0] is captured[0]  # its own rows, reused within it
    pos.copy_(torch.tensor([5, 2, 9, 4]))  # a graph's input rewritten before a replay
    graph.replay()
    assert _same(captured, _fresh(cfg, pos))
    assert not _same(eager, _fresh(cfg, pos))  # control: the eager rows would have been stale
    assert rope_cos_sin(cfg, pos)[0] is not captured[0]  # a later call never takes a capture's rows
