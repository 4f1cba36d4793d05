import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # GPU tests are the only ones a CPU machine cannot run; everything else runs.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # the marker, not `"gpu" in item.keywords`: keywords hold every node's name, so a checkout
        # in a directory called "gpu" would skip the whole suite
        if item.get_closest_marker("gpu") is not None:
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
    from zmrl.model.factory import init_model

    return init_model("tiny", str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="session")
def tiny_dir(model_dir):
    """The same tiny checkpoint, by the name the model and LoRA tests use."""
    return model_dir


@pytest.fixture(scope="session")
def tiny_bf16_dir(tmp_path_factory):
    """The tiny preset stored in bf16 (`zmrl init-model --preset tiny --dtype bfloat16`): the same
    seed's fp32 weights rounded once; every host then runs it in bf16."""
    from zmrl.model.factory import init_model

    return init_model("tiny", str(tmp_path_factory.mktemp("tiny_bf16")), seed=0, dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny_model(model_dir):
    import zmrl.model.hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def kv_cache_gib(cfg, blocks: int) -> float:
    """Bytes of `blocks` blocks of zmrl's latent cache (one entry per token per layer, in the model's dtype)."""
    entry = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
    width = 2 if cfg.torch_dtype == "bfloat16" else 4
    return blocks * BLOCK_SIZE * entry * width * cfg.num_hidden_layers / (1 << 30)


class OneEngine:
    """vLLM runs one in-process engine at a time: this hands out the engine serving a model dir,
    shutting the other one down first when a test asks for another model (the fp32 tiny model
    and its bf16 copy). Tests of one model are grouped in files, so this restarts rarely."""

    def __init__(self):
        self.engine = None

    def get(self, model_dir):
        from pathlib import Path

        from zmrl.model.checkpoint import read_config
        from zmrl.rollout.vllm import VllmEngine

        if self.engine is not None and Path(self.engine.model_dir) != Path(model_dir):
            self.close()
        if self.engine is None:
            cfg = read_config(model_dir)
            self.engine = VllmEngine(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                     max_num_batched_tokens=48, kv_cache_gib=kv_cache_gib(cfg, KV_BLOCKS),
                                     num_threads=2, block_size=BLOCK_SIZE)
        return self.engine

    def close(self):
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


@pytest.fixture(scope="session")
def engines():
    import vllm  # noqa: F401  (scripts/setup.sh installs it: missing is an error, not a skip)

    one = OneEngine()
    yield one
    one.close()


@pytest.fixture
def engine(engines, model_dir):
    """The session's engine over the fp32 tiny model."""
    return engines.get(model_dir)


@pytest.fixture
def bf16_engine(engines, tiny_bf16_dir):
    """The session's engine over the bf16 tiny model (the fp32 one is shut down meanwhile)."""
    return engines.get(tiny_bf16_dir)
