"""MLA in the absorbed (MQA) form with a DSA indexer, as three host-composable stages.

A host (the transformers model, vLLM's paged cache, Megatron's batch) runs, per layer:

    query, new = mla_project(cfg, w, x, positions)            # all T tokens of all sequences
    <write new.latents / new.rope_keys / new.index_keys of each token into its cache>
    for each sequence: o[rows] = mla_attend(cfg, query[rows], view)   # view: that sequence's cache
    out = mla_output(cfg, w, o)                               # all T tokens again

A host whose sequences are fresh and packed end to end (a trainer) replaces the loop by one
`mla_attend_packed(cfg, query, new, packing)`: the same bits, all sequences in one call (a
`zmrl.batch_invariant.Packing`, built once per forward, holds the offsets on host and device).

Shapes (T new tokens, S visible tokens, H heads, C = kv_lora_rank, R = qk_rope_head_dim,
Hi/Di = index heads/dim): x [T, D] (already normed), positions [T] int64; MlaQuery holds
q_latent [T, H, C], q_rope [T, H, R] | None, index_q [T, Hi, Di], index_weights [T, Hi] fp32;
NewKV and CacheView hold latents [*, C], rope_keys [*, R] | None (NoPE), index_keys [*, Di];
a CacheView also holds positions [S] int64, **ascending**, and must include the queries' own
tokens (write first, then attend). Rows of one sequence only: padding or another sequence's
tokens must never appear in a view.

Pinned numerics:
- RoPE is rotate-half (NeoX) on the last R dims of q and on the R-dim rope key (MLA), and on
  the *first* R dims of index q and k (indexer), from one cos/sin table built by one call
  over positions [0, max_position_embeddings) in fp32, gathered per position, applied in fp32
  and cast back. R = 0 is NoPE: nothing rotated, no rope channel.
- The indexer key is RMSNorm(wk x) (RMSNorm, not LayerNorm); head weights are
  weights_proj(x) * Hi^-0.5 * Di^-0.5 in fp32; scores by `indexer_scores` (fp32, causal by
  position); `topk(scores, index_topk)` gives rows of the view, ascending, -1 padded.
- Attention is always `sparse_mla` over those rows with softmax_scale = (nope + R)^-0.5
  passed explicitly; the MLA out is o_proj(W_UV o_latent) in the activation dtype.
- Heads are attended in canonical head leaves (zmrl.batch_invariant.collectives: gcd(8, H) groups
  of H / gcd(8, H) heads), each head with the bits of a `sparse_mla` call over its leaf alone
  (`sparse_mla_leaves`: one launch for every head on a GPU), and the gradient of the latents and rope
  keys (read by every head) is summed over the leaves by the canonical tree: a host holding some of
  the heads (tensor parallel) computes the same bits as one holding all of them.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Mapping

import torch

from zmrl.batch_invariant import (
    Packing,
    defers_checks,
    fail_if,
    indexer_scores,
    indexer_scores_varlen,
    rms_norm,
    rope,
    sparse_mla_leaves,
    topk,
)
from zmrl.batch_invariant.collectives import LOCAL, Shards, fan_out, num_leaves
from zmrl.batch_invariant.graph_refs import capture_token, hold_for_graph
from zmrl.model.config import ModelConfig
from zmrl.model.projections import BASE, Projections


@dataclass
class NewKV:
    """What the new tokens contribute to the cache: latents [T, C], rope_keys [T, R] | None,
    index_keys [T, Di]."""
    latents: torch.Tensor
    rope_keys: torch.Tensor | None
    index_keys: torch.Tensor


@dataclass
class CacheView:
    """The tokens visible to one sequence's queries, ascending by position, own tokens included."""
    latents: torch.Tensor
    rope_keys: torch.Tensor | None
    index_keys: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def concat(parts: list["CacheView"]) -> "CacheView":
        rope = None if parts[0].rope_keys is None else torch.cat([p.rope_keys for p in parts])
        return CacheView(torch.cat([p.latents for p in parts]), rope,
                         torch.cat([p.index_keys for p in parts]), torch.cat([p.positions for p in parts]))


