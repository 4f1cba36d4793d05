"""Padded minibatches (zmrl.trainer.padding) and their CUDA graphs (zmrl.trainer.megatron.graphs).

CPU: a completion scored in a log-prob pass packed end to end with padding has the unpadded
trainer's log-prob bits, also when the packing is refilled with other lengths (negative control:
torch's kernels, batch invariance off, change bits when padded); a padded train step
reports exactly 0 mismatch, is deterministic, and its loss, metrics and update agree with the eager
step's to float rounding (the padded loss sums over another layout); a minibatch whose shape is past
a dropped graph's runs the trainer's unpadded eager step, bit for bit. GPU (`gpu`): steps replayed
from CUDA graphs equal the same steps run eagerly in the same padded buffers, bit for bit, in fp32 and
bf16; log-prob passes replayed from CUDA graphs equal the trainer's unpadded eager pass, bit for
bit, adapted and base, at two temperatures, and read an adapter loaded after the capture (control:
that adapter changes the log-probs); a graph that leaves too little memory is dropped, and its
shape's later steps and passes equal the trainer's eager ones without graphs; a capture that fails
names the option that avoids it and leaves the caller's stream current; a dropped trainer's graphs
collected while a capture runs do not break it (control: collected inside a plain capture, they do); a step after a
LoRA backward outside train_step whose graph the caller keeps captures, and equals a fresh trainer's
(control: without the accumulators the graphs hold, that capture fails).
"""
import copy
import dataclasses

import pytest
import torch

from tests.bitwise import first_difference
from tests.trainer.megatron.conftest import T, random_adapter
from zmrl.trainer.base import TrainBatch, UpdateSettings
from zmrl.trainer.padding import PackedShape, bucket, pad_packed, packed_shape

pytestmark = pytest.mark.megatron


# ----------------------------------------------------------------------------- the packed layout
@pytest.mark.parametrize("n, floor, want", [(1, 1, 1), (4, 1, 4), (5, 1, 5), (9, 1, 10), (15, 1, 16), (17, 1, 20),
                                            (33, 1, 40), (10, 64, 64), (345, 64, 384), (513, 64, 640),
                                            (575, 64, 640), (640, 64, 640), (641, 64, 768), (1025, 64, 1280)])
def test_bucket(n, floor, want):
    assert bucket(n, floor) == want


def test_buckets_pad_less_than_a_quarter_and_are_few():
    sizes = [bucket(n) for n in range(5, 4097)]
    assert all(s >= n and s < 1.25 * n for n, s in zip(range(5, 4097), sizes))
    assert len(set(sizes)) == 4 + 4 * 9  # 5 to 8 as they are, then 4 per doubling from 8 to 4096


def test_pad_packed_layout():
    prompts, completions = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13]]
    shape = packed_shape([3, 1], [2, 3], max_positions=512)
    assert shape == PackedShape(seqs=2, tokens=10, max_len=64, rows=5)  # 9 real tokens, bucketed
    pad = pad_packed(prompts, completions, shape)
    # the padding goes to the first sequences' tails, each up to the longest length
    assert pad.bounds == (0, 6, 10) and pad.ids.tolist() == [5, 6, 7, 9, 10, 0, 8, 11, 12, 13]
    # row j of a completion is predicted at its sequence's row len(prompt) - 1 + j
    assert pad.rows.tolist() == [2, 3, 6, 7, 8] and pad.tokens.tolist() == [9, 10, 11, 12, 13]
    wide = pad_packed(prompts, completions, PackedShape(seqs=2, tokens=12, max_len=7, rows=6))
    assert wide.bounds == (0, 7, 12)
    assert wide.ids.tolist() == [5, 6, 7, 9, 10, 0, 0, 8, 11, 12, 13, 0]
    assert wide.rows.tolist() == [2, 3, 7, 8, 9, 0] and wide.tokens.tolist() == [9, 10, 11, 12, 13, 0]
    assert wide.mask.tolist() == [True] * 5 + [False]
    assert torch.allclose(wide.weights, torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2, 0]))
    seq_mean = pad_packed(prompts, completions, wide.shape, "seq_mean_token_mean")
    assert torch.allclose(seq_mean.weights, torch.tensor([0.25, 0.25, 1 / 6, 1 / 6, 1 / 6, 0]))
    assert wide.spread([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])]).tolist() == [1, 2, 3, 4, 5, 0]
    assert wide.broadcast(torch.tensor([-1.0, 2.0])).tolist() == [-1, -1, 2, 2, 2, 0]
    # a batch smaller than the shape's B: padding sequences after it, one token each at least,
    # then the spare rows as before (the real sequences first, each up to L)
    fewer = pad_packed(prompts, completions, PackedShape(seqs=4, tokens=20, max_len=7, rows=6))
    assert fewer.bounds == (0, 7, 14, 19, 20)
    assert fewer.ids[14:].tolist() == [0] * 6 and fewer.rows.tolist() == wide.rows.tolist()
    assert torch.equal(fewer.weights, wide.weights)


