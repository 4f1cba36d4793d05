"""The paged forward (zmrl.rollout.paged) against the trainer's full-sequence forward, bit for bit.

A small allocator here plays the serving engine: it hands out blocks in a shuffled order (so a
request's blocks are never contiguous), schedules steps that mix prefills of different lengths
(past index_topk, so the selection is really sparse), prefills chunked at several points, decode
steps, requests that join while others decode, a request preempted (its blocks freed) and
recomputed, and a request that reuses another's full prefix blocks (a prefix-cache hit). Every
token fed after position 0 gets a log-prob from the step that computed its predecessor; each must
equal the trainer's (`forward_packed` over the whole sequence, the reference trainer's forward).

Needs only torch (+ triton for the CUDA variant): no vLLM.
"""
from __future__ import annotations

import pytest
import torch

from zmrl.batch_invariant import use_path
from zmrl.batch_invariant.collectives import LOCAL
from zmrl.lora import LoraAdapter, LoraConfig
from zmrl.lora.adapter import ALLOWED_TARGETS
from zmrl.model.config import ModelConfig
from zmrl.model.layers import final_logits, init_weights
from zmrl.model.logprobs import token_logprobs
from zmrl.model.packed import forward_packed, split_layer_weights
from zmrl.model.presets import PRESETS
from zmrl.rollout.paged import PagedBatch, entry_dim, paged_forward

BLOCK_SIZE = 8
NUM_BLOCKS = 96
T = 0.7

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# the tiny preset widened to the small preset's attention and hidden dims (index_topk stays 16, so
# the schedules below still select sparsely): at tiny dims torch's bf16 kernels on an H200 gave the
# trainer's bits at every token, so a bf16 negative control there cannot detect batch variance
WIDE = {**PRESETS["tiny"], "hidden_size": 1024, "num_attention_heads": 16, "q_lora_rank": 384,
        "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
        "intermediate_size": 1024, "moe_intermediate_size": 256}
DIMS = {"tiny": PRESETS["tiny"], "wide": WIDE}


