"""A serving host's tensor-parallel shard of the model: weights, adapter and Projections.

A serving engine that runs the model over TP ranks (vLLM's workers) keeps, on each rank, the
shard the trainer's TP rank of the same index holds (zmrl.model.sharding) and computes with the
canonical cross-rank arithmetic of zmrl.batch_invariant.collectives, so TP = 1, 2, 4 and 8 give
the same bits as each other and as the trainer. `ShardedWeights` holds the shard under checkpoint
names, slices whole tensors as they arrive (loading, weight sync) and answers the whole
(checkpoint) shapes, which is what the engine's callers send. Imports no serving engine.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from zmrl.batch_invariant.collectives import LOCAL, Shards
from zmrl.lora import LoraAdapter, LoraConfig, LoraProjections
from zmrl.model.config import ModelConfig
from zmrl.model.layers import check_weights
from zmrl.model.packed import split_layer_weights
from zmrl.model.projections import BASE, Projections
from zmrl.model.sharding import EXPERTS, ExpertShard, expert_range, shard_lora_factor, shard_weight

LORA_PREFIX = "lora:"
"""Adapter factors are addressed as LORA_PREFIX + their zmrl.lora.LoraAdapter key."""


class ShardedWeights:
    """This rank's shard of the checkpoint (and of a served adapter), under checkpoint names."""

    def __init__(self, cfg: ModelConfig, shards: Shards = LOCAL, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.cfg, self.shards, self.dtype, self.device = cfg, shards, dtype, torch.device(device)
        self.model: dict[str, torch.Tensor] = {}
        """Every tensor this rank holds (model and layer weights), checkpoint name -> shard."""
        self.layers: list[dict[str, object]] = []
        """Per layer, names relative to model.layers.{i}. -> the tensor zmrl/model indexes
        (a rank's routed experts as an ExpertShard, indexed by global expert id)."""
        self.whole_shapes: dict[str, tuple[int, ...]] = {}
        self.adapter = None
        self._factor_names: dict[str, tuple[str, str]] = {}  # factor key -> (target, "A" | "B")

    # ------------------------------------------------------------------ loading
    def load(self, weights: Iterable[tuple[str, torch.Tensor]], what: str = "checkpoint") -> None:
        """Whole checkpoint tensors (streamed) -> this rank's shards; every name and whole shape is
        checked against the config before the new weights replace the old."""
        shards, shapes = {}, {}
        for name, t in weights:
            shapes[name] = tuple(t.shape)
            # a copy: the whole tensor is not kept alive by a view of it
            shards[name] = shard_weight(self.cfg, name, t, self.shards).to(
                device=self.device, dtype=self.dtype, copy=True).contiguous()
        check_weights(self.cfg, {n: torch.empty(s, device="meta") for n, s in shapes.items()}, what)
        self.model, self.whole_shapes = shards, shapes
        first = expert_range(self.cfg, self.shards).start
        self.layers = split_layer_weights(self.cfg, shards)
        if self.shards.size > 1:
            for w in self.layers:
                for name in EXPERTS & set(w):
                    w[name] = ExpertShard(w[name], first)

    # ------------------------------------------------------------------ the adapter
    def set_adapter(self, lora: dict | None) -> None:
        """lora: zmrl.lora.LoraConfig fields (r, lora_alpha, targets), or None for the base model.
        The adapter is built whole (A from its seed, B zero), then cut to this rank's factors."""
        if lora is None:
            self.adapter, self._factor_names = None, {}
            return
        adapter = LoraAdapter(self.cfg, LoraConfig(**lora), dtype=self.dtype).requires_grad_(False)
        by_id = {}
        for _layer, target, a, b in adapter.items():
            by_id[id(a)], by_id[id(b)] = (target, "A"), (target, "B")
        names = {key: by_id[id(p)] for key, p in adapter.factors.items()}
        self.whole_shapes.update({LORA_PREFIX + k: tuple(p.shape) for k, p in adapter.factors.items()})
        for key, (target, which) in names.items():
            whole = adapter.factors[key]
            adapter.factors[key] = torch.nn.Parameter(
                shard_lora_factor(self.cfg, target, which, whole.data, self.shards).clone(), requires_grad=False)
        self.adapter, self._factor_names = adapter.to(self.device), names

    def projections(self, layer: int) -> Projections:
        """Layer `layer`'s Projections on this rank: the adapter's (if one is served) or the weights'
        alone, with this rank's shards."""
        if self.adapter is None:
            if self.shards.size == 1:
                return BASE
            proj = Projections()
        else:
            proj = ShardedLoraProjections(self.adapter, layer, expert_range(self.cfg, self.shards).start)
        proj.shards = proj.expert_shards = self.shards
        return proj

    # ------------------------------------------------------------------ weight sync
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every served tensor of this worker: checkpoint names (its shards), and the adapter's
        factors as LORA_PREFIX + key."""
        out = dict(self.model)
        if self.adapter is not None:
            out.update({LORA_PREFIX + k: v.data for k, v in self.adapter.factors.items()})
        return out

    def names(self) -> dict[str, tuple[list[int], str]]:
        """name -> (whole shape, dtype) of every tensor `update` accepts."""
        dtype = str(self.dtype).removeprefix("torch.")
        return {k: (list(self.whole_shapes[k]), dtype) for k in self.tensors()}

    @torch.no_grad()
    def update(self, tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """Whole tensors (checkpoint names, or LORA_PREFIX + factor key) -> copied into this rank's
        shards in place. The whole update is checked before anything is written."""
        own = self.tensors()
        unknown = sorted(set(tensors) - set(own))
        wrong = [f"{k} {tuple(t.shape)} (expected {self.whole_shapes[k]})"
                 for k, t in tensors.items() if k in own and tuple(t.shape) != self.whole_shapes[k]]
        if unknown or wrong:
            raise ValueError(f"weight update does not fit the model: unknown {unknown[:8]}, wrong shapes {wrong[:8]}")
        for name, t in tensors.items():
            if name.startswith(LORA_PREFIX):
                target, which = self._factor_names[name[len(LORA_PREFIX):]]
                part = shard_lora_factor(self.cfg, target, which, t, self.shards)
            else:
                part = shard_weight(self.cfg, name, t, self.shards)
            own[name].copy_(part)
        return sorted(tensors)


class ShardedLoraProjections(LoraProjections):
    """zmrl.lora's LoRA projections over an adapter whose routed-expert factors hold this rank's
    experts only (first_expert: the first one's global id; zmrl/model passes global ids)."""

    def __init__(self, adapter: LoraAdapter, layer: int, first_expert: int):
        super().__init__(adapter, layer)
        self.first_expert = first_expert

    def expert_linear(self, name, expert, x, weight, rows=None):
        return super().expert_linear(name, expert - self.first_expert, x, weight, rows)