def test_packed_shape_buckets_and_pad_packed_refuses_what_does_not_fit():
    # 3 sequences of 290 + 170: 1,380 tokens -> 1,536; the longest 460 -> 512; 510 rows -> 512
    assert packed_shape([290] * 3, [170] * 3, max_positions=4096) == PackedShape(3, 1536, 512, 512)
    # never more rows than the sequences could hold at the longest length: 9 sequences bucket to 10,
    # and 575 tokens and a padding sequence to 640, 10 x 64; 19 sequences to 20 and 1,216 rows to
    # 1,280, past 20 x 60
    assert packed_shape([60] * 8 + [59], [4] * 9, max_positions=64) == PackedShape(10, 640, 64, 40)
    assert packed_shape([58] * 19, [2] * 19, max_positions=60) == PackedShape(20, 1200, 60, 40)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=8"):
        packed_shape([6], [3], max_positions=8)
    with pytest.raises(ValueError, match="does not fit"):
        pad_packed([[1] * 6], [[2] * 3], PackedShape(seqs=1, tokens=9, max_len=8, rows=3))
    with pytest.raises(ValueError, match="does not fit"):
        pad_packed([[1] * 6, [1]], [[2] * 3, [2]], PackedShape(seqs=1, tokens=64, max_len=64, rows=8))
    with pytest.raises(ValueError, match="does not fit"):  # no row left for the padding sequence
        pad_packed([[1] * 6], [[2] * 3], PackedShape(seqs=2, tokens=9, max_len=64, rows=8))
    with pytest.raises(ValueError, match="needs a prompt and a completion"):
        pad_packed([[1]], [[]], PackedShape(seqs=1, tokens=64, max_len=64, rows=8))
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        pad_packed([[1]], [[2]], PackedShape(seqs=1, tokens=64, max_len=64, rows=8), "sum")
    # L never past the model's positions: 195 tokens bucket to 224, capped at 200 (and T with it)
    assert packed_shape([150], [45], max_positions=200) == PackedShape(1, 200, 200, 48)
    pad = pad_packed([[1]], [[2, 3]], PackedShape(seqs=1, tokens=64, max_len=64, rows=8))
    with pytest.raises(ValueError, match="sequence 0 of the batch: 1 values for 2"):
        pad.spread([torch.zeros(1)])


