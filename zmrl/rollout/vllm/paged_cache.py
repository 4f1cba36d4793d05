"""zmrl's own paged cache inside vLLM: one vector per token per layer, in vLLM-managed blocks.

Each attention layer owns a `LatentCache`, an `AttentionLayerBase` that vLLM's KV-cache manager
sizes, allocates and binds like any attention layer (the pattern of vLLM's DSA indexer cache).
A token's entry is the concatenation [kv_latent (kv_lora_rank) | k_rope (qk_rope_head_dim, may
be 0) | index_key (index_head_dim)] (see zmrl.rollout.paged), so the latent, the rope key and
the indexer key of a token always live in the same slot. The spec is an `MLAAttentionSpec`
because that budgets one vector per token (a `FullAttentionSpec` would reserve K and V).

Per step, `LatentCacheBuilder.build` turns vLLM's `CommonAttentionMetadata` into a small
`StepLayout` (query_start_loc, seq_lens, block_table, slot_mapping on the cache's device, and
the host int max_seq_len), which the model finds in the forward context under a layer's prefix
and hands, with the step's positions, to `zmrl.rollout.paged.paged_forward`: the computation
lives there, free of vLLM. vLLM's block 0 is its null block (never handed out, zero-filled):
the -1 padding of a short selection points there.

vllm is imported here; this module is only loaded inside vLLM processes (via the plugin).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from zmrl.rollout.paged import PagedBatch


@dataclass
class StepLayout:
    """One step's paged layout, as zmrl.rollout.paged.PagedBatch wants it minus the positions."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_seq_len: int

    def batch(self, positions: torch.Tensor) -> PagedBatch:
        return PagedBatch(query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                          block_table=self.block_table, slot_mapping=self.slot_mapping,
                          positions=positions[: self.num_actual_tokens].long(), max_seq_len=self.max_seq_len)


class LatentCacheBuilder(AttentionMetadataBuilder[StepLayout]):
    # No batch reordering: the layer handles any mix of prefills, chunks and decodes alike.
    reorder_batch_threshold: ClassVar[int | None] = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> StepLayout:
        # device tensors as vLLM keeps them (no host copies); the slots of the scheduled tokens
        # are all valid (vLLM's -1 marks only the padding past num_actual_tokens)
        m = common_attn_metadata
        n = m.num_actual_tokens
        return StepLayout(
            query_start_loc=m.query_start_loc[: m.num_reqs + 1].long(),
            seq_lens=m.seq_lens[: m.num_reqs].long(),
            block_table=m.block_table_tensor[: m.num_reqs].long(),
            slot_mapping=m.slot_mapping[:n].long(),
            num_actual_tokens=n,
            max_seq_len=int(m.max_seq_len),
        )


class LatentCacheBackend(AttentionBackend):
    """Storage-only backend: vLLM allocates blocks and builds `StepLayout`; zmrl computes."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float32", "bfloat16", "float16"]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "ZMRL_LATENT_CACHE"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the zmrl layer computes attention itself")

    @staticmethod
    def get_builder_cls() -> type[LatentCacheBuilder]:
        return LatentCacheBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any width: the entry is zmrl's concatenation, not a head

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return True


class LatentCache(torch.nn.Module, AttentionLayerBase):
    """The paged per-token cache of one zmrl attention layer (registered under `prefix`)."""

    def __init__(self, entry_dim: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.entry_dim = entry_dim
        self.dtype = dtype
        self.prefix = prefix
        self.kv_cache = torch.tensor([])
        config = get_current_vllm_config()
        self.block_size = config.cache_config.block_size
        context = config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate zmrl cache layer name: {prefix}")
        context[prefix] = self

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # [blocks, heads=1, block_size, entry] -> [blocks, block_size, entry]; may be a view into
        # one allocation shared by all layers: zmrl.rollout.paged.slot_rows flattens it only
        # where each block's slots lie back to back, and refuses it otherwise
        self.kv_cache = kv_cache.squeeze(1)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.entry_dim,
            dtype=self.dtype,
        )

    def get_attn_backend(self) -> type[AttentionBackend]:
        return LatentCacheBackend

    def layout(self) -> StepLayout | None:
        """This step's StepLayout, or None during vLLM's profiling/dummy runs (no metadata)."""
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            return None
        if isinstance(metadata, list):  # one dict per micro-batch (ubatching); never on CPU
            metadata = metadata[0]
        return metadata.get(self.prefix)
