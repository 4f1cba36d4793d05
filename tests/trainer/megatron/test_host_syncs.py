"""A log-prob pass and a train step make no host read per layer (on a GPU each would wait for the
whole queue): the number of host reads is the same for 2 and 4 decoder layers.

CPU: `tests.host_syncs.HostReads` counts the reads a GPU run would wait on, with the value checks
deferred as on a GPU; negative control: with the checks made at once (`ZMRL_DEFER_VALUE_CHECKS=0`
on a GPU) the count grows with the layers. GPU (`gpu`): torch's sync detector counts the real
waits (`torch.cuda.set_sync_debug_mode("warn")`), 2 vs 4 layers.

The models are the tiny preset cut to 2 or 4 layers that all have one MLP kind. The CPU tests
run dense layers only: on the CPU the routed experts run one at a time, reading each MoE layer's
expert ids (`zmrl.model.mlp.expert_slot_outputs`; 2 vs 4 MoE layers: 6 vs 12 `unique` reads). The
GPU's grouped expert kernels size their launches from shapes alone, so the GPU test runs MoE
layers (LoRA on every expert) as well as dense ones.
"""
import collections
import dataclasses
import importlib
import threading
import traceback
import warnings

import pytest
import torch

from tests.host_syncs import HostReads
from zmrl.lora import LoraConfig
from zmrl.model.checkpoint import load_checkpoint, save_weights, write_config
from zmrl.trainer.base import TrainBatch, UpdateSettings

pytestmark = pytest.mark.megatron

checks = importlib.import_module("zmrl.batch_invariant._checks")
sparse_mla_mod = importlib.import_module("zmrl.batch_invariant.sparse_mla")
LORA = LoraConfig(r=4, lora_alpha=8.0)


def _uniform_model(model_dir, out, layers: int, mlp: str) -> str:
    """The tiny checkpoint cut to its first `layers` layers, every one with the MLP of one layer of
    the original: layer 0's (dense) or layer 1's (routed experts + a shared expert)."""
    cfg, weights = load_checkpoint(model_dir, device="cpu")
    source = {"dense": 0, "moe": 1}[mlp]
    cfg = dataclasses.replace(cfg, num_hidden_layers=layers, first_k_dense_replace=layers if mlp == "dense" else 0)
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    for k, v in weights.items():
        parts = k.split(".")
        if k.startswith("model.layers.") and int(parts[2]) < layers and parts[3] != "mlp":
            keep[k] = v  # attention and norms of the layers kept
        if k.startswith(f"model.layers.{source}.mlp."):
            keep.update({k.replace(f"model.layers.{source}.", f"model.layers.{j}."): v.clone() for j in range(layers)})
    save_weights(cfg, keep, out)
    write_config(cfg, out)
    return str(out)


def _batch():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (3, 21, 40)]
    completions = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 2, 7)]
    return prompts, completions


def _step(trainer, prompts, completions, device):
    """One log-prob pass, then one train step of two minibatches on its log-probs."""
    old = trainer.logprobs(prompts, completions, temperature=0.8)
    batch = TrainBatch(prompts=prompts, completions=completions, old_logprobs=old,
                       advantages=torch.tensor([1.0, -0.5, 0.25]))
    trainer.train_step(batch, UpdateSettings(num_minibatches=2, temperature=0.8), step=0)


@pytest.fixture(scope="module")
def trainers(model_dir, tmp_path_factory):
    from zmrl.trainer.megatron import MegatronTrainer

    def build(layers, device, mlp="dense"):
        path = _uniform_model(model_dir, tmp_path_factory.mktemp(f"{mlp}{layers}"), layers, mlp)
        return MegatronTrainer.from_dir(path, LORA, seed=0, device=device)

    return build


def _deferred_on_cpu(monkeypatch):
    for name in ("zmrl.batch_invariant._checks", "zmrl.batch_invariant.sparse_mla", "zmrl.model.layers",
                 "zmrl.model.attention"):
        monkeypatch.setattr(importlib.import_module(name), "defers_checks", lambda t: True)
    monkeypatch.setattr(checks, "_states", {})