# ----------------------------------------------------------------------------- the trainer, CPU
def _batch(mt, seed=1, sequences=None):
    """A TrainBatch of five sequences (or of `sequences`: prompts, completions), scored by `mt`."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (3, 21, 40, 7, 30)]
    completions = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 20, 9, 1, 13)]
    if sequences is not None:
        prompts, completions = sequences
    old = mt.logprobs(prompts, completions, temperature=T)
    return TrainBatch(prompts=prompts, completions=completions, old_logprobs=old,
                      advantages=torch.linspace(1.0, -1.0, len(prompts)),
                      ref_logprobs=mt.logprobs(prompts, completions, temperature=T, adapter=False))


SETTINGS = UpdateSettings(lr=1e-2, num_minibatches=2, epochs=2, kl_coef=0.05, temperature=T)


@pytest.fixture
def padded(mt):
    from zmrl.trainer.megatron.graphs import MinibatchGraphs

    mt.minibatch_graphs = MinibatchGraphs(mt, capture=False)
    yield mt
    mt.minibatch_graphs = None


def _padded_scores(trainer, prompts, completions, adapter=True) -> list[torch.Tensor]:
    """The log-prob pass packed end to end with its padding, run eagerly (without capture)."""
    from zmrl.trainer.megatron.graphs import LogprobGraphs

    return [t.cpu() for t in LogprobGraphs(trainer, capture=False).run(prompts, completions, T, adapter)]


@pytest.mark.parametrize("adapter", [True, False], ids=["adapted", "base"])
def test_padded_scores_equal_unpadded_bitwise(mt, sampled, adapter):
    prompts, completions = sampled
    assert max(len(p) + len(c) for p, c in zip(prompts, completions)) > mt.cfg.index_topk
    mt.load_adapter_tensors(random_adapter(mt, seed=5))
    got = _padded_scores(mt, prompts, completions, adapter)
    want = mt.logprobs(prompts, completions, temperature=T, adapter=adapter)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"sequence {i}: {first_difference(a, b)}"


def test_negative_control_padding_changes_bits_without_batch_invariance(mt, sampled):
    prompts, completions = sampled
    mt.load_adapter_tensors(random_adapter(mt, seed=5))
    mt.invariant = False  # torch's kernels: a row's bits depend on what else its GEMM holds
    got = _padded_scores(mt, prompts, completions)
    want = mt.logprobs(prompts, completions, temperature=T)
    assert sum(int((a != b).sum()) for a, b in zip(got, want)) > 0


def test_packed_params_refill_in_place_and_refuse_what_does_not_fit(mt):
    from zmrl.trainer.megatron.attention import hold_packing, refill_packing

    params = mt.model.packing([0, 3, 10], width=8)
    held = hold_packing(params, mt.device)
    assert held.max_len == 8 and params.max_seqlen_q == 8
    refill_packing(params, [0, 8, 10])
    assert hold_packing(params, mt.device) is held  # kept, not rebuilt: a graph reads its tensors
    assert held.bounds == (0, 8, 10) and params.cu_seqlens_q.tolist() == [0, 8, 10]
    assert held.local.tolist() == [*range(8), 0, 1]
    with pytest.raises(ValueError, match="holds no empty sequence"):
        refill_packing(params, [0, 10, 10])
    with pytest.raises(ValueError, match="must fit the packing's width 8"):
        refill_packing(params, [0, 1, 10])
    with pytest.raises(ValueError, match="width=4 is narrower than the longest sequence \\(7 tokens\\)"):
        mt.model.packing([0, 3, 10], width=4)
    # without a width the longest sequence is the plan, as before
    assert hold_packing(mt.model.packing([0, 3, 10]), mt.device).max_len == 7


def test_a_refilled_packed_pass_equals_the_unpadded_pass(mt):
    # two batches of one packed shape through the same buffers: the second refills the packing
    # with other lengths (and so other positions) in place
    mt.load_adapter_tensors(random_adapter(mt, seed=5))
    from zmrl.trainer.megatron.graphs import LogprobGraphs

    graphs = LogprobGraphs(mt, capture=False)
    for i, (prompts, completions) in enumerate(_scoring_batches(mt.cfg.vocab_size, mt.cfg.index_topk)):
        got = [t.cpu() for t in graphs.run(prompts, completions, T)]
        _assert_same(got, mt.logprobs(prompts, completions, temperature=T), f"batch {i}")
    assert len(graphs.buffers) == 1


def test_a_batch_with_padding_sequences_scores_and_trains_as_without(_megatron, padded):
    # 9 sequences run as 10, the tenth a padding sequence: the log-probs are the unpadded
    # pass's bits, and the padded step reports exactly 0 mismatch and agrees with the eager step
    from zmrl.trainer.megatron.graphs import LogprobGraphs

    _, fresh = _megatron
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (3, 8, 30, 7, 12, 5, 20, 9, 2)]
    completions = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 2, 9, 1, 13, 4, 6, 3, 7)]
    assert packed_shape([len(p) for p in prompts], [len(c) for c in completions], 10 ** 6).seqs == 10
    padded.load_adapter_tensors(random_adapter(padded, seed=5))
    got = [t.cpu() for t in LogprobGraphs(padded, capture=False).run(prompts, completions, T)]
    _assert_same(got, padded.logprobs(prompts, completions, temperature=T), "padded pass")
    # control: torch's kernels (invariance off) on the same batch give other bits once padded
    padded.invariant = False
    try:
        variant = [t.cpu() for t in LogprobGraphs(padded, capture=False).run(prompts, completions, T)]
        assert any(not torch.equal(a, b) for a, b in zip(variant, padded.logprobs(prompts, completions,
                                                                                  temperature=T)))
    finally:
        padded.invariant = True
    settings = dataclasses.replace(SETTINGS, num_minibatches=1, epochs=1)
    padded.load_state_dict(fresh)
    stepped = padded.train_step(_batch(padded, sequences=(prompts, completions)), settings, step=0)
    assert stepped["mismatch/ratio_first_minibatch_max_abs_dev"] == 0.0
    padded.load_state_dict(fresh)
    graphs, padded.minibatch_graphs = padded.minibatch_graphs, None
    eager = padded.train_step(_batch(padded, sequences=(prompts, completions)), settings, step=0)
    padded.minibatch_graphs = graphs
    for k in stepped:
        assert stepped[k] == pytest.approx(eager[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_padded_step_is_exact_on_mismatch_deterministic_and_close_to_eager(_megatron, padded, loss_agg):
    _, fresh = _megatron
    settings = dataclasses.replace(SETTINGS, loss_agg=loss_agg)
    batch = _batch(padded)
    first = padded.train_step(batch, settings, step=3)
    after_first = padded.adapter_tensors()
    padded.load_state_dict(fresh)
    again = padded.train_step(batch, settings, step=3)
    assert first == again
    assert first["mismatch/ratio_first_minibatch_max_abs_dev"] == 0.0
    for k, t in padded.adapter_tensors().items():
        assert torch.equal(t, after_first[k]), k
    padded.load_state_dict(fresh)
    graphs, padded.minibatch_graphs = padded.minibatch_graphs, None
    eager = padded.train_step(batch, settings, step=3)
    padded.minibatch_graphs = graphs
    assert first.keys() == eager.keys()
    for k in first:
        assert first[k] == pytest.approx(eager[k], rel=1e-5, abs=1e-7), k
    for k, t in padded.adapter_tensors().items():
        assert torch.allclose(after_first[k], t, rtol=1e-4, atol=1e-5), k


def test_shapes_past_a_dropped_graph_take_the_unpadded_eager_run(_megatron, padded):
    _, fresh = _megatron
    batch = _batch(padded)
    graphs = padded.minibatch_graphs

    def step(unpadded_from, minibatch_graphs):
        padded.load_state_dict(fresh)
        graphs.unpadded_from, padded.minibatch_graphs = unpadded_from, minibatch_graphs
        metrics = padded.train_step(batch, SETTINGS, step=3)
        padded.minibatch_graphs = graphs
        return metrics, padded.adapter_tensors()

    delegated, delegated_lora = step(0, graphs)  # as after the smallest shape's graph was dropped
    eager, eager_lora = step(None, None)  # the trainer without graphs
    assert delegated == eager
    for k, t in eager_lora.items():
        assert torch.equal(delegated_lora[k], t), k
    assert not graphs.buffers  # nothing was padded
    # control: with every shape below the threshold the same step runs padded, which rounds its loss otherwise
    padded_run, padded_lora = step(10 ** 9, graphs)
    assert graphs.buffers
    assert padded_run != eager or any(not torch.equal(padded_lora[k], t) for k, t in eager_lora.items())


def test_cuda_graphs_need_cuda_and_one_rank(mt):
    from zmrl.trainer.megatron.graphs import MinibatchGraphs

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        MinibatchGraphs(mt)
    assert mt.minibatch_graphs is None and mt.logprob_graphs is None  # a CPU trainer runs eagerly


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_replayed_steps_equal_eager_padded_steps_bitwise(cuda_dir, lora_config):
    from zmrl.trainer.megatron import MegatronTrainer
    from zmrl.trainer.megatron.graphs import MinibatchGraphs

    graphed = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda")
    eager = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda", options={"cuda_graphs": False})
    assert graphed.minibatch_graphs is not None and eager.minibatch_graphs is None
    eager.minibatch_graphs = MinibatchGraphs(eager, capture=False)
    tensors = random_adapter(graphed, seed=5)
    for trainer in (graphed, eager):
        trainer.load_adapter_tensors(tensors)
    batch = _batch(graphed)
    steps = []
    for step in range(3):  # step 0 captures each minibatch shape, steps 1 and 2 replay them
        a = graphed.train_step(batch, SETTINGS, step)
        b = eager.train_step(batch, SETTINGS, step)
        assert a == b, f"step {step}: {a} vs {b}"
        assert a["mismatch/ratio_first_minibatch_max_abs_dev"] == 0.0  # old: the graphed trainer's own
        for k, t in eager.adapter_tensors().items():
            assert torch.equal(graphed.adapter_tensors()[k], t), f"step {step}, {k}"
        steps.append(a)
        batch = dataclasses.replace(batch, old_logprobs=graphed.logprobs(batch.prompts, batch.completions,
                                                                         temperature=T))
    graphs = graphed.minibatch_graphs  # 4 minibatches a step; epoch 2's shuffled ones may bring new shapes
    assert graphs.captures + graphs.replays == 3 * 4 and graphs.replays >= 4, (graphs.captures, graphs.replays)
    assert steps[1] != steps[2]  # the replays computed each step anew


def _scoring_batches(vocab: int, topk: int):
    """Two batches of other sequences and lengths, past index_topk, that pad to the same packed
    shape (so the second replays the first one's graph, its packing refilled)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for p_lens, c_lens in (((3, 37, 40, 7), (5, 20, 16, 1)), ((40, 5, 30, 20), (18, 3, 15, 9))):
        assert max(p + c for p, c in zip(p_lens, c_lens)) > topk
        prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in p_lens]
        out.append((prompts, [torch.randint(2, vocab, (n,), generator=g).tolist() for n in c_lens]))
    return out


