"""A plain host for the layer functions: sequences packed into rows, one cache per sequence.

This is the loop the transformers model (and any simple host) runs. The valid tokens of all
sequences are flattened into one [T_total, D] row block for every row-wise op (the kernels
are row-invariant, so a token's bits do not depend on its batchmates), while attention runs
per sequence over a view holding that sequence's tokens only. Padding never enters: callers
pass each sequence's real tokens, not a padded rectangle.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from zmrl.batch_invariant import Packing
from zmrl.model.attention import CacheView, MlaQuery, NewKV, mla_attend, select_tokens
from zmrl.model.config import ModelConfig
from zmrl.model.layers import Trace, decoder_layer, embed, final_logits
from zmrl.model.projections import BASE, Projections


class SequenceCache:
    """One sequence's KV cache: per layer, a CacheView of every token seen so far."""

    def __init__(self, num_layers: int):
        self.layers: list[CacheView | None] = [None] * num_layers
        self.length = 0

    def view(self, layer: int, new: CacheView) -> CacheView:
        past = self.layers[layer]
        return new if past is None else CacheView.concat([past, new])


def split_layer_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Full checkpoint mapping -> per-layer mappings with names relative to model.layers.{i}."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_hidden_layers)]
    for name, t in weights.items():
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers."):].split(".", 1)
            out[int(idx)][rest] = t
    return out


def forward_packed(
    cfg: ModelConfig,
    w_model: Mapping[str, torch.Tensor],
    w_layers: Sequence[Mapping[str, torch.Tensor]],
    token_ids: Sequence[torch.Tensor],
    caches: Sequence[SequenceCache] | None = None,
    projections: Callable[[int], Projections] | None = None,
    selections: list | None = None,
    trace: Trace | None = None,
) -> list[torch.Tensor]:
    """token_ids: one [L_b] tensor per sequence (its new tokens) -> one logits [L_b, V] per sequence.

    caches: one SequenceCache per sequence (extended in place), or None for a fresh forward.
    projections(layer) gives the layer's Projections (an adapter hook); default: weights only.
    selections, if a list, receives (layer, sequence, indices) from the indexer (for tests).
    trace(stage, layer, tensor) sees the packed activations [T_total, *]: "embed" (layer -1),
    decoder_layer's stages, "layer" (each layer's output) and "logits" (layer -1).
    """
    lengths = [int(t.numel()) for t in token_ids]
    starts = [sum(lengths[:b]) for b in range(len(lengths))]
    past = [c.length if c is not None else 0 for c in (caches or [None] * len(lengths))]
    device = w_model["model.embed_tokens.weight"].device
    positions = torch.cat([torch.arange(p, p + n, device=device) for p, n in zip(past, lengths)]) if lengths \
        else torch.zeros(0, dtype=torch.long, device=device)
    hidden = embed(w_model, torch.cat([t.reshape(-1).to(device) for t in token_ids]).long())
    if trace is not None:
        trace("embed", -1, hidden)
    # a fresh sequence attends over its own rows only: it says so with a one-sequence packing (built
    # once per forward), which gives its key gradients the kernel a packed host runs; only a backward
    # reads it, so an inference forward (a rollout's prefill) builds none
    grads = torch.is_grad_enabled()
    fresh = [Packing.from_bounds([0, n], device) if p == 0 and grads else None for n, p in zip(lengths, past)]

    for layer in range(cfg.num_hidden_layers):
        def attend(query: MlaQuery, new: NewKV, layer=layer) -> torch.Tensor:
            outs = []
            for b, (start, n) in enumerate(zip(starts, lengths)):
                rows = slice(start, start + n)
                mine = CacheView(new.latents[rows], None if new.rope_keys is None else new.rope_keys[rows],
                                 new.index_keys[rows], positions[rows])
                cache = caches[b] if caches is not None else None
                view = cache.view(layer, mine) if cache is not None else mine
                if cache is not None:
                    cache.layers[layer] = CacheView(*(None if t is None else t.detach() for t in (
                        view.latents, view.rope_keys, view.index_keys, view.positions)))
                q = query.rows(rows)
                if selections is not None:
                    selections.append((layer, b, select_tokens(cfg, q, view)))
                outs.append(mla_attend(cfg, q, view, packing=fresh[b]))
            return torch.cat(outs) if outs else query.q_latent
        proj = projections(layer) if projections is not None else BASE
        hidden = decoder_layer(cfg, layer, w_layers[layer], hidden, positions, attend, proj, trace)
        if trace is not None:
            trace("layer", layer, hidden)

    if caches is not None:
        for cache, n in zip(caches, lengths):
            cache.length += n
    logits = final_logits(cfg, w_model, hidden)
    if trace is not None:
        trace("logits", -1, logits)
    return [logits[s:s + n] for s, n in zip(starts, lengths)]
