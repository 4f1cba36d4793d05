"""zmrl served by vLLM: plugin (registration), model (host over zmrl/model), paged_cache (the
per-layer latent cache in vLLM blocks), worker (RPC methods), engine (the API the loop uses).

Importing this package does not import vllm; `VllmEngine` does, on first access.
"""
from __future__ import annotations


def __getattr__(name: str):
    if name in ("VllmEngine", "EngineConfig", "Sample"):
        from zmrl.rollout.vllm import engine

        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["EngineConfig", "Sample", "VllmEngine"]
