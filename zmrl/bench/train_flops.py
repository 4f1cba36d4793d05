"""GEMM FLOPs of one forward (and of one train step) over a batch, for `zmrl bench train`.

Counted: every matrix product, at 2 FLOPs per multiply-add, over the real tokens only (padding
is not work). For a token at position p of its sequence (0-based), per layer:

    attention projections   q_a D*Q, q_b Q*H*(n+R), kv_a D*(C+R), o H*v*D
    zmrl (absorbed, sparse) absorb W_UK H*n*C, expand W_UV H*v*C,
                            scores H*(C+R)*k and weighted sum H*C*k with k = min(index_topk, p+1),
                            indexer wq_b Q*Hi*Di, wk D*Di, weights_proj D*Hi, index scores Hi*Di*(p+1)
    dense (transformers)    kv_b C*H*(n+v), scores H*(n+R)*(p+1), weighted sum H*v*(p+1)
    MLP                     dense layer 3*D*I; MoE layer router D*E + (top_k + shared) * 3*D*I_moe
    LoRA, each adapted      r*(in+out) (an expert's only for the tokens routed to it; zmrl also
                            adapts the indexer's three projections, counted with the indexer)
    head                    D*V per token

(D hidden, Q q_lora_rank, C kv_lora_rank, R rope dim, n/v nope/value head dims, H heads, Hi/Di
index heads/dim, I intermediate sizes, E experts, V vocabulary.) Each term is multiplied by 2.

A train step (frozen base, trainable LoRA) = forward + backward, where the backward computes the
input gradient of every GEMM (1x the forward's GEMM FLOPs), a second product for the attention
core (its backward is 2x its forward), and the LoRA weight gradients (2 * r * (in+out) more per
adapted linear per token). The indexer runs forward only (its selection takes no gradient).
"""
from __future__ import annotations

from dataclasses import dataclass

from zmrl.model.config import ModelConfig


@dataclass
class Flops:
    gemm: float = 0.0
    """Projection, MLP and head GEMMs (backward: 1x again for input gradients)."""
    attention: float = 0.0
    """The attention core: scores and weighted sums (backward: 2x)."""
    forward_only: float = 0.0
    """The indexer (no backward)."""
    lora: float = 0.0
    """LoRA GEMMs (backward: input gradient 1x + weight gradients 1x)."""

    @property
    def forward(self) -> float:
        return self.gemm + self.attention + self.forward_only + self.lora

    @property
    def train(self) -> float:
        return self.forward + self.gemm + 2 * self.attention + 2 * self.lora


def _causal_sum(lengths: list[int], cap: int | None = None) -> int:
    """sum over tokens of min(cap, p + 1) (p = position in its sequence)."""
    total = 0
    for n in lengths:
        if cap is None or cap >= n:
            total += n * (n + 1) // 2
        else:
            total += cap * (cap + 1) // 2 + (n - cap) * cap
    return total


def count_flops(cfg: ModelConfig, lengths: list[int], *, lora_r: int, lora_on_experts: bool,
                absorbed_sparse: bool) -> Flops:
    """absorbed_sparse: zmrl's MLA (absorbed, DSA indexer, top-k attention) vs transformers'
    (kv_b expanded per token, dense causal attention, no indexer). LoRA on the attention
    projections always; on every expert and shared expert too when lora_on_experts."""
    t = sum(lengths)
    d, q, c, r = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    h, n, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    f = Flops()
    attn_linears = [(d, q), (q, h * (n + r)), (d, c + r), (c, h * (n + v)), (h * v, d)]  # (in, out)
    for layer in range(cfg.num_hidden_layers):
        f.gemm += 2 * t * (d * q + q * h * (n + r) + d * (c + r) + h * v * d)
        if absorbed_sparse:
            f.gemm += 2 * t * (h * n * c + h * v * c)
            f.attention += 2 * _causal_sum(lengths, cfg.index_topk) * (h * (c + r) + h * c)
            f.forward_only += 2 * t * (q * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_head_dim
                                       + d * cfg.index_n_heads)
            f.forward_only += 2 * _causal_sum(lengths) * cfg.index_n_heads * cfg.index_head_dim
            hi_di = cfg.index_n_heads * cfg.index_head_dim
            f.forward_only += 2 * t * lora_r * ((q + hi_di) + (d + cfg.index_head_dim) + (d + cfg.index_n_heads))
        else:
            f.gemm += 2 * t * c * h * (n + v)
            f.attention += 2 * _causal_sum(lengths) * (h * (n + r) + h * v)
        f.lora += 2 * t * lora_r * sum(i + o for i, o in attn_linears)
        if cfg.is_moe_layer(layer):
            im, k, s = cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.n_shared_experts
            f.gemm += 2 * t * (d * cfg.n_routed_experts + (k + s) * 3 * d * im)
            if lora_on_experts:
                # gate (D -> I), up (D -> I), down (I -> D) per routed slot; shared: its width is s * I
                f.lora += 2 * t * lora_r * (k * 3 * (d + im) + (3 * (d + s * im) if s else 0))
        else:
            f.gemm += 2 * t * 3 * d * cfg.intermediate_size
    f.gemm += 2 * t * d * cfg.vocab_size
    return f
