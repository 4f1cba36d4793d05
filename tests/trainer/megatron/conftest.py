"""The Megatron trainer's fixtures: one trainer (hence one process group) per session.

The trainer and the reference trainer are built once over the session's tiny model (`model_dir`,
tests/conftest.py, shared with the vLLM engine); `mt` / `ref` hand them out reset to their
initial state, so tests that train do not leak into each other. Completions are sampled by the
reference rollout over prompts of 3, 21 and 40 tokens (index_topk = 16: the longer contexts
attend sparsely), so one packed batch mixes lengths on both sides of the top-k threshold.
"""
import copy
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

import megatron.core  # noqa: F401  (installed by scripts/setup.sh: a missing one is an error, not a skip)

T = 0.8
"""Sampling temperature of every test here (log-probs are of logits / T)."""


@pytest.fixture(scope="session")
def lora_config():
    from zmrl.lora import LoraConfig

    return LoraConfig(r=4, lora_alpha=8.0)


@pytest.fixture(scope="session")
def _megatron(model_dir, lora_config):
    from zmrl.trainer.megatron import MegatronTrainer

    trainer = MegatronTrainer.from_dir(model_dir, lora_config, seed=0)
    return trainer, copy.deepcopy(trainer.state_dict())


@pytest.fixture(scope="session")
def _reference(model_dir, lora_config):
    from zmrl.trainer.reference import ReferenceTrainer

    trainer = ReferenceTrainer.from_dir(model_dir, lora_config, seed=0)
    return trainer, copy.deepcopy(trainer.state_dict())


@pytest.fixture
def mt(_megatron):
    trainer, state = _megatron
    trainer.load_state_dict(state)
    trainer.invariant = True
    return trainer


@pytest.fixture
def ref(_reference):
    trainer, state = _reference
    trainer.load_state_dict(state)
    return trainer


@pytest.fixture(scope="session")
def reference_engine(model_dir):
    from zmrl.rollout.reference import ReferenceEngine

    return ReferenceEngine.from_dir(model_dir)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cuda_dir(request, model_dir, tmp_path_factory):
    """The tiny checkpoint as stored (fp32), then converted to bf16 (its config says so)."""
    from zmrl.model.checkpoint import load_checkpoint, save_weights, write_config

    if request.param == "float32":
        return model_dir
    out = tmp_path_factory.mktemp("tiny-bf16")
    cfg, weights = load_checkpoint(model_dir, device="cpu")
    cfg = dataclasses.replace(cfg, torch_dtype="bfloat16")
    save_weights(cfg, {k: v.bfloat16() for k, v in weights.items()}, out)
    write_config(cfg, out)
    shutil.copy(Path(model_dir) / "tokenizer.json", out / "tokenizer.json")
    return str(out)


@pytest.fixture(scope="session")
def prompt_ids():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 21, 40)]


@pytest.fixture(scope="session")
def sampled(reference_engine, prompt_ids):
    """(prompts, completions): two completions per prompt sampled by the reference rollout."""
    samples = reference_engine.generate(prompt_ids, n=2, max_tokens=20, temperature=T, seed=3, stop_at_eos=False)
    prompts = [p for p, ss in zip(prompt_ids, samples) for _ in ss]
    return prompts, [s.token_ids for ss in samples for s in ss]


def random_adapter(trainer, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Nonzero A and B (a trained adapter's shape of values) in the canonical layout."""
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(t.shape, generator=gen) * scale).to(t.dtype) for k, t in trainer.adapter_tensors().items()}


def set_reference_adapter(ref, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, p in ref.adapter.factors.items():
            p.copy_(tensors[k])
        for k, m in zip(ref.names, ref.masters):
            m.copy_(tensors[k].float())
