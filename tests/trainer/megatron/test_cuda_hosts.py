"""On a CUDA GPU every host of the model gives the same bits, in fp32 and in bf16.

Hosts: the transformers host (AutoModelForCausalLM, one sequence per call), the reference rollout
(its sampled tokens' reported log-probs, and `score`), the reference trainer and the Megatron
trainer (every sequence in one packed forward). Prompts of 3, 21 and 40 tokens (index_topk = 16:
the longer ones attend sparsely), two sampled completions each; the base model (Megatron with its
fresh zero adapter, the others with none: the two MoE paths), with the adapter switched off, and
with one nonzero adapter on every host. Negative control: the same rollout vs trainer comparison
on torch's default kernels (`--batch-invariant off`) differs.
"""
import copy

import pytest
import torch

import zmrl.batch_invariant as bi
from tests.bitwise import first_difference
from zmrl.lora import LoraAdapter, LoraConfig
from zmrl.model.checkpoint import load_checkpoint
from zmrl.model.logprobs import token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]

T = 0.8
LORA = LoraConfig(r=4, lora_alpha=8.0)


@pytest.fixture(scope="module")
def hosts(cuda_dir):
    import zmrl.model.hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    from zmrl.rollout.reference import ReferenceEngine
    from zmrl.trainer.megatron import MegatronTrainer
    from zmrl.trainer.reference import ReferenceTrainer

    engine = ReferenceEngine.from_dir(cuda_dir, device="cuda")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, engine.cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 21, 40)]
    mt = MegatronTrainer.from_dir(cuda_dir, LORA, seed=0, device="cuda")
    return dict(
        engine=engine, prompts=prompts, mt=mt, mt_fresh=copy.deepcopy(mt.state_dict()),
        hf=AutoModelForCausalLM.from_pretrained(cuda_dir).to("cuda").eval(),
        ref=ReferenceTrainer.from_dir(cuda_dir, LORA, seed=0, device="cuda"),
    )


def _hf_logprobs(model, prompts, completions, adapter):
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            logits = model(torch.tensor([p + c], device="cuda"), adapter=adapter).logits[0]
            out.append(token_logprobs(logits[len(p) - 1:-1], torch.tensor(c, device="cuda"), T).cpu())
    return out


def _count(got, want) -> tuple[int, str]:
    n = sum(int((a != b).sum()) for a, b in zip(got, want))
    first = next((f"sequence {i}: {first_difference(a, b)}" for i, (a, b) in enumerate(zip(got, want))
                  if not torch.equal(a, b)), "")
    return n, first


def _assert_all_equal(sides: dict, want_name: str):
    want = sides[want_name]
    for name, got in sides.items():
        n, first = _count(got, want)
        assert n == 0, f"{name} vs {want_name}: {n} of {sum(len(w) for w in want)} tokens differ; {first}"


def _rollout(hosts, projections=None):
    engine = hosts["engine"]
    engine.projections = projections
    try:
        with bi.batch_invariant_mode(True):
            samples = engine.generate(hosts["prompts"], n=2, max_tokens=20, temperature=T, seed=3, stop_at_eos=False)
        prompts = [p for p, ss in zip(hosts["prompts"], samples) for _ in ss]
        completions = [s.token_ids for ss in samples for s in ss]
        reported = [s.logprobs for ss in samples for s in ss]
        scored = [engine.score(p, c, T) for p, c in zip(prompts, completions)]
    finally:
        engine.projections = None
    return prompts, completions, reported, scored


def test_base_model_every_host_same_bits(hosts):
    prompts, completions, reported, scored = _rollout(hosts)
    assert max(len(p) + len(c) for p, c in zip(prompts, completions)) > hosts["engine"].cfg.index_topk
    mt, ref = hosts["mt"], hosts["ref"]
    mt.load_state_dict(hosts["mt_fresh"])  # fresh: B = 0, the adapter is the base model
    _assert_all_equal({
        "rollout (reported)": reported,
        "rollout score": scored,
        "transformers host": _hf_logprobs(hosts["hf"], prompts, completions, None),
        "reference trainer, adapter off": ref.logprobs(prompts, completions, temperature=T, adapter=False),
        "megatron, zero adapter": mt.logprobs(prompts, completions, temperature=T),
        "megatron, adapter off": mt.logprobs(prompts, completions, temperature=T, adapter=False),
    }, "rollout (reported)")


