"""zmrl's own paged cache inside vLLM: one vector per token per layer, in vLLM-managed blocks.

Each attention layer owns a `LatentCache`, an `AttentionLayerBase` that vLLM's KV-cache manager
sizes, allocates and binds like any attention layer (the pattern of vLLM's DSA indexer cache).
A token's entry is the concatenation [kv_latent (kv_lora_rank) | k_rope (qk_rope_head_dim, may
be 0) | index_key (index_head_dim)], so the latent, the rope key and the indexer key of a token
always live in the same slot. The spec is an `MLAAttentionSpec` because that budgets one vector
per token (a `FullAttentionSpec` would reserve K and V).

Per step, `LatentCacheBuilder.build` turns vLLM's `CommonAttentionMetadata` into a small
`PagedBatch` (host tensors: query_start_loc, seq_lens, block_table, slot_mapping) which the
layer finds in the forward context under its own prefix. The layer then
1. writes this step's entries at `slot_mapping` (every scheduled token of every request), and
2. gathers, per request, entries 0..seq_len-1 in ascending position order through the block
   table: exactly the "cache" the trainer sees for the same prefix, whatever the batch holds,
   however the prompt was chunked, and whether the blocks came from the prefix cache.

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


@dataclass
class PagedBatch:
    """One step's view of the paged cache (host tensors; R requests, N scheduled tokens).

    query_start_loc [R + 1]: request r's new tokens are rows query_start_loc[r]:[r + 1] of the
        flat batch; they are the last (query_start_loc[r + 1] - query_start_loc[r]) positions
        of a context of seq_lens[r] tokens.
    seq_lens [R]: tokens in the context after this step (cached + new).
    block_table [R, max_blocks]: physical block ids, in position order.
    slot_mapping [N]: flat slot (block * block_size + offset) for each new token.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


class LatentCacheBuilder(AttentionMetadataBuilder[PagedBatch]):
    # No batch reordering: the layer handles any mix of prefills, chunks and decodes alike.
    reorder_batch_threshold: ClassVar[int | None] = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedBatch:
        m = common_attn_metadata
        n = m.num_actual_tokens
        return PagedBatch(
            query_start_loc=m.query_start_loc_cpu[: m.num_reqs + 1].to(torch.int64),
            seq_lens=m.seq_lens[: m.num_reqs].cpu().to(torch.int64),
            block_table=m.block_table_tensor[: m.num_reqs].cpu().to(torch.int64),
            slot_mapping=m.slot_mapping[:n].cpu().to(torch.int64),
            num_actual_tokens=n,
        )


class LatentCacheBackend(AttentionBackend):
    """Storage-only backend: vLLM allocates blocks and builds `PagedBatch`; zmrl computes."""

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
        # [blocks, heads=1, block_size, entry] -> [blocks, block_size, entry]; may be a strided
        # view into one allocation shared by all layers, so it is only ever indexed, never .view()ed
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

    def batch(self) -> PagedBatch | None:
        """This step's PagedBatch, or None during vLLM's profiling/dummy runs (no metadata)."""
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            return None
        if isinstance(metadata, list):  # one dict per micro-batch (ubatching); never on CPU
            metadata = metadata[0]
        return metadata.get(self.prefix)

    def write(self, batch: PagedBatch, entries: torch.Tensor) -> None:
        """Store entries [N, entry_dim] of this step's new tokens at their slots."""
        slots = batch.slot_mapping
        n = slots.shape[0]
        valid = slots >= 0  # -1 marks padding tokens
        slots = slots[valid]
        cache = self.kv_cache
        cache[slots // cache.shape[1], slots % cache.shape[1]] = entries[:n][valid].to(cache.dtype)

    def read(self, batch: PagedBatch, r: int) -> torch.Tensor:
        """Request r's entries for positions 0..seq_len-1, ascending -> [seq_len, entry_dim]."""
        cache = self.kv_cache
        length = int(batch.seq_lens[r])
        block_size = cache.shape[1]
        num_blocks = (length + block_size - 1) // block_size
        blocks = batch.block_table[r, :num_blocks]
        return cache[blocks].reshape(num_blocks * block_size, cache.shape[2])[:length]