@pytest.mark.gpu
def test_a_replay_refilled_with_other_lengths_equals_the_eager_padded_step(cuda_dir, lora_config):
    # one minibatch per step: both batches have one packed shape, so the second replays the
    # first's graph with its packing refilled in place (other offsets, positions, key tiles)
    from zmrl.trainer.megatron import MegatronTrainer
    from zmrl.trainer.megatron.graphs import MinibatchGraphs
    from zmrl.trainer.padding import pad_packed

    graphed = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda")
    eager = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda", options={"cuda_graphs": False})
    eager.minibatch_graphs = MinibatchGraphs(eager, capture=False)
    tensors = random_adapter(graphed, seed=5)
    for trainer in (graphed, eager):
        trainer.load_adapter_tensors(tensors)
    first, second = _scoring_batches(graphed.cfg.vocab_size, graphed.cfg.index_topk)
    shape, other = (packed_shape([len(p) for p in ps], [len(c) for c in cs], 10 ** 6) for ps, cs in (first, second))
    assert shape == other and pad_packed(*first, shape).bounds != pad_packed(*second, shape).bounds
    settings = dataclasses.replace(SETTINGS, num_minibatches=1, epochs=1)
    for step, sequences in enumerate((first, second, first, second)):
        a = graphed.train_step(_batch(graphed, sequences=sequences), settings, step)
        b = eager.train_step(_batch(eager, sequences=sequences), settings, step)
        assert a == b, f"step {step}: {a} vs {b}"
        assert a["mismatch/ratio_first_minibatch_max_abs_dev"] == 0.0
        for k, t in eager.adapter_tensors().items():
            assert torch.equal(graphed.adapter_tensors()[k], t), f"step {step}, {k}"
    graphs = graphed.minibatch_graphs
    assert (graphs.captures, graphs.replays) == (1, 3), (graphs.captures, graphs.replays)


