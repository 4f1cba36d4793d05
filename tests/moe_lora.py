"""Shared by the grouped-MoE-with-LoRA tests (interpreter and CUDA): a stand-in adapter and the
per-expert loop as the composed reference."""
from types import SimpleNamespace

from zmrl.lora.adapter import LoraProjections


class StubAdapter:
    """The face LoraProjections reads: pair(layer, name) and lcfg.scale."""

    def __init__(self, pairs, scale):
        self.pairs, self.lcfg = pairs, SimpleNamespace(scale=scale)

    def pair(self, layer, name):
        return self.pairs.get(name)


class Looped(LoraProjections):
    """The same adapter through the per-expert loop (the composed reference)."""

    def grouped_experts(self, w):
        return None
