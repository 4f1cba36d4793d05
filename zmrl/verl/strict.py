"""The strict trainer mode: verl's synchronous PPO trainer with zmrl's exact mismatch check.

Selected with `trainer.v1.trainer_mode=zmrl_strict` (zmrl's Hydra config sets it). After verl
recomputes the old log-probs (the actor's forward over the sampled tokens), every response
token's log-prob the rollout reported is compared with the trainer's by exact equality (`!=`
on the fp32 values, no tolerance). The step's `mismatch/*` metrics, the keys `zmrl train` logs,
go to verl's logger (console, W&B) with the step's other metrics:

    mismatch/logprob_abs_diff_max   max |rollout - trainer| over the step's response tokens
    mismatch/tokens_different       how many response tokens differ in any bit
    mismatch/kl                     mean(rollout - trainer): the k1 estimate, exactly 0.0 when equal
    mismatch/ratio_first_minibatch_max_abs_dev
                                    max |exp(new - old) - 1| over the update's first mini-batch,
                                    before its optimizer step (zmrl's engine reports it)

Any difference stops the run before the update (nothing is trained on the mismatched batch)
with MismatchError naming the first differing token: its sample, its position in the response,
the token and both values. The rollout's log-probs must be recorded
(`actor_rollout_ref.rollout.calculate_log_probs=true`), and `bypass_mode` (which copies the
rollout's log-probs into the old ones, so that no check could ever fail) is refused.
"""
from __future__ import annotations

import sys

import torch

from zmrl.trainer.losses import exact_mismatch

TRAINER_MODE = "zmrl_strict"
METRIC_KEYS = ("mismatch/logprob_abs_diff_max", "mismatch/tokens_different", "mismatch/kl")
RATIO_METRIC = "mismatch/ratio_first_minibatch_max_abs_dev"
"""zmrl.verl.engine's name for it (this module imports no verl engine code)."""


class MismatchError(RuntimeError):
    """Rollout and trainer log-probs differ; the message names the first differing token."""


class StrictConfigError(ValueError):
    """A verl setting under which the strict check would be meaningless; the message names it."""


def check_strict_config(config) -> None:
    arr = config.actor_rollout_ref
    rc = config.algorithm.get("rollout_correction", None) or {}
    if rc.get("bypass_mode", False):
        raise StrictConfigError("algorithm.rollout_correction.bypass_mode=true copies the rollout's log-probs into "
                                "the old log-probs, so the strict check could never fail: set it to false")
    if not arr.rollout.get("calculate_log_probs", False):
        raise StrictConfigError("actor_rollout_ref.rollout.calculate_log_probs=false: the strict check compares the "
                                "rollout's log-probs with the trainer's, so the rollout must record them (set true)")
    if arr.rollout.get("full_determinism", False):
        raise StrictConfigError("actor_rollout_ref.rollout.full_determinism=true switches on vLLM's own batch "
                                "invariance (VLLM_BATCH_INVARIANT); zmrl's kernels give the invariance: set it false")


def masked_responses(values, response_mask) -> list[torch.Tensor]:
    """Nested [B, R_i] log-probs -> per sample the fp32 values where response_mask is 1 (the
    tokens the policy sampled; tool or padding tokens carry no log-prob to compare)."""
    out = []
    for v, m in zip(values.unbind(), response_mask.unbind(), strict=True):
        if v.shape != m.shape:
            raise ValueError(f"log-probs of {v.numel()} response positions but a response mask of {m.numel()}")
        out.append(v.float()[m.bool()])
    return out


def compare(rollout, trainer, response_mask, responses, *, step: int, keys=None, decode=None) -> tuple[dict, str | None]:
    """Both sides' nested [B, R_i] response log-probs -> (the mismatch metrics, None when every
    token is equal, else the message naming the first differing token)."""
    got_r, got_t = masked_responses(rollout, response_mask), masked_responses(trainer, response_mask)
    mm = exact_mismatch(got_r, got_t)
    metrics = {"mismatch/logprob_abs_diff_max": mm["logprob_abs_diff_max"],
               "mismatch/tokens_different": mm["tokens_different"], "mismatch/kl": mm["kl"]}
    if not mm["tokens_different"]:
        return metrics, None
    sample, j, a, b = mm["first"]
    mask = response_mask.unbind()[sample].bool()
    position = int(mask.nonzero()[j])  # the j-th masked token's position in the response
    token = int(responses.unbind()[sample][position])
    text = f" {decode([token])!r}" if decode is not None else ""
    key = f" (key {keys[sample]})" if keys is not None else ""
    message = (f"step {step}: rollout and trainer log-probs differ at {mm['tokens_different']} of {mm['num_tokens']} "
               f"response tokens (max |diff| {mm['logprob_abs_diff_max']:.3e}, kl {mm['kl']:.3e}); first at sample "
               f"{sample}{key}, response position {position} (token id {token}{text}): rollout {a!r} vs trainer "
               f"{b!r}. Stopped before the update.")
    return metrics, message


def _define_trainer():
    import transfer_queue as tq

    from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer

    class StrictPPOTrainer(PPOTrainerSync):
        """verl's synchronous trainer, plus the exact rollout/trainer check after the old log-probs."""

        def __init__(self, config):
            check_strict_config(config)
            super().__init__(config)

        def _compute_old_log_prob(self, batch, metrics: dict):
            batch = super()._compute_old_log_prob(batch, metrics)
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                   select_fields=["rollout_log_probs", "old_log_probs", "response_mask", "responses"])
            decode = getattr(self, "tokenizer", None)
            step_metrics, message = compare(data["rollout_log_probs"], data["old_log_probs"], data["response_mask"],
                                            data["responses"], step=self.global_steps, keys=list(batch.keys),
                                            decode=None if decode is None else decode.decode)
            metrics.update(step_metrics)
            if message is not None:
                raise MismatchError(message)
            return batch

        def _update_actor(self, batch, metrics: dict):
            batch = super()._update_actor(batch, metrics)
            # zmrl's engine reports the first mini-batch's importance ratio; verl prefixed it actor/
            dev = metrics.pop("actor/" + RATIO_METRIC, None)
            if dev is not None:
                metrics[RATIO_METRIC] = float(dev)
                if dev:
                    raise MismatchError(f"step {self.global_steps}: the importance ratio of the first mini-batch "
                                        f"deviates from 1 by {float(dev):.3e} although the log-probs matched: the "
                                        f"trainer's training forward differs from its scoring forward")
            return batch

    StrictPPOTrainer.__qualname__ = StrictPPOTrainer.__name__
    return register_trainer(TRAINER_MODE)(StrictPPOTrainer)


def register():
    """Register the trainer mode (idempotent)."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    existing = TRAINER_REGISTRY.get(TRAINER_MODE)
    return existing if existing is not None else _define_trainer()


if "verl.trainer.ppo.v1" in sys.modules:  # else zmrl.verl.hooks registers it when verl imports it
    register()
