"""One vLLM engine for the whole test session (start-up is ~15-25 s), over a tiny zmrl model.

The model is the `tiny` preset (index_topk 16) written without a tokenizer, so prompts are
token ids; max_num_batched_tokens 48 forces chunked prefill on the longer prompts.
"""
import pytest
import torch

pytest.importorskip("vllm")

from zmrl.model.checkpoint import save_weights, write_config  # noqa: E402
from zmrl.model.config import ModelConfig  # noqa: E402
from zmrl.model.layers import init_weights  # noqa: E402
from zmrl.model.presets import PRESETS  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    cfg = ModelConfig(**PRESETS["tiny"])
    write_config(cfg, out)
    save_weights(cfg, init_weights(cfg, seed=0), out)
    return out


@pytest.fixture(scope="session")
def engine(model_dir):
    from zmrl.rollout.vllm import VllmEngine

    eng = VllmEngine(model_dir, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=48,
                     kv_cache_gib=0.25, num_threads=2, block_size=16)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def reference(model_dir):
    from zmrl.rollout.reference import ReferenceEngine

    return ReferenceEngine.from_dir(model_dir)


@pytest.fixture(scope="session")
def prompts():
    gen = torch.Generator().manual_seed(7)
    # 3 < index_topk = 16 < the rest; 100 and 150 exceed max_num_batched_tokens (chunked prefill)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 21, 40, 100, 150)]
