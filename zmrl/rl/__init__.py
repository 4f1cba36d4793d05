"""The RL loop and what it needs around it.

inputs      model / tokenizer / dataset preparation and checks (before RUN_DIR is touched)
engines     build the rollout (vllm | reference) and trainer (megatron | reference) sides
loop        RLRun: one step = rollout -> rewards -> advantages -> recompute -> mismatch check ->
            PPO update -> weight sync -> metrics -> checkpoint
rundir      the run dir's lock (held for the run's life) and the base model's fingerprint
checkpoint  atomic checkpoints (adapter PEFT, trainer state, RNG, data cursor), verified on resume
tracking    metrics.jsonl, W&B, the progress bar
report      `zmrl report`: PNG plots and a text summary from metrics.jsonl
"""
