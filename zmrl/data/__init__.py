"""Prompt datasets and verifiable rewards.

prompts     load a prompt dataset with HF `datasets` (local JSONL/JSON/parquet, or a hub name) and
            walk it in a seeded, resumable order (PromptStream and its cursor)
rewards     resolve a reward function from "module:function" and call it with clear errors
arithmetic  a locally generated arithmetic task with an exact-match reward (the tiny recipe's task)
gsm8k       the GSM8K format (question / answer with "#### N"): rows -> prompts, and its reward
`datasets` is imported only inside the functions that read files.
"""
