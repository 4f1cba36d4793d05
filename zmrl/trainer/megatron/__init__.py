"""The megatron-core trainer: zmrl's model as Megatron modules (GPTModel + zmrl ModuleSpecs).

compat       every patch applied to megatron-core (CPU without TE/apex), in one place
parallel     process groups (gloo on CPU, NCCL on CUDA), TP and EP over max(TP, EP) ranks, divisibility checks
layers       Column/RowParallelLinear over zmrl.batch_invariant.collectives (canonical leaves, fixed tree), Replicated, LoRA, RMSNorm
projections  zmrl/model's Projections hook over those modules
attention    ZmrlMLA: mla_project / mla_attend_packed (all sequences in one call) / mla_output
mlp          ZmrlDenseMLP, ZmrlMoE: dense_mlp / moe_mlp, experts split whole over the ranks
model        the GPTModel and its layer specs
convert      HF checkpoint and LoRA adapter names <-> each rank's Megatron parameters
trainer      MegatronTrainer (the zmrl.trainer.base API), exported as TRAINER
tp_check     TP=N / EP=M vs TP=1 comparison, run as a script (spawns max(N, M) ranks)

Importing this package does not import megatron; `MegatronTrainer` / `TRAINER` do, on first access.
"""
from __future__ import annotations


def __getattr__(name: str):
    if name in ("MegatronTrainer", "TRAINER"):
        from zmrl.trainer.megatron import trainer

        return getattr(trainer, name)
    raise AttributeError(name)


__all__ = ["TRAINER", "MegatronTrainer"]
