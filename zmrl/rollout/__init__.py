"""Rollout engines: sample completions and report each sampled token's log-prob.

vllm/       the zmrl model served by vLLM over its paged cache (imports vllm lazily)
reference   a plain loop over zmrl/model (the test oracle)
"""
