import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # GPU tests are the only ones a CPU machine cannot run; everything else runs.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ----------------------------------------------------------------------------- the session's vLLM engine
# One tiny model and one in-process vLLM engine per session (start-up ~15-25 s; a second in-process
# engine would fight the first over vLLM's process-wide state), shared by tests/rollout and by the
# trainers' cross-engine tests (tests/trainer/megatron). The model is the `tiny` preset (index_topk 16)
# made by `zmrl init-model`, tokenizer included (`zmrl check` needs one); engine tests pass token ids.
# max_num_batched_tokens 48 forces chunked prefill on the longer prompts, and the KV pool holds only
# KV_BLOCKS blocks, so a few long requests at once run out of blocks and vLLM preempts one.
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
KV_BLOCKS = 48
"""vLLM needs one max_model_len request to fit (32 blocks); 48 is tight enough to preempt."""


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from zmrl.commands.init_model import init_model

    return init_model("tiny", str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="session")
def tiny_dir(model_dir):
    """The same tiny checkpoint, by the name the model and LoRA tests use."""
    return model_dir


@pytest.fixture(scope="session")
def tiny_bf16_dir(tmp_path_factory):
    """The tiny preset stored in bf16 (`zmrl init-model --preset tiny --dtype bfloat16`): the same
    seed's fp32 weights rounded once; every host then runs it in bf16."""
    from zmrl.commands.init_model import init_model

    return init_model("tiny", str(tmp_path_factory.mktemp("tiny_bf16")), seed=0, dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny_model(model_dir):
    import zmrl.model.hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def kv_cache_gib(cfg, blocks: int) -> float:
    """Bytes of `blocks` blocks of zmrl's latent cache (one fp32 entry per token per layer)."""
    entry = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
    return blocks * BLOCK_SIZE * entry * 4 * cfg.num_hidden_layers / (1 << 30)


@pytest.fixture(scope="session")
def engine(model_dir):
    import vllm  # noqa: F401  (scripts/setup.sh installs it: missing is an error, not a skip)
    from zmrl.model.checkpoint import read_config
    from zmrl.rollout.vllm import VllmEngine

    cfg = read_config(model_dir)
    eng = VllmEngine(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=48,
                     kv_cache_gib=kv_cache_gib(cfg, KV_BLOCKS), num_threads=2, block_size=BLOCK_SIZE)
    yield eng
    eng.shutdown()

