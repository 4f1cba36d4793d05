"""The rollout "zmrl" under verl: weight and LoRA sync through verl's own path leave vLLM's
log-probs equal (torch.equal) to the trainer's.

One local Ray cluster (2 CPUs, VERL_PLATFORM=cpu), one `ZmrlReplica` launched the way verl's
hybrid engine launches it (`init_hybrid` over a worker group), and in that worker a verl
`ServerAdapter` resolved by rollout name, which pushes weights as verl's trainer workers do:
`update_weights(pairs, peft_config=..., base_sync_done=...)` -> ZMQ + shared memory -> the
worker extension's `update_weights_from_ipc`. The trainer is zmrl's reference trainer, built on
the weights the sync carries (the checkpoint's, perturbed, so that a base sync is observable)
and a LoRA with non-zero B factors; it scores the very tokens verl's server sampled.

Controls, each differing from its positive case only by the property under test:
- before the base sync, the served weights are the checkpoint's: log-probs differ from the
  trainer's;
- after the base sync and before the LoRA sync (a sync that skipped the LoRA), they equal the
  trainer's without its adapter and differ from the trainer's with it;
- after both, with zmrl's kernels off on the rollout side (engine_kwargs.zmrl.batch_invariant's
  switch), they differ.
"""
import asyncio
import os
import uuid

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 2, 64, 11], list(range(20, 60))]
MAX_TOKENS = 8
LORA = dict(r=4, lora_alpha=8.0)


def _sync_worker_class():
    from verl.single_controller.base import Worker
    from verl.workers.rollout.base import get_rollout_class

    class SyncWorker(Worker):
        """Stands where verl's trainer worker stands in hybrid mode: holds the ServerAdapter."""

        def __init__(self, rollout_config, model_config):
            super().__init__()
            self.rollout = get_rollout_class(rollout_config.name, rollout_config.mode)(
                config=rollout_config, model_config=model_config, device_mesh=None)

        def update(self, pairs, peft_config, base_sync_done):
            asyncio.run(self.rollout.update_weights(iter(pairs), peft_config=peft_config,
                                                    base_sync_done=base_sync_done, global_steps=1))

    return SyncWorker


@pytest.fixture(scope="module")
def served(model_dir):
    """(replica, worker) with the tiny checkpoint served; Ray torn down at the end."""
    os.environ["VERL_PLATFORM"] = "cpu"
    import ray

    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

    from zmrl.verl.vllm_server import ZmrlReplica

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"VERL_PLATFORM": "cpu", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    try:
        rollout_config = RolloutConfig(
            name="zmrl", mode="async", tensor_model_parallel_size=1, dtype="float32", enforce_eager=True,
            load_format="auto", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128,
            prompt_length=64, response_length=MAX_TOKENS, free_cache_engine=False, gpu_memory_utilization=0.1,
            checkpoint_engine=CheckpointEngineConfig(update_weights_bucket_megabytes=16),
            engine_kwargs={"zmrl": {"kv_cache_memory_bytes": 64 << 20}})
        model_config = HFModelConfig(path=str(model_dir))
        pool = RayResourcePool([1], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(ray.remote(_sync_worker_class()), rollout_config=rollout_config,
                                                           model_config=model_config))
        replica = ZmrlReplica(replica_rank=0, config=rollout_config, model_config=model_config, gpus_per_node=1)
        asyncio.run(replica.init_hybrid(group))
        yield replica, group.workers[0]
    finally:
        ray.shutdown()


def _generate(replica) -> tuple[list[list[int]], list[torch.Tensor]]:
    import ray

    outs = ray.get([replica.server_handle.generate.remote(
        prompt, {"temperature": 1.0, "logprobs": True, "max_tokens": MAX_TOKENS, "ignore_eos": True},
        uuid.uuid4().hex) for prompt in PROMPTS])
    # verl turns vLLM's fp32 log-probs into Python floats: float32 again is the same bits
    return [list(o.token_ids) for o in outs], [torch.tensor(o.log_probs, dtype=torch.float32) for o in outs]


def _tensor(value, like: torch.Tensor) -> torch.Tensor:
    """A worker's answer (nested lists of Python floats, which hold fp32 values exactly) as a tensor."""
    return torch.as_tensor(value, dtype=like.dtype)


def _equal(rollout: list[torch.Tensor], trainer: list[torch.Tensor]) -> bool:
    return all(torch.equal(r, t) for r, t in zip(rollout, trainer, strict=True))