@dataclass
class MlaQuery:
    q_latent: torch.Tensor
    q_rope: torch.Tensor | None
    index_q: torch.Tensor
    index_weights: torch.Tensor
    positions: torch.Tensor

    def rows(self, sel) -> "MlaQuery":
        """The queries of rows `sel` (a slice or index tensor): one sequence's share."""
        return MlaQuery(self.q_latent[sel], None if self.q_rope is None else self.q_rope[sel],
                        self.index_q[sel], self.index_weights[sel], self.positions[sel])


# ----------------------------------------------------------------------------- RoPE
@functools.lru_cache(maxsize=8)
def _rope_table(dim: int, theta: float, max_positions: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    # float64 angles, one call over the whole table: a position's cos/sin never depend on
    # which positions a forward happens to hold (sin/cos lanes vs tails may differ on CPU)
    return angles.cos().float().to(device), angles.sin().float().to(device)


# The latest `rope_cos_sin` result and what it was gathered for. Every layer of a forward passes the
# same positions tensor, so the check and the two gathers run once per forward, not once per layer.
# Reused only for that very tensor (a weak reference: a new tensor at a recycled address is never
# taken for it), unchanged since (its version counter; an inference tensor has none and is never
# kept), under the same table and inference mode, and within the run that gathered it: eager calls,
# or one CUDA graph capture (graph_refs.capture_token). A capture gathers its own rows, in its pool,
# so each replay gathers them again from the positions it is given (a refilled packing's differ
# from the capture's); rows from a capture never reach a later call, whose graph may overwrite
# them. One tuple, replaced whole: a reader on another thread sees an old entry or a new one,
# never half of each.
_last_rope: tuple | None = None


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, R/2] fp32."""
    global _last_rope
    reusable = not positions.is_inference()
    key = (cfg.qk_rope_head_dim, float(cfg.rope_theta), cfg.max_position_embeddings,
           torch.is_inference_mode_enabled())
    last = _last_rope
    run = capture_token() if positions.is_cuda else None
    if (reusable and last is not None and last[0]() is positions and last[1] == key + (positions._version,)
            and last[3] is run):
        return last[2]
    limit = cfg.max_position_embeddings
    rows = positions
    if positions.numel():
        fail_if(((positions < 0) | (positions >= limit)).any(),
                f"positions must lie in [0, max_position_embeddings={limit})",
                lambda: f"got [{int(positions.min())}, {int(positions.max())}]")
        if defers_checks(positions):  # the check raises later: never index past the table before it does
            rows = positions.clamp(0, limit - 1)
    cos, sin = _rope_table(cfg.qk_rope_head_dim, float(cfg.rope_theta), cfg.max_position_embeddings,
                           str(positions.device))
    hold_for_graph(cos, sin)
    out = cos[rows], sin[rows]
    if reusable:
        _last_rope = (weakref.ref(positions), key + (positions._version,), out, run)
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, ..., R], cos/sin [T, R/2] -> same shape and dtype as x.
    `zmrl.batch_invariant.rope`: the torch expression on CPU, one kernel each way on a GPU,
    the same bits on both."""
    return rope(x, cos, sin)