def _reads(trainer, prompts, completions) -> HostReads:
    """The reads of one log-prob pass + train step, but for two that read host tensors on a GPU
    too (so wait for nothing there): the CPU sparse-MLA kernel's early exit over its indices (every
    CPU call runs `_sparse_mla_chunked_leaves`; a GPU runs the Triton kernel) and AdamW's step
    counters (torch keeps them on the host)."""
    _step(trainer, prompts, completions, "cpu")  # warm-up: per-shape GEMM decisions are made once
    with HostReads() as reads, reads.paused_in(sparse_mla_mod, "_sparse_mla_chunked_leaves"), \
            reads.paused_in(trainer.optimizer, "step"):
        _step(trainer, prompts, completions, "cpu")
    return reads


def test_host_reads_do_not_grow_with_the_layers(trainers, monkeypatch):
    _deferred_on_cpu(monkeypatch)
    prompts, completions = _batch()
    two, four = (_reads(trainers(n, "cpu"), prompts, completions) for n in (2, 4))
    assert two.counts == four.counts, f"2 layers: {dict(two.counts)}; 4 layers: {dict(four.counts)}"
    print(f"host reads per log-prob pass + train step (2 minibatches): {dict(two.counts)}")


def test_negative_control_checks_at_once_read_per_layer(trainers):
    prompts, completions = _batch()  # CPU checks are made at once: each reads its flag
    two, four = (_reads(trainers(n, "cpu"), prompts, completions) for n in (2, 4))
    assert four.counts["item"] > two.counts["item"], f"2 layers: {dict(two.counts)}; 4 layers: {dict(four.counts)}"


# ----------------------------------------------------------------------------- GPU
def _cuda_syncs(trainer, prompts, completions) -> collections.Counter:
    """The host syncs of one log-prob pass + train step after a warm-up one, counted per call site
    (the innermost zmrl frames), so a failure says where a sync comes from."""
    _step(trainer, prompts, completions, "cuda")  # warm-up: compiles, per-shape decisions, rope tables
    torch.cuda.synchronize()
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        # torch's text for a detected sync; set_sync_debug_mode's own one-time notice about the
        # prototype detector also says "synchronizing" and is no sync
        if "called a synchronizing CUDA operation" in str(message):
            stack = traceback.extract_stack()[:-1]
            frames = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in stack if "/zmrl/" in f.filename]
            where = " <- ".join(reversed(frames[-3:])) or "outside zmrl: " + " <- ".join(
                f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}" for f in reversed(stack[-4:]))
            sites[f"{where} [{threading.current_thread().name}]"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # restored by catch_warnings
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _step(trainer, prompts, completions, "cuda")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


@pytest.mark.gpu
@pytest.mark.parametrize("mlp", ["dense", "moe"])
def test_gpu_syncs_do_not_grow_with_the_layers(trainers, mlp):
    """Every op of the pass and the step counts, the Triton sparse-MLA backward's kernels and their
    host-side planning (key tiles from pinned host bounds, pairs sorted on the device) included,
    and with MoE layers the grouped expert kernels, forward and backward."""
    assert checks.DEFERRED  # the default on a GPU
    prompts, completions = _batch()
    two, four = (_cuda_syncs(trainers(n, "cuda", mlp), prompts, completions) for n in (2, 4))
    print(f"host syncs per log-prob pass + train step (2 minibatches), {mlp}: 2 layers {dict(two)}, "
          f"4 layers {dict(four)}")
    assert two == four


@pytest.mark.gpu
def test_gpu_negative_control_checks_at_once_sync_per_layer(trainers, monkeypatch):
    monkeypatch.setattr(checks, "DEFERRED", False)  # ZMRL_DEFER_VALUE_CHECKS=0
    prompts, completions = _batch()
    two, four = (_cuda_syncs(trainers(n, "cuda"), prompts, completions) for n in (2, 4))
    assert four.total() > two.total(), (dict(two), dict(four))
