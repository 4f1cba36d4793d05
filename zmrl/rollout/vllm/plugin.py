"""vLLM general plugin: makes model_type "zmrl" / ZmrlForCausalLM servable by vLLM.

Wired in pyproject.toml as

    [project.entry-points."vllm.general_plugins"]
    zmrl = "zmrl.rollout.vllm.plugin:register"

vLLM calls `register()` once in every process it starts (front end, engine core, workers), so
it must be idempotent and cheap: the model class is registered by its import path and only
imported when a worker builds the model.
"""
from __future__ import annotations

ARCHITECTURE = "ZmrlForCausalLM"
MODEL_CLASS = "zmrl.rollout.vllm.model:ZmrlVllmForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    from zmrl.model.hf import register as register_transformers

    # config.json says model_type "zmrl"; vLLM reads it through AutoConfig
    register_transformers()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
