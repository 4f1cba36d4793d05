"""Trainers: recompute log-probs and take PPO steps on the LoRA parameters.

base       the API every backend implements (Trainer, TrainBatch, UpdateSettings)
losses     advantages (GRPO, RLOO), PPO-clip token loss, KL estimators, the exact mismatch report
reference  the reference trainer over zmrl.model.packed (the oracle; CPU)
megatron/  megatron-core modules built from zmrl/model functions (imports megatron lazily)
"""
