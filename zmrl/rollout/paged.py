"""The model over a paged latent cache, as a plain function of tensors (no serving engine).

A serving engine (vLLM, or a test's hand-built allocator) owns, per attention layer, a cache of
fixed-size blocks, [num_blocks, block_size, entry]; a token's entry is the concatenation
[kv_latent (C) | k_rope (R, may be 0) | index_key (Di)], so everything later queries need from
that token sits in one slot (slot = block * block_size + offset). Per step the engine
schedules a flat batch of new tokens (prefill chunks and decode tokens of any requests) and
describes it with a `PagedBatch`; `paged_forward` then runs every layer of zmrl/model:

1. the new tokens' entries are written at `slot_mapping` (write first: a query sees itself);
2. the indexer scores each query against the index keys of its request's whole context,
   gathered through the block table (positions 0..seq_len-1, ascending);
3. top-k picks `index_topk` positions per query (ascending, -1 padded), which the block
   table turns into slots;
4. sparse MLA reads only those slots' latent and rope rows, straight from the cache.

Steps 2-4 run for all requests at once with tensor ops (no per-request loop, no host sync
of their own). A token's computation is the trainer's (`zmrl.model.packed.forward_packed`
over the full sequence): the same index keys in the same positions, the same selected rows in
the same ascending order, through the same batch-invariant kernels; hence the same bits,
however the prompt was chunked, whoever shares the step, whether the blocks came from a
prefix cache and whether the request was preempted and recomputed.

The indexer runs once per layer for the whole step as a packed (varlen) call: each request's
index keys padded to a common width (positions past its context are masked by the causal rule),
and each query scored against its own request's keys only
(`zmrl.batch_invariant.indexer_scores_varlen`, whose scores have the bits of a call over that
request alone).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Mapping

import torch

from zmrl.batch_invariant import indexer_scores_varlen, topk
from zmrl.batch_invariant.collectives import LOCAL, Shards
from zmrl.model.attention import MlaQuery, NewKV, sparse_mla_by_head_leaf
from zmrl.model.config import ModelConfig
from zmrl.model.layers import decoder_layer, embed
from zmrl.model.projections import BASE, Projections
from zmrl.model.sharding import local_config

# The gathered context width is a multiple of this (fewer distinct shapes from step to step).
KEY_ALIGN = 64


@dataclass
class PagedBatch:
    """One step over the paged cache: R requests, N new tokens (all tensors on the cache's device).

    query_start_loc [R + 1]: request r's new tokens are rows query_start_loc[r]:[r + 1]; they
        are the last (query_start_loc[r + 1] - query_start_loc[r]) positions of its context.
    seq_lens [R]: tokens in request r's context after this step (cached + new).
    block_table [R, W]: physical block ids in position order; entries past a request's last
        block are ignored (any value).
    slot_mapping [N]: slot (block * block_size + offset) where each new token's entry goes.
    positions [N]: each new token's position in its request.
    max_seq_len: an upper bound of seq_lens (a host int, so sizing the gather needs no sync).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def entry_dim(cfg: ModelConfig) -> int:
    """Width of one token's cache entry: [latent | rope key | index key]."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim


def slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache [num_blocks, block_size, entry] as a view [num_slots, entry] (no copy)."""
    if cache.dim() != 3:
        raise ValueError(f"a layer's cache must be [num_blocks, block_size, entry], got {tuple(cache.shape)}")
    if cache.stride(2) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise ValueError(f"a layer's cache must hold each block's slots back to back, got strides {cache.stride()}")
    return cache.flatten(0, 1)


def context_slots(batch: PagedBatch, block_size: int) -> torch.Tensor:
    """[R, width]: the slot of position s of request r (width >= every seq_len, a multiple of
    KEY_ALIGN); slot 0 past a request's context (read, then masked by the causal rule)."""
    width = max(KEY_ALIGN, -(-batch.max_seq_len // KEY_ALIGN) * KEY_ALIGN)
    pos = torch.arange(width, device=batch.block_table.device)
    column = (pos // block_size).clamp(max=batch.block_table.shape[1] - 1)
    slots = batch.block_table.long()[:, column] * block_size + pos % block_size
    return torch.where(pos[None, :] < batch.seq_lens.long()[:, None], slots, 0)


def write_entries(rows: torch.Tensor, slot_mapping: torch.Tensor, new: NewKV) -> None:
    """Store the new tokens' [latent | rope key | index key] at their slots."""
    parts = [new.latents] + ([] if new.rope_keys is None else [new.rope_keys]) + [new.index_keys]
    rows[slot_mapping.long()] = torch.cat(parts, -1).to(rows.dtype)


def paged_attend(cfg: ModelConfig, rows: torch.Tensor, slots: torch.Tensor, row_request: torch.Tensor,
                 query: MlaQuery, new: NewKV, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                 shards: Shards = LOCAL) -> torch.Tensor:
    """One layer's attention for every new token of the step -> o_latent [N, H, C].

    rows [num_slots, entry]: the layer's cache (written here); slots [R, width]: context_slots;
    row_request [N]: the request of each new token; query_start_loc [R + 1]: PagedBatch's;
    shards: which head leaves this host holds (cfg and the query then count this host's heads; the
    cache and the selection are whole on every rank)."""
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    write_entries(rows, slot_mapping, new)
    num_reqs, width = slots.shape
    # the indexer needs every context token's index key; only those columns are gathered
    index_keys = rows[:, c + r:][slots.view(-1)]
    key_pos = torch.arange(width, device=rows.device).repeat(num_reqs)
    key_starts = torch.arange(num_reqs + 1, device=rows.device) * width
    # selection is discrete and untrained here, as in zmrl.model.attention.select_tokens;
    # each query against its own request's keys: [N, width], column s = position s
    own = indexer_scores_varlen(query.index_q.detach(), query.index_weights.detach(), index_keys,
                                query.positions, key_pos, query_start_loc, key_starts)
    picked = topk(own, cfg.index_topk)  # positions, ascending, -1 padded
    picked_slots = torch.where(picked >= 0, slots[row_request[:, None], picked.clamp(min=0)], -1)
    # sparse MLA gathers exactly the picked slots' latent and rope rows, in list order, one call
    # per head leaf as on every other host (the per-call head count reaches the kernel's GEMMs)
    return sparse_mla_by_head_leaf(cfg, query, rows[:, :c], rows[:, c:c + r] if r else None, picked_slots, shards)


def paged_forward(
    cfg: ModelConfig,
    w_model: Mapping[str, torch.Tensor],
    w_layers: Sequence[Mapping[str, torch.Tensor]],
    caches: Sequence[torch.Tensor],
    batch: PagedBatch,
    token_ids: torch.Tensor | None = None,
    projections: Callable[[int], Projections] | None = None,
    inputs_embeds: torch.Tensor | None = None,
    shards: Shards = LOCAL,
) -> torch.Tensor:
    """token_ids [N] (or inputs_embeds [N, D]) of the step's new tokens -> hidden [N, D].

    caches: one [num_blocks, block_size, entry_dim(cfg)] tensor per layer, updated in place.
    projections(layer) gives the layer's Projections (an adapter hook); default: weights only.
    Logits are `zmrl.model.layers.final_logits(cfg, w_model, hidden, shards)` for the rows wanted.

    Tensor parallel: `shards` is this process's place in the TP group; the weights are its shards
    (zmrl.model.sharding.shard_weight) and projections(layer) must carry the same `shards` (and
    `expert_shards`). Every rank is fed the same step and holds the same whole hidden states and
    the same whole cache entries (the latent, rope and index keys come from replicated weights);
    each attends its own heads, and the cross-rank sums run by zmrl.batch_invariant.collectives,
    so the bits are the single process's."""
    if len(caches) != cfg.num_hidden_layers:
        raise ValueError(f"need one cache per layer ({cfg.num_hidden_layers}), got {len(caches)}")
    n = batch.num_tokens
    if (inputs_embeds if token_ids is None else token_ids).shape[0] != n or batch.positions.shape[0] != n:
        raise ValueError(f"the step has {n} slots; token ids/embeddings and positions must have {n} rows")
    hidden = inputs_embeds if token_ids is None else embed(w_model, token_ids.long(), shards)
    cfg_layer = local_config(cfg, shards.size)  # this rank's heads
    positions = batch.positions.long()
    device = hidden.device
    row_request = torch.searchsorted(batch.query_start_loc.long()[1:].contiguous(),
                                     torch.arange(n, device=device), right=True)
    slots = context_slots(batch, caches[0].shape[1])  # one block table for every layer
    for layer in range(cfg.num_hidden_layers):
        rows = slot_rows(caches[layer])

        def attend(query: MlaQuery, new: NewKV, rows=rows) -> torch.Tensor:
            return paged_attend(cfg_layer, rows, slots, row_request, query, new, batch.slot_mapping,
                                batch.query_start_loc, shards)

        proj = projections(layer) if projections is not None else BASE
        if proj.shards != shards:
            raise ValueError(f"the projections of layer {layer} hold {proj.shards}, the forward {shards}")
        hidden = decoder_layer(cfg_layer, layer, w_layers[layer], hidden, positions, attend, proj)
    return hidden
