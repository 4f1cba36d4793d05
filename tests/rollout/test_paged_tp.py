"""The paged forward split over tensor-parallel ranks (the vLLM workers' arithmetic, without vLLM):
two gloo processes, each holding one TP rank's shard (zmrl.rollout.sharded.ShardedWeights: heads,
dense MLP and vocabulary split, routed experts whole per rank, an adapter's factors with them), run
tests/rollout/test_paged_forward.py's schedule (chunked prefills, decodes, a preemption, a prefix
hit) and give bitwise the log-probs of one process holding everything. The negative control runs
the same ranks with an ordinary all-reduce in place of the canonical tree: it differs. fp32 and
bf16; on CUDA (`gpu`), the same with both ranks sharing one GPU.
"""
from __future__ import annotations

import pytest
import torch

from tests.ranks import run_ranks
from tests.rollout.test_paged_forward import Model, PagedEngine, _prompts, run_schedule
from zmrl.batch_invariant.collectives import LOCAL, Shards, ordinary_all_reduce
from zmrl.model.projections import Projections
from zmrl.model.sharding import check_divisible
from zmrl.rollout.sharded import LORA_PREFIX, ShardedWeights

SPLITS = (9, 17)


class RankModel(Model):
    """Model's weights and adapter, as the TP rank `shards` holds them."""

    def __init__(self, shards: Shards, lora: bool, device: str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__(dtype, device, lora)
        whole = self.adapter
        self.shard = ShardedWeights(self.cfg, shards, dtype, device)
        self.shard.load(self.weights.items())
        if whole is not None:
            lcfg = whole.lcfg
            self.shard.set_adapter({"r": lcfg.r, "lora_alpha": lcfg.lora_alpha, "targets": list(lcfg.targets)})
            self.shard.update({LORA_PREFIX + k: v.data for k, v in whole.factors.items()})  # the weight sync
        self.shards, self.weights, self.w_layers = shards, self.shard.model, self.shard.layers

    def projections(self):
        return self.shard.projections


def rank_logprobs(shards: Shards, lora: bool, ordinary: bool, device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> dict:
    before = torch.get_num_threads()  # also called in the pytest process (TP = 1): put its count back
    torch.set_num_threads(1)
    try:
        model = RankModel(shards, lora, device, dtype)
        engine = PagedEngine(model, seed=0)
        with ordinary_all_reduce(ordinary):
            run_schedule(engine, _prompts(model.cfg), SPLITS)
    finally:
        torch.set_num_threads(before)
    return {rid: {pos: torch.stack(v).cpu() for pos, v in lps.items()} for rid, lps in engine.logprobs.items()}


def _differing(a: dict, b: dict) -> tuple[int, int]:
    """-> (differing log-probs, total); every request and position must be present in both."""
    assert a.keys() == b.keys() and all(a[r].keys() == b[r].keys() for r in a)
    pairs = [(a[r][p], b[r][p]) for r in a for p in a[r]]
    return sum(not torch.equal(x, y) for x, y in pairs), len(pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_tp2_paged_logprobs_equal_tp1(lora, dtype):
    one = rank_logprobs(LOCAL, lora, False, "cpu", dtype)
    ranks = run_ranks(rank_logprobs, 2, (lora, False, "cpu", dtype))
    for rank, got in enumerate(ranks):
        differing, total = _differing(got, one)
        assert total > 50 and differing == 0, f"rank {rank}: {differing}/{total} log-probs differ from TP = 1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tp2_with_an_ordinary_all_reduce_differs(dtype):
    one = rank_logprobs(LOCAL, True, True, "cpu", dtype)
    ranks = run_ranks(rank_logprobs, 2, (True, True, "cpu", dtype))
    differing, total = _differing(ranks[0], one)
    assert differing > 0, f"the ordinary all-reduce gave TP = 1's bits on all {total} log-probs"


# ----------------------------------------------------------------------------- CUDA
# Two gloo ranks sharing one GPU (NCCL refuses two ranks on one device; the collectives stage CUDA
# tensors through the host for gloo): what one GPU allows of the NCCL run on two.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tp2_paged_logprobs_equal_tp1_on_one_gpu(dtype):
    one = rank_logprobs(LOCAL, True, False, "cuda", dtype)
    ranks = run_ranks(rank_logprobs, 2, (True, False, "cuda", dtype))
    for rank, got in enumerate(ranks):
        differing, total = _differing(got, one)
        assert total > 50 and differing == 0, f"rank {rank}: {differing}/{total} log-probs differ from TP = 1"


@pytest.mark.gpu
def test_tp2_with_an_ordinary_all_reduce_differs_on_one_gpu():
    one = rank_logprobs(LOCAL, True, True, "cuda")
    ranks = run_ranks(rank_logprobs, 2, (True, True, "cuda"))
    differing, total = _differing(ranks[0], one)
    assert differing > 0, f"the ordinary all-reduce gave TP = 1's bits on all {total} log-probs"


def test_sharded_weights_hold_a_ranks_share():
    """Rank 1 of 2 holds the second half of the heads, of the vocabulary and of the experts."""
    cfg = Model(torch.float32, "cpu", lora=False).cfg
    model = RankModel(Shards(2, 1, None), lora=True)
    w, whole = model.shard.model, Model(torch.float32, "cpu", lora=False).weights
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert torch.equal(w[q_b], whole[q_b][whole[q_b].shape[0] // 2:])
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(w[o], whole[o][:, whole[o].shape[1] // 2:])
    assert torch.equal(w["lm_head.weight"], whole["lm_head.weight"][cfg.vocab_size // 2:])
    experts = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(w[experts], whole[experts][cfg.n_routed_experts // 2:])
    router = "model.layers.1.mlp.gate.weight"
    assert torch.equal(w[router], whole[router])
    # weight names answer the whole shapes: what a trainer syncs
    names = model.shard.names()
    assert names[q_b][0] == list(whole[q_b].shape) and names[experts][0] == list(whole[experts].shape)
    assert isinstance(model.shard.projections(1), Projections) and model.shard.projections(1).shards.rank == 1


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_a_ranks_grouped_experts_are_its_own_stacks_at_their_global_ids(lora):
    """What the GPU's grouped expert kernels take from a rank's shard (the CPU runs experts one by
    one, by global id): the stacks of the rank's experts, the id of its first, and LoRA factors of
    the same experts. One process holding everything is the control: the whole stacks, from 0."""
    whole = RankModel(LOCAL, lora)
    rank = RankModel(Shards(2, 1, None), lora)
    layer = next(i for i in range(whole.cfg.num_hidden_layers) if whole.cfg.is_moe_layer(i))
    full = whole.projections()(layer).grouped_experts(whole.w_layers[layer])
    got = rank.projections()(layer).grouped_experts(rank.w_layers[layer])
    half = whole.cfg.n_routed_experts // 2
    assert full.first_expert == 0 and got.first_expert == half
    assert torch.equal(got.gate_up, full.gate_up[half:]) and torch.equal(got.down, full.down[half:])
    for mine, all_experts in zip((got.lora_gate_up, got.lora_down), (full.lora_gate_up, full.lora_down)):
        assert (mine is None) == (not lora)
        if lora:
            assert all(torch.equal(m, a[half:]) for m, a in zip(mine, all_experts))


def test_bad_tp_sizes_are_named():
    cfg = Model(torch.float32, "cpu", lora=False).cfg  # 4 heads, 8 experts, vocab 512
    check_divisible(cfg, 4, "tensor_parallel_size")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 must divide the canonical leaves .* "
                                         r"num_attention_heads=4 \(4 leaves\)"):
        check_divisible(cfg, 8, "tensor_parallel_size")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide 8"):
        check_divisible(cfg, 3, "tensor_parallel_size")


def test_a_bad_weight_update_changes_nothing():
    model = RankModel(Shards(2, 0, None), lora=False)
    name = "model.layers.0.self_attn.o_proj.weight"
    before = model.shard.model[name].clone()
    half = torch.zeros(model.shard.model[name].shape)  # a shard's shape, not the whole tensor's
    with pytest.raises(ValueError, match="wrong shapes"):
        model.shard.update({name: half})
    assert torch.equal(model.shard.model[name], before)