def _assert_same(got, want, what: str) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}, sequence {i}: {first_difference(a, b)}"


@pytest.mark.gpu
def test_replayed_logprob_passes_equal_the_unpadded_eager_pass_bitwise(cuda_dir, lora_config):
    from zmrl.trainer.megatron import MegatronTrainer

    graphed = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda")
    eager = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda", options={"cuda_graphs": False})
    assert eager.logprob_graphs is None
    graphs = graphed.logprob_graphs
    first, second = _scoring_batches(graphed.cfg.vocab_size, graphed.cfg.index_topk)
    for seed in (5, 6):  # a new adapter, written in place: the replays must read it
        tensors = random_adapter(graphed, seed=seed)
        for trainer in (graphed, eager):
            trainer.load_adapter_tensors(tensors)
        for adapter in (True, False):
            for temperature in (T, 1.0):
                for prompts, completions in (first, second):
                    got = graphed.logprobs(prompts, completions, temperature=temperature, adapter=adapter)
                    want = eager.logprobs(prompts, completions, temperature=temperature, adapter=adapter)
                    _assert_same(got, want, f"adapter seed {seed}, adapter {adapter}, T {temperature}")
    # one capture per (temperature, adapter on/off); every other pass a replay
    assert (graphs.captures, graphs.replays) == (4, 12), (graphs.captures, graphs.replays)
    # the control: the second adapter changed the adapted log-probs, so a replay that read stale
    # factors would have failed above
    graphed.load_adapter_tensors(random_adapter(graphed, seed=5))
    before = graphed.logprobs(*first, temperature=T)
    graphed.load_adapter_tensors(random_adapter(graphed, seed=6))
    assert any(not torch.equal(a, b) for a, b in zip(before, graphed.logprobs(*first, temperature=T)))