def test_nonzero_adapter_every_host_same_bits(hosts):
    mt, ref = hosts["mt"], hosts["ref"]
    gen = torch.Generator().manual_seed(5)
    tensors = {k: (torch.randn(t.shape, generator=gen) * 0.05).to(t.dtype) for k, t in mt.adapter_tensors().items()}
    mt.load_adapter_tensors(tensors)
    with torch.no_grad():
        for k, p in ref.adapter.factors.items():
            p.copy_(tensors[k])
    adapter = LoraAdapter(hosts["engine"].cfg, LORA, dtype=next(iter(tensors.values())).dtype)
    with torch.no_grad():
        for k, p in adapter.factors.items():
            p.copy_(tensors[k])
    adapter = adapter.requires_grad_(False).to("cuda")
    prompts, completions, reported, scored = _rollout(hosts, adapter.projections)
    base = hosts["engine"]
    _assert_all_equal({
        "rollout (reported)": reported,
        "rollout score": scored,
        "transformers host": _hf_logprobs(hosts["hf"], prompts, completions, adapter),
        "reference trainer": ref.logprobs(prompts, completions, temperature=T),
        "megatron": mt.logprobs(prompts, completions, temperature=T),
    }, "rollout (reported)")
    # the adapter changed something (the equalities are not the base model's)
    assert _count(reported, [base.score(p, c, T) for p, c in zip(prompts, completions)])[0] > 0


def test_negative_control_default_kernels_differ_on_cuda(hosts):
    """`--batch-invariant off`: the rollout's decode-step log-probs vs the Megatron trainer's packed
    forward, both on torch's default kernels (cuBLAS picks its kernel by M): they differ."""
    mt = hosts["mt"]
    mt.load_state_dict(hosts["mt_fresh"])
    engine = hosts["engine"]
    with bi.batch_invariant_mode(False), bi.use_path("torch"):
        samples = engine.generate(hosts["prompts"], n=2, max_tokens=20, temperature=T, seed=3, stop_at_eos=False)
    prompts = [p for p, ss in zip(hosts["prompts"], samples) for _ in ss]
    completions = [s.token_ids for ss in samples for s in ss]
    mt.invariant = False
    try:
        got = mt.logprobs(prompts, completions, temperature=T)
    finally:
        mt.invariant = True
    n, _ = _count([s.logprobs for ss in samples for s in ss], got)
    assert n > 0


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_paged_forward_equals_megatron(hosts, cuda_dir, lora):
    """The vLLM-side forward (zmrl.rollout.paged over a hand-built paged cache: one prompt prefilled
    in two chunks beside whole prefills of the others, then every completion token decoded in one
    mixed batch per step) gives the Megatron trainer's bits for every completion token."""
    from types import SimpleNamespace

    from tests.rollout.test_paged_forward import T as PAGED_T
    from tests.rollout.test_paged_forward import PagedEngine
    from zmrl.batch_invariant.collectives import LOCAL
    from zmrl.model.packed import split_layer_weights

    mt = hosts["mt"]
    mt.load_state_dict(hosts["mt_fresh"])
    prompts, completions, _, _ = _rollout(hosts)
    cfg, weights = load_checkpoint(cuda_dir, device="cuda")
    projections = None
    if lora:
        gen = torch.Generator().manual_seed(7)
        tensors = {k: (torch.randn(t.shape, generator=gen) * 0.05).to(t.dtype) for k, t in mt.adapter_tensors().items()}
        mt.load_adapter_tensors(tensors)
        adapter = LoraAdapter(cfg, LORA, dtype=next(iter(tensors.values())).dtype)
        with torch.no_grad():
            for k, p in adapter.factors.items():
                p.copy_(tensors[k])
        projections = adapter.requires_grad_(False).to("cuda").projections
    model = SimpleNamespace(cfg=cfg, weights=weights, w_layers=split_layer_weights(cfg, weights),
                            dtype=next(iter(weights.values())).dtype, device="cuda", projections=lambda: projections,
                            shards=LOCAL)
    engine = PagedEngine(model, seed=0)
    rids = [str(i) for i in range(len(prompts))]
    for rid, p, c in zip(rids, prompts, completions):
        engine.add(rid, p + c)
    half = len(prompts[0]) // 2 or 1
    with bi.batch_invariant_mode(True):
        engine.step([("0", half)] + [(r, len(p)) for r, p in zip(rids[1:], prompts[1:])])
        engine.step([(rids[-1], 1), ("0", len(prompts[0]) - half)])
        while True:
            todo = [(r, 1) for r, p, c in zip(rids, prompts, completions) if engine.computed[r] < len(p) + len(c)]
            if not todo:
                break
            engine.step(todo[::-1] if len(todo) % 2 else todo)  # the row order changes between steps
    paged = [torch.stack([engine.logprobs[r][q][0] for q in range(len(p), len(p) + len(c))]).cpu()
             for r, p, c in zip(rids, prompts, completions)]
    try:
        _assert_all_equal({"paged forward": paged,
                           "megatron": mt.logprobs(prompts, completions, temperature=PAGED_T)}, "megatron")
    finally:
        mt.load_state_dict(hosts["mt_fresh"])
