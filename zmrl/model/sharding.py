"""Tensor-parallel shards of the checkpoint: which part of every tensor a TP rank holds.

One layout for every host that splits the model over TP ranks (the Megatron trainer builds its
modules to it; a serving host slices the checkpoint by it), so rank r of a TP group of size tp
holds the same numbers whichever host it is:

- attention heads: rank r holds heads [r H/tp, (r + 1) H/tp): the rows of q_b_proj and kv_b_proj
  (column-parallel, head-major rows) and the columns of o_proj (row-parallel);
- the dense MLP: the rows of gate_proj and up_proj, the columns of down_proj;
- routed experts: whole, EP = TP: rank r holds the experts of its canonical expert leaves
  (zmrl.batch_invariant.collectives: gcd(8, E) runs of consecutive experts);
- the vocabulary: rows [r V/tp, (r + 1) V/tp) of the embedding and of the LM head;
- everything else (MLA's down-projections and norms, the indexer, the router, the shared expert):
  replicated, whole on every rank.

A contiguous block of rows or columns of a split dimension is exactly that rank's canonical leaves
of it (`Shards.local`), so the TP arithmetic of zmrl.model.projections applies to these slices.
LoRA factors follow their weight: a column-parallel weight's B holds its rows (A is whole), a row-
parallel weight's factors are whole (its delta reads the gathered input), an expert's factors
belong to the expert's rank.

Imports torch and zmrl.batch_invariant only.
"""
from __future__ import annotations

import dataclasses

import torch

from zmrl.batch_invariant.collectives import MAX_TP, Shards, num_leaves
from zmrl.model.config import ModelConfig

HEAD_ROWS = frozenset({"self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight",
                       "mlp.gate_proj.weight", "mlp.up_proj.weight"})
"""Layer weights split over their output rows (dim 0)."""
INPUT_COLUMNS = frozenset({"self_attn.o_proj.weight", "mlp.down_proj.weight"})
"""Layer weights split over their input columns (dim 1)."""
EXPERTS = frozenset({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})
"""Layer weights split over experts (dim 0), whole experts per rank."""
VOCAB = frozenset({"model.embed_tokens.weight", "lm_head.weight"})
"""Model weights split over vocabulary rows (dim 0)."""


def _check_size(option: str, size) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{option} must be an int >= 1, got {size!r}")
    if MAX_TP % size:
        raise ValueError(f"{option}={size} must divide {MAX_TP} (the canonical split of every reduction "
                         f"has {MAX_TP} leaves): use 1, 2, 4 or 8")


def check_divisible(cfg: ModelConfig, tp: int, option: str = "tensor_parallel", *, ep: int | None = None,
                    ep_option: str = "expert_parallel") -> None:
    """Raise, naming every split dimension whose canonical leaves TP does not divide, before any
    process group, engine or module exists. A dimension of size n has gcd(8, n) leaves, so TP must
    be 1, 2, 4 or 8 and divide each of those. `option` names the setting in the message. `ep`: an
    expert-parallel size apart from TP (the Megatron trainer), checked against the routed experts'
    leaves instead of TP; None: the experts are split over the TP ranks (EP = TP, the vLLM model)."""
    _check_size(option, tp)
    if ep is not None:
        _check_size(ep_option, ep)
    dims = {
        "num_attention_heads": cfg.num_attention_heads,
        "num_attention_heads * qk_head_dim": cfg.num_attention_heads * cfg.qk_head_dim,
        "num_attention_heads * v_head_dim": cfg.num_attention_heads * cfg.v_head_dim,
        "vocab_size": cfg.vocab_size,
    }
    if ep is None:
        dims["n_routed_experts"] = cfg.n_routed_experts
    if cfg.first_k_dense_replace:
        dims["intermediate_size"] = cfg.intermediate_size
    bad = [f"{name}={value} ({num_leaves(value)} leaves)" for name, value in dims.items() if num_leaves(value) % tp]
    if bad:
        raise ValueError(f"{option}={tp} must divide the canonical leaves (gcd(8, n)) of every split "
                         f"dimension; it does not divide those of {', '.join(bad)}")
    if ep is not None and num_leaves(cfg.n_routed_experts) % ep:
        raise ValueError(f"{ep_option}={ep} must divide the canonical expert leaves (gcd(8, n)) of "
                         f"n_routed_experts={cfg.n_routed_experts} ({num_leaves(cfg.n_routed_experts)} leaves)")


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config as one TP rank sees it: its share of the attention heads."""
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp)


def expert_range(cfg: ModelConfig, shards: Shards) -> range:
    """The routed experts this rank holds (its canonical expert leaves)."""
    leaves = num_leaves(cfg.n_routed_experts)
    per_leaf = cfg.n_routed_experts // leaves
    mine = shards.local(leaves)
    return range(mine.start * per_leaf, mine.stop * per_leaf)


def vocab_range(cfg: ModelConfig, shards: Shards) -> range:
    per = cfg.vocab_size // shards.size
    return range(shards.rank * per, (shards.rank + 1) * per)


def _chunk(t: torch.Tensor, dim: int, shards: Shards) -> torch.Tensor:
    if t.shape[dim] % shards.size:
        raise ValueError(f"a dimension of {t.shape[dim]} cannot be split over {shards.size} ranks")
    return t.chunk(shards.size, dim)[shards.rank]


def shard_weight(cfg: ModelConfig, name: str, t: torch.Tensor, shards: Shards) -> torch.Tensor:
    """Checkpoint tensor `name` (whole) -> this rank's part (a view; the caller copies)."""
    if shards.size == 1:
        return t
    if name in VOCAB:
        return _chunk(t, 0, shards)
    if not name.startswith("model.layers."):
        return t
    rest = name.split(".", 3)[3]
    if rest in HEAD_ROWS:
        return _chunk(t, 0, shards)
    if rest in INPUT_COLUMNS:
        return _chunk(t, 1, shards)
    if rest in EXPERTS:
        experts = expert_range(cfg, shards)
        return t[experts.start:experts.stop]
    return t


def shard_lora_factor(cfg: ModelConfig, target: str, which: str, t: torch.Tensor, shards: Shards) -> torch.Tensor:
    """A LoRA factor ("A" or "B") of layer weight `target` (whole) -> this rank's part (a view)."""
    if shards.size == 1:
        return t
    if target in EXPERTS:
        experts = expert_range(cfg, shards)
        return t[experts.start:experts.stop]
    if target in HEAD_ROWS and which == "B":
        return _chunk(t, 0, shards)
    return t


class ExpertShard:
    """A rank's routed experts (stacked [E_local, ...]) indexed by global expert id, as
    zmrl.model.mlp indexes a layer's expert weights ([e] or [e, rows])."""

    def __init__(self, local: torch.Tensor, first: int):
        self.local, self.first = local, first

    def __getitem__(self, key):
        e, rows = key if isinstance(key, tuple) else (key, slice(None))
        return self.local[e - self.first][rows]