@pytest.mark.gpu
def test_a_logprob_graph_that_leaves_too_little_memory_is_dropped_and_the_pass_runs_unpadded(
        cuda_dir, lora_config, monkeypatch):
    import zmrl.trainer.megatron.graphs as graphs_mod
    from zmrl.trainer.megatron import MegatronTrainer

    tight = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda")
    plain = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda", options={"cuda_graphs": False})
    first, second = _scoring_batches(tight.cfg.vocab_size, tight.cfg.index_topk)
    monkeypatch.setattr(graphs_mod, "HEADROOM", 10 ** 9)
    _assert_same(tight.logprobs(*first, temperature=T), plain.logprobs(*first, temperature=T), "dropped graph's run")
    graphs = tight.logprob_graphs
    assert graphs.captures == graphs.replays == 0 and graphs.pool_bytes == 0 and not graphs.buffers
    assert graphs.unpadded_from is not None and len(graphs.eager_for_memory) == 1
    _assert_same(tight.logprobs(*second, temperature=T), plain.logprobs(*second, temperature=T), "unpadded pass")
    assert not graphs.buffers  # the second pass was not padded


def _inside_captures(monkeypatch, name: str, action) -> None:
    """zmrl.trainer.megatron.graphs.<name> runs `action` on its first argument, then itself, while the
    current stream is capturing a CUDA graph."""
    import zmrl.trainer.megatron.graphs as graphs_mod

    real = getattr(graphs_mod, name)

    def wrapped(first, *args):
        if torch.cuda.is_current_stream_capturing():
            action(first)
        return real(first, *args)

    monkeypatch.setattr(graphs_mod, name, wrapped)


def _read_on_the_host(t: torch.Tensor) -> None:
    float(t.sum())  # a host read: forbidden inside a capture


@pytest.mark.gpu
def test_a_logprob_capture_that_fails_names_the_option_and_leaves_the_callers_stream(model_dir, lora_config,
                                                                                     monkeypatch):
    from zmrl.trainer.megatron import MegatronTrainer

    _inside_captures(monkeypatch, "token_logprobs", _read_on_the_host)
    mt = MegatronTrainer.from_dir(model_dir, lora_config, seed=0, device="cuda")
    caller = torch.cuda.current_stream()
    prompts, completions = _scoring_batches(mt.cfg.vocab_size, mt.cfg.index_topk)[0]
    with pytest.raises(RuntimeError, match=r"capturing a log-prob pass \(PackedShape.*cuda_graphs=false"):
        mt.logprobs(prompts, completions, temperature=T)
    assert torch.cuda.current_stream() == caller


