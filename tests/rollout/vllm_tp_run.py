"""One vLLM engine at tensor_parallel_size = 2 over the tests' tiny model, run as its own process
(vLLM spawns the workers, which re-import the entry module: hence a module with a main guard, not
the pytest process). Writes what tests/rollout/test_vllm_tp.py compares:

    python -m tests.rollout.vllm_tp_run MODEL_DIR OUT.pt

- "base": the prompts' samples (GENERATE), invariance on;
- "ordinary": the same under an ordinary all-reduce (the negative control);
- "synced": after a base-weight sync (SYNCED) and a LoRA sync (adapter()), the same prompts;
- "check": `zmrl check` on this engine against the Megatron trainer at TP 2 (its report).
"""
from __future__ import annotations

import sys

import torch

GENERATE = dict(n=2, max_tokens=8, temperature=0.8, seed=0)
SYNCED = ["model.layers.0.self_attn.o_proj.weight", "model.layers.2.mlp.experts.gate_up_proj",
          "model.layers.0.mlp.down_proj.weight", "lm_head.weight"]
CHECK_PROMPTS = ["What is 12 + 30? The answer is", "Compute 7 * 8 = 56. Therefore 56 - 6 equals"]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    # past index_topk = 16, and 100 > max_num_batched_tokens (chunked prefill)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 21, 40, 100)]


def adapter(cfg):
    from zmrl.lora import LoraAdapter, LoraConfig

    lora = LoraAdapter(cfg, LoraConfig(r=4, lora_alpha=8.0), seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in lora.factors.values():  # nonzero B everywhere: every delta term is live
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return lora


def synced_weights(weights: dict) -> dict:
    gen = torch.Generator().manual_seed(5)
    return {k: weights[k] + 0.05 * torch.randn(weights[k].shape, generator=gen) for k in SYNCED}


def engine_args(model_dir):
    from tests.conftest import BLOCK_SIZE, KV_BLOCKS, MAX_MODEL_LEN, kv_cache_gib
    from zmrl.model.checkpoint import read_config

    return dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=48,
                kv_cache_gib=kv_cache_gib(read_config(model_dir), KV_BLOCKS), block_size=BLOCK_SIZE)


def samples(outputs) -> list:
    return [[(s.token_ids, s.logprobs) for s in ss] for ss in outputs]


def main(model_dir: str, out: str) -> None:
    from safetensors.torch import load_file

    from zmrl.commands.check import check
    from zmrl.model.checkpoint import read_config
    from zmrl.rollout.vllm import VllmEngine

    engine = VllmEngine(model_dir, num_threads=1, extra={"tensor_parallel_size": 2}, **engine_args(model_dir))
    try:
        result = {"base": samples(engine.generate(prompts(), **GENERATE))}
        engine.set_ordinary_all_reduce(True)
        result["ordinary"] = samples(engine.generate(prompts(), **GENERATE))
        engine.set_ordinary_all_reduce(False)
        result["check"] = check(model_dir, CHECK_PROMPTS, engine=engine, trainer="megatron", trainer_tp=2,
                                n=2, max_tokens=8, temperature=0.9, seed=0)
        cfg = read_config(model_dir)
        engine.sync_weights(synced_weights(load_file(f"{model_dir}/model.safetensors")))
        lora = adapter(cfg)
        engine.set_adapter(lora.lcfg)
        engine.sync_weights(adapter=lora)
        result["synced"] = samples(engine.generate(prompts(), **GENERATE))
        torch.save(result, out)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