# ----------------------------------------------------------------------------- the model under test
class Model:
    shards = LOCAL  # one process holds the whole model (tests/rollout/test_paged_tp.py: a TP rank)

    def __init__(self, dtype: torch.dtype, device: str, lora: bool, dims: str = "tiny"):
        self.cfg = ModelConfig(**DIMS[dims])  # index_topk 16, 4 layers (1 dense, 3 MoE)
        self.weights = {k: v.to(device) for k, v in init_weights(self.cfg, seed=0, dtype=dtype).items()}
        self.w_layers = split_layer_weights(self.cfg, self.weights)
        self.adapter = None
        if lora:
            adapter = LoraAdapter(self.cfg, LoraConfig(r=4, targets=list(ALLOWED_TARGETS)), seed=1, dtype=dtype)
            gen = torch.Generator().manual_seed(2)
            with torch.no_grad():  # nonzero B: the adapter changes every adapted projection
                for name, p in adapter.factors.items():
                    if name.endswith("__B"):
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            self.adapter = adapter.to(device).requires_grad_(False)
        self.dtype, self.device = dtype, device

    def projections(self):
        return None if self.adapter is None else self.adapter.projections

    @torch.no_grad()
    def reference_logprobs(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """The trainer's log-prob of tokens 1..L-1 of each sequence (one packed forward)."""
        ids = [torch.tensor(s, device=self.device) for s in seqs]
        logits = forward_packed(self.cfg, self.weights, self.w_layers, ids, None, self.projections())
        return [token_logprobs(lg[:-1], i[1:], T) for lg, i in zip(logits, ids)]


# ----------------------------------------------------------------------------- the hand-built engine
class PagedEngine:
    """Blocks, block tables, slot mappings and prefix sharing, as a serving engine keeps them."""

    def __init__(self, model: Model, seed: int):
        self.model = model
        cfg = model.cfg
        # unwritten slots hold NaN: reading one into a result would show; block 0 stays zero and is
        # never handed out (vLLM's null block: where the -1 padding of a selection points)
        self.caches = []
        for _ in range(cfg.num_hidden_layers):
            cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, entry_dim(cfg)), float("nan"), dtype=model.dtype,
                               device=model.device)
            cache[0] = 0
            self.caches.append(cache)
        order = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1
        self.free = order.tolist()
        self.refs: dict[int, int] = {}
        self.seqs: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.logprobs: dict[str, dict[int, list[torch.Tensor]]] = {}
        self.first: dict[str, int] = {}

    def add(self, rid: str, tokens: list[int], share: tuple[str, int] | None = None) -> None:
        """A new request; share=(other, n_blocks) reuses other's first n full blocks (a prefix hit)."""
        self.seqs[rid], self.blocks[rid], self.computed[rid], self.logprobs[rid] = list(tokens), [], 0, {}
        if share is not None:
            other, n = share
            assert tokens[:n * BLOCK_SIZE] == self.seqs[other][:n * BLOCK_SIZE]
            assert self.computed[other] >= n * BLOCK_SIZE
            for b in self.blocks[other][:n]:
                self.refs[b] += 1
            self.blocks[rid] = self.blocks[other][:n]
            self.computed[rid] = n * BLOCK_SIZE
        self.first[rid] = self.computed[rid]

    def preempt(self, rid: str) -> None:
        """Free the request's blocks; it will be prefilled again from position 0 (recompute)."""
        self._release(rid)
        self.computed[rid] = 0

    def finish(self, rid: str) -> None:
        self._release(rid)

    def _release(self, rid: str) -> None:
        for b in self.blocks[rid]:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.free.insert(0, b)  # reused next: its stale entries must never leak into a result
        self.blocks[rid] = []

    def step(self, schedule: list[tuple[str, int]]) -> None:
        """Run one forward over (request, number of new tokens) pairs, in this row order."""
        tokens, positions, slots, starts, lens, rows = [], [], [], [0], [], []
        for rid, n in schedule:
            lo = self.computed[rid]
            hi = lo + n
            assert hi <= len(self.seqs[rid]), f"{rid} has only {len(self.seqs[rid])} tokens"
            while len(self.blocks[rid]) * BLOCK_SIZE < hi:
                b = self.free.pop(0)
                self.refs[b] = 1
                self.blocks[rid].append(b)
            for p in range(lo, hi):
                slots.append(self.blocks[rid][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            tokens += self.seqs[rid][lo:hi]
            positions += range(lo, hi)
            starts.append(starts[-1] + n)
            lens.append(hi)
            rows.append((rid, lo, hi))
        width = max(len(self.blocks[rid]) for rid, _ in schedule) + 2  # padded past every request
        table = torch.zeros(len(schedule), width, dtype=torch.int64)
        for r, (rid, _) in enumerate(schedule):
            table[r, :len(self.blocks[rid])] = torch.tensor(self.blocks[rid])
        dev = self.model.device
        batch = PagedBatch(query_start_loc=torch.tensor(starts, device=dev), seq_lens=torch.tensor(lens, device=dev),
                           block_table=table.to(dev), slot_mapping=torch.tensor(slots, device=dev),
                           positions=torch.tensor(positions, device=dev), max_seq_len=max(lens))
        m = self.model
        with torch.no_grad():
            hidden = paged_forward(m.cfg, m.weights, m.w_layers, self.caches, batch,
                                   torch.tensor(tokens, device=dev), m.projections(), shards=m.shards)
            logits = final_logits(m.cfg, m.weights, hidden, m.shards)
        row = 0
        for rid, lo, hi in rows:
            seq = self.seqs[rid]
            # row for position p predicts token p + 1 (the fed or, at the end, the next token)
            have = [p for p in range(lo, hi) if p + 1 < len(seq)]
            if have:
                lp = token_logprobs(logits[row:row + len(have)],
                                    torch.tensor([seq[p + 1] for p in have], device=dev), T)
                for p, v in zip(have, lp):
                    self.logprobs[rid].setdefault(p + 1, []).append(v)
            row += hi - lo
            self.computed[rid] = hi


def _prompts(cfg, seed=3):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    a, b, c, d = rand(45), rand(40), rand(45), rand(7)
    e = a[:3 * BLOCK_SIZE] + rand(14)  # shares a's first 3 full blocks (24 tokens) then diverges
    return {"a": a, "b": b, "c": c, "d": d, "e": e}


def run_schedule(engine: PagedEngine, seqs: dict[str, list[int]], splits: tuple[int, int]) -> None:
    """Mixed prefills, chunked prefill (a's prompt split at `splits`), decodes, late arrivals,
    a preemption with recompute and a prefix-cache hit. Prompt lengths and the completion
    tokens are fixed up front: the 'decode' tokens are fed one per step."""
    s1, s2 = splits
    engine.add("a", seqs["a"])
    engine.add("b", seqs["b"])
    engine.step([("a", s1), ("b", 20)])                       # a's first chunk + b's first chunk
    engine.step([("b", 5), ("a", s2 - s1)])                   # b reaches 25 tokens, a continues
    engine.add("c", seqs["c"])
    engine.step([("a", 30 - s2), ("b", 1), ("c", 30)])       # a's last chunk, b decodes, c joins
    engine.step([("c", 1), ("a", 1), ("b", 1)])               # decodes in another order
    engine.add("e", seqs["e"], share=("a", 3))                # prefix hit: starts at position 24
    engine.add("d", seqs["d"])
    engine.step([("e", 6), ("d", 7), ("a", 1), ("b", 1), ("c", 1)])
    engine.preempt("b")                                       # b recomputes its 28 tokens later
    engine.step([("a", 1), ("c", 1), ("e", 1)])
    engine.step([("b", 28), ("e", 1), ("c", 1)])              # b's recompute beside decodes
    for _ in range(4):
        engine.step([(rid, 1) for rid in ("a", "b", "c", "e")])
    engine.finish("a")
    engine.step([("e", 1), ("c", 1), ("b", 1)])


def _check(engine: PagedEngine, model: Model) -> list[str]:
    """-> descriptions of every token whose paged log-prob differs from the trainer's."""
    rids = sorted(engine.seqs)
    fed = {rid: engine.computed[rid] for rid in rids}
    seqs = [engine.seqs[rid][:fed[rid] + 1] if fed[rid] < len(engine.seqs[rid]) else engine.seqs[rid] for rid in rids]
    refs = model.reference_logprobs(seqs)
    bad = []
    for rid, seq, ref in zip(rids, seqs, refs):
        got = engine.logprobs[rid]
        # a prefix hit starts at a block boundary: tokens up to it came from the other request
        assert sorted(got) == list(range(engine.first[rid] + 1, len(seq))), f"{rid}: log-probs for {sorted(got)}"
        for pos, values in got.items():
            for v in values:
                if not torch.equal(v, ref[pos - 1]):
                    bad.append(f"{rid} token {pos}: paged {float(v)!r} != trainer {float(ref[pos - 1])!r}")
    return bad


def _assert_paged_equals_trainer(model) -> None:
    """Two schedules (chunked prefills, seeds): every sampled token's paged log-prob is the trainer's."""
    seqs = _prompts(model.cfg)
    for seed, splits in ((0, (9, 17)), (1, (16, 29))):
        engine = PagedEngine(model, seed)
        run_schedule(engine, seqs, splits)
        bad = _check(engine, model)
        assert not bad, f"{len(bad)} tokens differ, e.g. {bad[:3]}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_paged_logprobs_equal_trainer(device, dtype, lora):
    model = Model(dtype, device, lora)
    _assert_paged_equals_trainer(model)


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_paged_wide_bf16_cuda(lora):
    """The positive test at the dims of the bf16 CUDA negative control."""
    model = Model(torch.bfloat16, "cuda", lora, dims="wide")
    _assert_paged_equals_trainer(model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_negative_control(device, dtype):
    """The same schedules on torch's default kernels (invariance off): the paged forward's batch
    compositions differ from the trainer's, and so do its log-probs. In bf16 on CUDA the wide dims
    (test_paged_wide_bf16_cuda is the positive test there)."""
    dims = "wide" if (device, dtype) == ("cuda", torch.bfloat16) else "tiny"
    bad = []
    # with and without LoRA (more GEMMs whose kernels may follow the batch)
    for lora in (False, True):
        model = Model(dtype, device, lora=lora, dims=dims)
        seqs = _prompts(model.cfg)
        with use_path("torch"):
            for seed, splits in ((0, (9, 17)), (1, (16, 29))):
                engine = PagedEngine(model, seed)
                run_schedule(engine, seqs, splits)
                bad += _check(engine, model)
    assert bad, "invariance off gave the trainer's bits everywhere: this test cannot detect batch variance"