@pytest.mark.gpu
def test_a_capture_that_fails_names_the_option_that_avoids_it_and_leaves_the_callers_stream(model_dir, lora_config, monkeypatch):
    from zmrl.trainer.megatron import MegatronTrainer

    _inside_captures(monkeypatch, "padded_minibatch_terms", _read_on_the_host)
    mt = MegatronTrainer.from_dir(model_dir, lora_config, seed=0, device="cuda")
    caller = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match=r"capturing a train-step minibatch \(PackedShape.*cuda_graphs=false"):
        mt.train_step(_batch(mt), SETTINGS, step=0)
    assert torch.cuda.current_stream() == caller  # not the capture's stream, which torch.cuda.graph leaves
    # the control: torch.cuda.graph alone leaves a failed capture's stream current
    side = torch.cuda.Stream()
    with pytest.raises(RuntimeError):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
            float(torch.ones(1, device="cuda").sum())
    leaked = torch.cuda.current_stream()
    torch.cuda.set_stream(caller)
    assert leaked == side


def _after_a_kept_outside_backward(model_dir, held_accumulators: bool):
    """A trainer that ran a LoRA backward outside train_step and whose caller keeps that backward's
    graph (its log-probs), with the batch tp_check's workload scores (where the failure was found)."""
    from zmrl.lora import LoraConfig
    from zmrl.trainer.megatron import MegatronTrainer

    mt = MegatronTrainer.from_dir(model_dir, LoraConfig(r=4), seed=0, device="cuda")
    if not held_accumulators:
        mt.minibatch_graphs.accumulators.clear()  # the next backward makes them, on the default stream
    g = torch.Generator().manual_seed(0)
    vocab, topk = mt.cfg.vocab_size, mt.cfg.index_topk
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, topk + 5, 2 * topk + 8)]
    completions = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (topk + 2, 7, topk)]
    old = mt.logprobs(prompts, completions, temperature=0.7)
    kept = mt._logprobs(prompts, completions, 1.0, True)
    torch.stack([lp.sum() for lp in kept]).sum().backward()
    for p in mt.params.values():
        p.grad = None
    batch = TrainBatch(prompts=prompts, completions=completions, old_logprobs=old,
                       advantages=torch.tensor([1.0, -0.5, 0.25]))
    return mt, batch, kept


@pytest.mark.gpu
def test_a_step_captures_after_a_backward_outside_train_step_and_equals_a_fresh_trainers(model_dir):
    from zmrl.lora import LoraConfig
    from zmrl.trainer.megatron import MegatronTrainer

    settings = UpdateSettings(lr=1e-3, temperature=0.7)
    mt, batch, kept = _after_a_kept_outside_backward(model_dir, held_accumulators=True)
    got = mt.train_step(batch, settings, step=0)
    assert mt.minibatch_graphs.captures >= 1 and kept
    fresh = MegatronTrainer.from_dir(model_dir, LoraConfig(r=4), seed=0, device="cuda")
    assert fresh.train_step(batch, settings, step=0) == got
    for k, t in fresh.adapter_tensors().items():
        assert torch.equal(mt.adapter_tensors()[k], t), k


@pytest.mark.gpu
def test_without_the_held_accumulators_a_kept_outside_graph_breaks_the_capture(model_dir):
    # the control: the same sequence, but the LoRA parameters' AccumulateGrad nodes are made by the
    # outside backward, on the default stream, and live on in its kept graph
    mt, batch, kept = _after_a_kept_outside_backward(model_dir, held_accumulators=False)
    with pytest.raises(RuntimeError, match="capturing a train-step minibatch .*legacy stream"):
        mt.train_step(batch, UpdateSettings(lr=1e-3, temperature=0.7), step=0)
    assert kept


