"""The rollout tests' fixtures. The session's tiny model (`model_dir`) and its one vLLM engine
(`engine`) live in tests/conftest.py, shared with the trainers' cross-engine tests.
"""
import pytest
import torch


@pytest.fixture(scope="session")
def reference(model_dir):
    from zmrl.rollout.reference import ReferenceEngine

    return ReferenceEngine.from_dir(model_dir)


@pytest.fixture(scope="session")
def prompts():
    gen = torch.Generator().manual_seed(7)
    # 3 < index_topk = 16 < the rest; 100 and 150 exceed max_num_batched_tokens (chunked prefill)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 21, 40, 100, 150)]
