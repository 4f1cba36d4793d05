"""zmrl's engine behind verl's interface reports the rollout's log-probs bit for bit, trains with
verl's PPO loss, and hands the rollout the weights it trains (zmrl.verl.engine).

In process, no Ray: the engine is built the way verl's TrainingWorker builds it
(EngineRegistry.new with verl's config dataclasses) and fed batches in the layout verl's
TransferQueue hands the worker (nested [B, L_i] tensors per field). Completions and their
log-probs come from zmrl's reference rollout (the oracle) at temperature 0.8.
"""
import copy
import os
from functools import partial

import pytest
import torch

from tests.bitwise import first_difference as first_diff

pytestmark = [pytest.mark.verl, pytest.mark.megatron]

os.environ.setdefault("VERL_PLATFORM", "cpu")  # before verl picks its platform

T = 0.8


def _nested(rows, dtype=torch.int64):
    return torch.nested.as_nested_tensor([torch.as_tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def verl_batch(prompts, completions, *, micro_batch_size, **extra):
    """The fields verl's v1 trainer stores per sample, as the worker receives them."""
    from verl.utils import tensordict_utils as tu

    ones = [[1] * len(c) for c in completions]
    tensors = {"prompts": _nested(prompts), "responses": _nested(completions),
               "input_ids": _nested([p + c for p, c in zip(prompts, completions)]),
               "response_mask": _nested(ones), "loss_mask": _nested(ones)}
    tensors.update({k: v for k, v in extra.items() if isinstance(v, torch.Tensor)})
    non_tensor = {"temperature": T, "use_dynamic_bsz": False, "micro_batch_size_per_gpu": micro_batch_size,
                  **{k: v for k, v in extra.items() if not isinstance(v, torch.Tensor)}}
    return tu.get_tensordict(tensors, non_tensor_dict=non_tensor)


def responses_of(model_output, batch) -> list[torch.Tensor]:
    from verl.workers.utils.padding import response_from_nested

    return list(response_from_nested(model_output["log_probs"], batch["response_mask"]).unbind())


@pytest.fixture(scope="module")
def verl_configs(model_dir):
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig

    model = HFModelConfig(path=model_dir, lora_rank=4, lora_alpha=8, model_type="zmrl")
    engine = McoreEngineConfig(use_mbridge=False, seed=0)
    optim = McoreOptimizerConfig(lr=5e-3, weight_decay=0.0, lr_decay_style="constant")
    return model, engine, optim


@pytest.fixture(scope="module")
def _engine(verl_configs):
    from verl.utils.device import get_device_name
    from verl.workers.engine import EngineRegistry

    assert get_device_name() == "cpu", "VERL_PLATFORM=cpu did not take: is zmrl's verl plugin installed?"
    model, engine_cfg, optim = verl_configs
    engine = EngineRegistry.new(model_type="zmrl", backend="megatron", model_config=model, engine_config=engine_cfg,
                                optimizer_config=optim, checkpoint_config=None)
    engine.initialize()
    return engine, copy.deepcopy(engine.trainer.state_dict())


@pytest.fixture
def engine(_engine):
    eng, state = _engine
    eng.trainer.load_state_dict(state)
    eng.trainer.invariant = True
    return eng


@pytest.fixture(scope="module")
def reference_engine(model_dir):
    from zmrl.rollout.reference import ReferenceEngine

    return ReferenceEngine.from_dir(model_dir)


@pytest.fixture(scope="module")
def sampled(reference_engine):
    """(prompts, completions, rollout log-probs): prompts of 3, 21 and 40 tokens (index_topk 16)."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 21, 40)]
    samples = reference_engine.generate(prompts, n=2, max_tokens=12, temperature=T, seed=3, stop_at_eos=False)
    flat = [(p, s) for p, ss in zip(prompts, samples) for s in ss]
    return [p for p, _ in flat], [s.token_ids for _, s in flat], [s.logprobs for _, s in flat]


def test_verl_resolves_model_type_zmrl_to_zmrls_engine_on_cpu_and_cuda(monkeypatch):
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.megatron import MegatronEngineWithLMHead

    from zmrl.verl.engine import ZmrlMegatronEngine

    for device in ("cpu", "cuda"):
        monkeypatch.setenv("VERL_ENGINE_DEVICE", device)
        assert EngineRegistry.get_engine_cls("zmrl", "megatron") is ZmrlMegatronEngine
        # every other model type keeps verl's own Megatron engine
        if device == "cuda":
            assert EngineRegistry.get_engine_cls("language_model", "megatron") is MegatronEngineWithLMHead


@pytest.mark.parametrize("micro_batch_size", [1, 6])
def test_log_probs_equal_the_rollouts_bitwise(engine, sampled, micro_batch_size):
    prompts, completions, rollout_lp = sampled
    batch = verl_batch(prompts, completions, micro_batch_size=micro_batch_size, calculate_entropy=True)
    with engine.eval_mode():
        out = engine.infer_batch(batch)["model_output"]
    for i, (got, want) in enumerate(zip(responses_of(out, batch), rollout_lp)):
        assert torch.equal(got, want), f"sequence {i}: {first_diff(got, want)}"
    # verl's layout: position t scores token t + 1; the prompt's positions carry nothing
    for lp, p in zip(out["log_probs"].unbind(), prompts):
        assert torch.equal(lp[: len(p) - 1], torch.zeros(len(p) - 1))
    assert all(torch.isfinite(e).all() and (e >= 0).all() for e in out["entropy"].unbind())


def test_negative_control_trainer_without_batch_invariance_differs(engine, sampled):
    prompts, completions, rollout_lp = sampled
    engine.trainer.invariant = False
    batch = verl_batch(prompts, completions, micro_batch_size=6)
    with engine.eval_mode():
        got = responses_of(engine.infer_batch(batch)["model_output"], batch)
    assert any(not torch.equal(a, b) for a, b in zip(got, rollout_lp))


def test_a_step_with_verls_ppo_loss_trains_and_the_synced_adapter_scores_like_the_trainer(engine, sampled,
                                                                                          reference_engine):
    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    from zmrl.lora import adapter_from_peft
    from zmrl.rollout.reference import ReferenceEngine

    prompts, completions, rollout_lp = sampled
    adv = torch.linspace(-1.0, 1.0, len(prompts))
    batch = verl_batch(prompts, completions, micro_batch_size=3, global_batch_size=len(prompts),
                       calculate_entropy=False, old_log_probs=_nested(rollout_lp, torch.float32),
                       advantages=_nested([torch.full((len(c),), float(a)) for c, a in zip(completions, adv)],
                                          torch.float32))
    actor = McoreActorConfig(strategy="megatron", ppo_mini_batch_size=len(prompts), use_dynamic_bsz=False,
                             ppo_micro_batch_size_per_gpu=3, rollout_n=1)
    with engine.eval_mode():  # verl scores the old log-probs before every update
        engine.infer_batch(verl_batch(prompts, completions, micro_batch_size=6))
    with engine.train_mode():
        out = engine.train_batch(batch, partial(ppo_loss, config=actor))
    metrics = out["metrics"]
    # the old log-probs are the rollout's, which the trainer reproduces: before the step the ratio is 1
    assert [float(v) for v in metrics["actor/ppo_kl"].values] == [0.0, 0.0]  # one per micro-batch
    assert [float(v) for v in metrics["mismatch/ratio_first_minibatch_max_abs_dev"].values] == [0.0, 0.0]
    assert metrics["grad_norm"] > 0

    gen, peft = engine.get_per_tensor_param(base_sync_done=True)
    adapter = adapter_from_peft(peft, dict(gen), engine.trainer.cfg, dtype=torch.float32, where="test")
    assert adapter.lcfg == engine.lora
    synced = dict(adapter.factors.items())
    assert max(float(t.abs().max()) for k, t in synced.items() if k.endswith("__B")) > 0, "the step changed nothing"
    assert all(torch.equal(t, engine.trainer.adapter_tensors()[k]) for k, t in synced.items())
    host = ReferenceEngine(engine.trainer.cfg, reference_engine.weights, adapter.projections)
    check = verl_batch(prompts, completions, micro_batch_size=6)
    with engine.eval_mode():
        got = responses_of(engine.infer_batch(check)["model_output"], check)
        with engine.disable_adapter():
            base = responses_of(engine.infer_batch(check)["model_output"], check)
    for i, (lp, p, c) in enumerate(zip(got, prompts, completions)):
        want = host.score(p, c, T)
        assert torch.equal(lp, want), f"sequence {i}: {first_diff(lp, want)}"
    assert any(not torch.equal(a, b) for a, b in zip(got, rollout_lp))
    # the reference policy (verl's ref-in-actor for LoRA) is the base model
    for i, (lp, want) in enumerate(zip(base, rollout_lp)):
        assert torch.equal(lp, want), f"sequence {i}: {first_diff(lp, want)}"


def test_a_base_sync_carries_every_checkpoint_weight(engine, model_dir):
    from safetensors.torch import load_file

    checkpoint = load_file(os.path.join(model_dir, "model.safetensors"))
    gen, peft = engine.get_per_tensor_param(base_sync_done=False)
    base = dict(gen)
    assert set(base) == set(checkpoint) and peft["r"] == engine.lora.r
    for k, t in checkpoint.items():
        assert torch.equal(base[k], t), k


def test_settings_the_engine_cannot_honour_are_refused_by_name(verl_configs):
    import dataclasses

    from verl.workers.config import HFModelConfig

    from zmrl.verl.engine import ZmrlEngineError, ZmrlMegatronEngine

    model, engine_cfg, optim = verl_configs
    no_lora = HFModelConfig(path=model.path, lora_rank=0, model_type="zmrl")
    with pytest.raises(ZmrlEngineError, match="lora_rank"):
        ZmrlMegatronEngine(no_lora, engine_cfg, optim, None)
    piped = copy.copy(engine_cfg)
    object.__setattr__(piped, "pipeline_model_parallel_size", 2)
    with pytest.raises(ZmrlEngineError, match="pipeline_model_parallel_size"):
        ZmrlMegatronEngine(model, piped, optim, None)
    decaying = dataclasses.replace(optim, lr_decay_style="cosine")
    with pytest.raises(ZmrlEngineError, match="constant learning rate"):
        ZmrlMegatronEngine(model, engine_cfg, decaying, None)