# ----------------------------------------------------------------------------- stages
def mla_project(cfg: ModelConfig, w: Mapping[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor,
                proj: Projections = BASE) -> tuple[MlaQuery, NewKV]:
    """x [T, D] (the input-normed hidden states), positions [T] -> (MlaQuery, NewKV)."""
    t = x.shape[0]
    h, nope, r, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    a = "self_attn."
    q_lat_in = rms_norm(proj.linear(a + "q_a_proj.weight", x, w[a + "q_a_proj.weight"]),
                        w[a + "q_a_layernorm.weight"], cfg.rms_norm_eps)
    # split, not sliced twice: autograd joins the two parts' gradients with one cat, where two
    # slices each wrote a zero-padded copy that a third op added
    q = proj.linear(a + "q_b_proj.weight", q_lat_in, w[a + "q_b_proj.weight"]).view(t, h, nope + r)
    q_nope, q_pe = q.split([nope, r], -1)
    kv_c, k_pe = proj.linear(a + "kv_a_proj_with_mqa.weight", x, w[a + "kv_a_proj_with_mqa.weight"]).split([c, r], -1)
    latents = rms_norm(kv_c, w[a + "kv_a_layernorm.weight"], cfg.rms_norm_eps)
    kv_b = w[a + "kv_b_proj.weight"].view(h, nope + cfg.v_head_dim, c)
    q_latent = proj.absorb_uk(a + "kv_b_proj.weight", q_nope, kv_b[:, :nope])

    index_q = proj.linear(a + "indexer.wq_b.weight", q_lat_in, w[a + "indexer.wq_b.weight"]).view(t, hi, di)
    index_k = rms_norm(proj.linear(a + "indexer.wk.weight", x, w[a + "indexer.wk.weight"]),
                       w[a + "indexer.k_norm.weight"], cfg.rms_norm_eps)
    head_w = proj.linear(a + "indexer.weights_proj.weight", x, w[a + "indexer.weights_proj.weight"])
    index_weights = head_w.float() * (hi ** -0.5 * di ** -0.5)

    if r:
        cos, sin = rope_cos_sin(cfg, positions)
        q_rope = apply_rope(q_pe, cos, sin)
        rope_keys = apply_rope(k_pe, cos, sin)
        index_q = torch.cat([apply_rope(index_q[..., :r], cos, sin), index_q[..., r:]], -1)
        index_k = torch.cat([apply_rope(index_k[:, :r], cos, sin), index_k[:, r:]], -1)
    else:
        q_rope = rope_keys = None
    query = MlaQuery(q_latent.contiguous(), q_rope, index_q, index_weights, positions)
    return query, NewKV(latents, rope_keys, index_k)


def select_tokens(cfg: ModelConfig, query: MlaQuery, view: CacheView) -> torch.Tensor:
    """The DSA selection: indices [T, index_topk] into the rows of `view`, ascending, -1 padded."""
    # selection is discrete: no gradient flows through it (the indexer is trained by its own
    # loss, as in DeepSeek-V3.2), and the scores kernel is forward-only
    scores = indexer_scores(query.index_q.detach(), query.index_weights.detach(), view.index_keys.detach(),
                            query.positions, view.positions)
    return topk(scores, cfg.index_topk)


def mla_attend(cfg: ModelConfig, query: MlaQuery, view: CacheView,
               indices: torch.Tensor | None = None, shards: Shards = LOCAL,
               packing: Packing | None = None) -> torch.Tensor:
    """One sequence's queries over its cache view -> o_latent [T, H, C].

    `indices` overrides the indexer's selection (tests use it to run dense attention); `shards`:
    which head leaves this host holds (cfg then counts this host's heads). `packing`: the view is a
    fresh sequence whose rows are the queries (`Packing.from_bounds([0, T])`): its key gradients
    then take the same kernel as in `mla_attend_packed`, so both give the same bits."""
    if view.positions.numel() > 1:
        fail_if((view.positions[1:] <= view.positions[:-1]).any(),
                "the cache view's positions must be strictly ascending (one sequence, in order)")
    if indices is None:
        indices = select_tokens(cfg, query, view)
    return sparse_mla_by_head_leaf(cfg, query, view.latents, view.rope_keys, indices, shards, packing)


def sparse_mla_by_head_leaf(cfg: ModelConfig, query: MlaQuery, latents: torch.Tensor, rope_keys: torch.Tensor | None,
                            indices: torch.Tensor, shards: Shards = LOCAL, packing: Packing | None = None) -> torch.Tensor:
    """Sparse MLA with the heads cut into their canonical leaves -> o_latent [T, H, C].

    Each head gets the bits of a call over its leaf alone, whatever share of the heads this host
    holds (on a GPU one launch serves every local head), and the latents' and rope keys' gradients
    (shared by every head) are formed per leaf and summed over the leaves by the canonical tree: so
    a rank holding some heads and one process holding all of them run the same arithmetic (TP-size
    invariance, docs/design.md "Collectives"). `packing`: the rows are fresh packed sequences (see
    `mla_attend_packed`), which lets a GPU form the latents' gradients per sequence on tensor cores."""
    leaves = num_leaves(query.q_latent.shape[1] * shards.size)
    lats = fan_out(latents, leaves, shards)
    ropes = None if rope_keys is None else fan_out(rope_keys, leaves, shards)
    return sparse_mla_leaves(query.q_latent, query.q_rope, lats, ropes, indices, cfg.softmax_scale,
                             packing=packing)[0]


def select_tokens_packed(cfg: ModelConfig, query: MlaQuery, new: NewKV,
                         cu_seqlens: torch.Tensor | Packing) -> torch.Tensor:
    """The DSA selection for fresh packed sequences (see `mla_attend_packed`): indices [T, index_topk]
    into the packed rows, each row's its own sequence's, ascending, -1 padded; equal to
    `select_tokens` per sequence plus the sequence's first row."""
    packing = Packing.of(cu_seqlens, query.q_latent.device)
    scores = indexer_scores_varlen(query.index_q.detach(), query.index_weights.detach(), new.index_keys.detach(),
                                   query.positions, query.positions, packing, packing)
    within = topk(scores, cfg.index_topk)
    # the indexer scores a query's own sequence up to the query, and top-k lists valid entries
    # ascending before its -1s: what sparse MLA's packed index checks verify, by construction
    # (the -1 padding kept as it is: no scalar filled on the device)
    return packing.vouch(torch.where(within >= 0, within + packing.first_row[:, None], within))


def mla_attend_packed(cfg: ModelConfig, query: MlaQuery, new: NewKV, cu_seqlens: torch.Tensor | Packing,
                      indices: torch.Tensor | None = None, shards: Shards = LOCAL) -> torch.Tensor:
    """Fresh packed sequences, all at once -> o_latent [T, H, C].

    Rows cu_seqlens[b]:cu_seqlens[b + 1] hold sequence b's tokens, each sequence's whole cache
    (no past), positions strictly ascending within it. One indexer call, one top-k and one sparse
    MLA serve every sequence; a query's candidates are its own sequence's tokens, so its bits are
    those of `mla_attend` over that sequence's view (the kernels are per-query: see
    zmrl.batch_invariant). `indices` and `shards` as in `mla_attend`. A host that attends in
    every layer passes a `Packing` built once per forward (no host sync, no copy per layer; a
    GPU cu_seqlens tensor costs a host sync per call)."""
    t = query.q_latent.shape[0]
    packing = Packing.of(cu_seqlens, query.q_latent.device)
    if packing.num_rows != t:
        raise ValueError(f"cu_seqlens must be [B + 1] rising from 0 to the {t} packed rows, got {list(packing.bounds)}")
    pos = query.positions
    # positions taken from the packing (a fresh sequence's rows count from 0) ascend by construction;
    # others are checked (deferred on a GPU: zmrl.batch_invariant.fail_if)
    if t > 1 and pos is not packing.local:
        fail_if(((pos[1:] <= pos[:-1]) & (packing.local[1:] != 0)).any(),
                "positions must be strictly ascending within each packed sequence")
    if indices is None:
        indices = select_tokens_packed(cfg, query, new, packing)
    return sparse_mla_by_head_leaf(cfg, query, new.latents, new.rope_keys, indices, shards, packing)


def mla_output(cfg: ModelConfig, w: Mapping[str, torch.Tensor], o_latent: torch.Tensor,
               proj: Projections = BASE) -> torch.Tensor:
    """o_latent [T, H, C] -> attention output [T, D] (before the residual add)."""
    h, nope, v, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    kv_b = w["self_attn.kv_b_proj.weight"].view(h, nope + v, c)
    o = proj.expand_uv("self_attn.kv_b_proj.weight", o_latent, kv_b[:, nope:])
    return proj.linear("self_attn.o_proj.weight", o.reshape(o.shape[0], h * v), w["self_attn.o_proj.weight"])
