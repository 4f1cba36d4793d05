"""VllmEngine.last_stats counts what the loop reports as rollout/prefill_chunks and
rollout/prefix_cache_hit_frac: on the session engine (48-token prefill budget, 16-token blocks), a
100-token prompt alone is prefilled in 3 chunks of which 2 leave it unfinished, a 3-token one in
none; its second sample reuses its full blocks from the prefix cache, a fresh engine state none."""
import pytest
import torch

pytestmark = pytest.mark.vllm


def _prompt(n, seed):
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_chunks_and_prefix_cache_hits_are_counted(engine):
    engine.llm.reset_prefix_cache()
    engine.generate([_prompt(3, 1)], n=1, max_tokens=2, temperature=1.0, seed=0)
    assert engine.last_stats == {"prompt_tokens": 3, "prefix_cached_tokens": 0, "prefill_chunks": 0}
    engine.generate([_prompt(100, 2)], n=1, max_tokens=2, temperature=1.0, seed=0)
    assert engine.last_stats == {"prompt_tokens": 100, "prefix_cached_tokens": 0, "prefill_chunks": 2}
    # the same prompt again: its 6 full blocks (96 tokens) come from the prefix cache
    engine.generate([_prompt(100, 2)], n=1, max_tokens=2, temperature=1.0, seed=1)
    assert engine.last_stats["prefix_cached_tokens"] == 96
    assert engine.last_stats["prefill_chunks"] == 0  # 4 remaining tokens fit one step