@pytest.mark.gpu
def test_a_graph_that_leaves_too_little_memory_is_dropped_and_its_shapes_run_unpadded(cuda_dir, lora_config,
                                                                                     monkeypatch):
    import zmrl.trainer.megatron.graphs as graphs_mod
    from zmrl.trainer.megatron import MegatronTrainer

    tight = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda")
    plain = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda", options={"cuda_graphs": False})
    tight.load_adapter_tensors(random_adapter(tight, seed=5))
    batch = _batch(tight)
    monkeypatch.setattr(graphs_mod, "HEADROOM", 10 ** 9)  # no device has that much free beside any graph
    tight.train_step(batch, SETTINGS, 0)  # each shape's first minibatch runs padded, then its graph is dropped
    graphs = tight.minibatch_graphs
    assert graphs.captures == graphs.replays == 0 and graphs.pool_bytes == 0 and not graphs.buffers
    assert graphs.eager_for_memory and all("less than 1000000000x that for eager work" in line and
                                           "run unpadded" in line for line in graphs.eager_for_memory)
    # the same step again from the same state: every shape is now past the threshold, so each
    # minibatch is the trainer's eager one, bit for bit
    state = copy.deepcopy(tight.state_dict())
    plain.load_state_dict(state)
    again = tight.train_step(batch, SETTINGS, 0)
    assert again == plain.train_step(batch, SETTINGS, 0)
    for k, t in plain.adapter_tensors().items():
        assert torch.equal(tight.adapter_tensors()[k], t), k
    assert graphs.captures == graphs.replays == 0 and not graphs.buffers
    # control: with the default headroom a trainer in the same state captures and replays padded
    # minibatches, whose loss rounds otherwise
    monkeypatch.setattr(graphs_mod, "HEADROOM", 2)
    roomy = MegatronTrainer.from_dir(cuda_dir, lora_config, seed=0, device="cuda")
    roomy.load_state_dict(state)
    padded = roomy.train_step(batch, SETTINGS, 0)
    assert roomy.minibatch_graphs.captures > 0 and roomy.minibatch_graphs.unpadded_from is None
    assert padded != again or any(not torch.equal(roomy.adapter_tensors()[k], t)
                                  for k, t in tight.adapter_tensors().items())


def _dropped_trainer_with_a_graph(model_dir, lora_config, batch):
    """A weak reference to a trainer that captured a graph and was dropped: its graphs and it hold
    each other, so it lives on as garbage until Python collects it."""
    import weakref

    from zmrl.trainer.megatron import MegatronTrainer

    old = MegatronTrainer.from_dir(model_dir, lora_config, seed=0, device="cuda")
    old.logprobs(*batch, temperature=T)
    assert old.logprob_graphs.captures == 1
    return weakref.ref(old)


@pytest.mark.gpu
def test_garbage_collected_during_a_capture_does_not_break_it(model_dir, lora_config, monkeypatch):
    import gc

    from zmrl.model.checkpoint import read_config
    from zmrl.trainer.megatron import MegatronTrainer

    cfg = read_config(model_dir)
    first, second = _scoring_batches(cfg.vocab_size, cfg.index_topk)
    gc.disable()  # the dropped trainers stay uncollected until a test collects them
    try:
        # the control: a dropped trainer's graphs destroyed inside a plain capture break it
        dropped = _dropped_trainer_with_a_graph(model_dir, lora_config, first)
        assert dropped() is not None
        caller = torch.cuda.current_stream()
        with pytest.raises(RuntimeError):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.Stream()):
                x = torch.ones(8, device="cuda") * 2
                gc.collect()
                x = x + 1
        torch.cuda.set_stream(caller)
        assert dropped() is None
        # zmrl's capture collects before it starts, so the collection inside finds nothing to destroy
        dropped = _dropped_trainer_with_a_graph(model_dir, lora_config, first)
        # what Python does on its own whenever a capture allocates enough objects
        _inside_captures(monkeypatch, "token_logprobs", lambda logits: gc.collect())
        mt = MegatronTrainer.from_dir(model_dir, lora_config, seed=0, device="cuda")
        eager = MegatronTrainer.from_dir(model_dir, lora_config, seed=0, device="cuda", options={"cuda_graphs": False})
        _assert_same(mt.logprobs(*first, temperature=T), eager.logprobs(*first, temperature=T), "captured")
        assert mt.logprob_graphs.captures == 1 and dropped() is None
        _assert_same(mt.logprobs(*second, temperature=T), eager.logprobs(*second, temperature=T), "replayed")
        assert mt.logprob_graphs.replays == 1
    finally:
        gc.enable()
