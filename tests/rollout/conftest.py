"""One vLLM engine for the whole test session (start-up is ~15-25 s), over a tiny zmrl model.

The model is the `tiny` preset (index_topk 16) made by `zmrl init-model`, tokenizer included
(`zmrl check` needs one); the engine tests pass token ids. max_num_batched_tokens 48 forces
chunked prefill on the longer prompts, and the KV pool holds only KV_BLOCKS blocks, so a few
long requests at once run out of blocks and vLLM preempts (and later recomputes) one.
"""
import pytest
import torch

pytest.importorskip("vllm")

from zmrl.commands.init_model import init_model  # noqa: E402
from zmrl.model.checkpoint import read_config  # noqa: E402

BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
KV_BLOCKS = 48
"""vLLM needs one max_model_len request to fit (32 blocks); 48 is tight enough to preempt."""


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return init_model("tiny", str(tmp_path_factory.mktemp("tiny")), seed=0)


def kv_cache_gib(cfg, blocks: int) -> float:
    """Bytes of `blocks` blocks of zmrl's latent cache (one fp32 entry per token per layer)."""
    entry = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
    return blocks * BLOCK_SIZE * entry * 4 * cfg.num_hidden_layers / (1 << 30)


@pytest.fixture(scope="session")
def engine(model_dir):
    from zmrl.rollout.vllm import VllmEngine

    cfg = read_config(model_dir)
    eng = VllmEngine(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=48,
                     kv_cache_gib=kv_cache_gib(cfg, KV_BLOCKS), num_threads=2, block_size=BLOCK_SIZE)
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
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 21, 40, 100, 150)]