def _first_difference(rollout, trainer) -> str:
    for i, (r, t) in enumerate(zip(rollout, trainer)):
        if not torch.equal(r, t):
            j = int((r != t).nonzero()[0])
            return f"sequence {i} token {j}: rollout {r[j].item()!r} vs trainer {t[j].item()!r}"
    return "none"


def test_base_and_lora_sync_through_verl_leave_rollout_logprobs_equal_to_the_trainers(served, model_dir):
    import ray

    from zmrl.lora import LoraConfig, peft_tensors
    from zmrl.model.checkpoint import load_checkpoint
    from zmrl.trainer.reference import ReferenceTrainer

    replica, worker = served
    cfg, weights = load_checkpoint(model_dir)
    gen = torch.Generator().manual_seed(3)
    trained = {k: v + 0.01 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v
               for k, v in weights.items()}
    trainer = ReferenceTrainer(cfg, trained, LoraConfig(**LORA), seed=0)
    with torch.no_grad():
        for name, p in trainer.adapter.factors.items():
            if name.endswith("__B"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    # what verl's Megatron engine hands the rollout with a non-merged LoRA (build_peft_config_for_vllm)
    peft_config = {"task_type": "CAUSAL_LM", "peft_type": "LORA", "r": LORA["r"], "lora_alpha": LORA["lora_alpha"],
                   "target_modules": "all-linear", "bias": "none", "lora_dropout": 0.0}

    def trainer_logprobs(completions, adapter):
        return trainer.logprobs(PROMPTS, completions, temperature=1.0, adapter=adapter)

    # control: the checkpoint's weights are served, not the trainer's
    completions, before = _generate(replica)
    assert not _equal(before, trainer_logprobs(completions, adapter=False))

    # base weights first, as verl's hybrid worker does for a LoRA run (peft_config set, base_sync_done False)
    ray.get(worker.update.remote(list(trained.items()), peft_config, False))
    completions, base_only = _generate(replica)
    base_trainer = trainer_logprobs(completions, adapter=False)
    assert _equal(base_only, base_trainer), _first_difference(base_only, base_trainer)
    # control: a sync that skipped the LoRA differs from the trainer with its adapter
    assert not _equal(base_only, trainer_logprobs(completions, adapter=True))

    ray.get(worker.update.remote(list(peft_tensors(trainer.adapter).items()), peft_config, True))
    landed = ray.get(replica.server_handle.zmrl_worker_call.remote("zmrl_adapter_factors"))[0]
    assert landed.keys() == trainer.adapter.factors.keys()
    assert all(torch.equal(_tensor(landed[k], v), v.detach()) for k, v in trainer.adapter.factors.items())
    completions, synced = _generate(replica)
    lora_trainer = trainer_logprobs(completions, adapter=True)
    assert _equal(synced, lora_trainer), _first_difference(synced, lora_trainer)
    assert sum(len(c) for c in completions) == len(PROMPTS) * MAX_TOKENS

    # control: the same served weights with zmrl's kernels off on the rollout side
    ray.get(replica.server_handle.zmrl_set_batch_invariant.remote(False))
    try:
        completions, variant = _generate(replica)
        assert not _equal(variant, trainer_logprobs(completions, adapter=True))
    finally:
        ray.get(replica.server_handle.zmrl_set_batch_invariant.remote(True))


def test_a_sync_that_does_not_fit_the_model_is_refused_whole(served):
    """A bucket naming a tensor zmrl's model lacks fails the sync with that name, nothing of the
    bucket is copied, and the trainer side gets the error instead of waiting forever."""
    import ray

    replica, worker = served
    norm = torch.as_tensor(ray.get(replica.server_handle.zmrl_worker_call.remote("zmrl_tensor", "model.norm.weight"))[0])
    with pytest.raises(ray.exceptions.RayTaskError, match="refused.*nothing was copied.*model.layers.0.not_a_weight"):
        ray.get(worker.update.remote([("model.norm.weight", torch.zeros_like(norm)),
                                      ("model.layers.0.not_a_weight", torch.zeros(3))], None, False), timeout=300)
    after = _tensor(ray.get(replica.server_handle.zmrl_worker_call.remote("zmrl_tensor", "model.norm.weight"))[0], norm)
    assert torch.equal(after, norm) and not torch.equal(after, torch.zeros_like(norm))
