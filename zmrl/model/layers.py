"""The whole model as functions: embedding, decoder layer, head, and the parameter spec.

Weights are plain mappings from checkpoint names to tensors: `w_model` holds
"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight" (absent when tied);
a layer's mapping holds names relative to "model.layers.{i}." (see `layer_param_shapes`).

decoder_layer (pinned residual structure; residual adds in the activation dtype):
    h = h + mla_output(attend(mla_project(rms_norm(h))))
    h = h + mlp(rms_norm(h))
where `attend(query, new) -> o_latent [T, H, C]` is the host's: it writes `new` into its
cache and runs `mla_attend` per sequence over that sequence's view.
Logits = linear(rms_norm(h), lm_head) in the activation dtype, one GEMM per canonical leaf of the
vocabulary (zmrl.batch_invariant.collectives: a vocab-parallel host computes the same bits); hosts
take log-probs as
`zmrl.batch_invariant.log_softmax(logits.float() / temperature)`.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from zmrl.batch_invariant import defers_checks, fail_if, rms_norm
from zmrl.batch_invariant.collectives import LOCAL, Shards, column_linear, gather_last, num_leaves
from zmrl.batch_invariant.gather import gather_rows
from zmrl.model.attention import MlaQuery, NewKV, mla_output, mla_project
from zmrl.model.config import ModelConfig
from zmrl.model.mlp import dense_mlp, moe_mlp
from zmrl.model.projections import BASE, Projections

Attend = Callable[[MlaQuery, NewKV], torch.Tensor]
Trace = Callable[[str, int, torch.Tensor], None]
"""trace(stage, layer, tensor): sees intermediate activations (debugging tools compare hosts)."""


def embed(w_model: Mapping[str, torch.Tensor], token_ids: torch.Tensor, shards: Shards = LOCAL) -> torch.Tensor:
    """token_ids [T] -> hidden [T, D] (a gather: exact). Vocab-parallel (`shards`: the table holds
    this rank's rows, zmrl.model.sharding): each rank looks up the ids it holds, the ranks' rows are
    gathered and every token takes its owner's row, a copy."""
    table = w_model["model.embed_tokens.weight"]
    per = table.shape[0]
    vocab = per * shards.size
    if token_ids.numel():
        fail_if(((token_ids < 0) | (token_ids >= vocab)).any(), f"token ids must lie in [0, vocab_size={vocab})",
                lambda: f"got [{int(token_ids.min())}, {int(token_ids.max())}]")
        if defers_checks(token_ids):  # the check raises later: never gather past the table before it does
            token_ids = token_ids.clamp(0, vocab - 1)
    if shards.size == 1:
        return gather_rows(table, token_ids)
    rows = gather_rows(table, (token_ids - shards.rank * per).clamp(0, per - 1))  # [T, D]; others' ids: any row
    t, d = rows.shape
    everyone = gather_last(rows, shards).view(t, shards.size, d)
    return everyone[torch.arange(t, device=rows.device), token_ids // per]


def decoder_layer(cfg: ModelConfig, layer: int, w: Mapping[str, torch.Tensor], hidden: torch.Tensor,
                  positions: torch.Tensor, attend: Attend, proj: Projections = BASE,
                  trace: Trace | None = None) -> torch.Tensor:
    """hidden [T, D], positions [T] -> hidden [T, D] after layer `layer`. `trace` (optional) sees
    the attention output ("attn"), the MLP's input ("mlp_in") and output ("mlp"), all [T, D]."""
    x = rms_norm(hidden, w["input_layernorm.weight"], cfg.rms_norm_eps)
    query, new = mla_project(cfg, w, x, positions, proj)
    attn = mla_output(cfg, w, attend(query, new), proj)
    hidden = hidden + attn
    x = rms_norm(hidden, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    mlp = (moe_mlp if cfg.is_moe_layer(layer) else dense_mlp)(cfg, w, x, proj)
    if trace is not None:
        trace("attn", layer, attn)
        trace("mlp_in", layer, x)
        trace("mlp", layer, mlp)
    return hidden + mlp


def lm_head_weight(cfg: ModelConfig, w_model: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return w_model["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]


def final_logits(cfg: ModelConfig, w_model: Mapping[str, torch.Tensor], hidden: torch.Tensor,
                 shards: Shards = LOCAL) -> torch.Tensor:
    """hidden [T, D] -> logits [T, V] in the activation dtype. Vocab-parallel (`shards`: the head
    holds this rank's rows): each rank computes its canonical vocab leaves, then the ranks' logits
    are gathered (a copy), so every rank holds the whole [T, V]."""
    x = rms_norm(hidden, w_model["model.norm.weight"], cfg.rms_norm_eps)
    weight = lm_head_weight(cfg, w_model)
    local = column_linear(x, weight, num_leaves(weight.shape[0] * shards.size), shards)
    return gather_last(local, shards)


# ----------------------------------------------------------------------------- parameter spec
def layer_param_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of decoder layer `layer`, name (relative to model.layers.{i}.) -> shape."""
    d, h, c, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    out = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_a_proj.weight": (cfg.q_lora_rank, d),
        "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
        "self_attn.q_b_proj.weight": (h * cfg.qk_head_dim, cfg.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (c + r, d),
        "self_attn.kv_a_layernorm.weight": (c,),
        "self_attn.kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), c),
        "self_attn.o_proj.weight": (d, h * cfg.v_head_dim),
        "self_attn.indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "self_attn.indexer.wk.weight": (cfg.index_head_dim, d),
        "self_attn.indexer.k_norm.weight": (cfg.index_head_dim,),
        "self_attn.indexer.weights_proj.weight": (cfg.index_n_heads, d),
    }
    if cfg.is_moe_layer(layer):
        e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
        out.update({
            "mlp.gate.weight": (e, d),
            "mlp.gate.e_score_correction_bias": (e,),
            "mlp.experts.gate_up_proj": (e, 2 * i, d),
            "mlp.experts.down_proj": (e, d, i),
        })
        if cfg.n_shared_experts:
            s = i * cfg.n_shared_experts
            out.update({"mlp.shared_experts.gate_proj.weight": (s, d), "mlp.shared_experts.up_proj.weight": (s, d),
                        "mlp.shared_experts.down_proj.weight": (d, s)})
    else:
        i = cfg.intermediate_size
        out.update({"mlp.gate_proj.weight": (i, d), "mlp.up_proj.weight": (i, d), "mlp.down_proj.weight": (d, i)})
    return out


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, full name -> shape."""
    out = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,)}
    for layer in range(cfg.num_hidden_layers):
        out.update({f"model.layers.{layer}.{k}": v for k, v in layer_param_shapes(cfg, layer).items()})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def init_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights: normal(0, initializer_range) matrices, ones for norms, zeros for the
    router bias; generated in fp32 from one CPU generator in `param_shapes` order, then cast."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * cfg.initializer_range
        out[name] = t.to(dtype)
    return out


def check_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], what: str = "checkpoint") -> None:
    """Raise naming every missing, extra or mis-shaped tensor."""
    want = param_shapes(cfg)
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    wrong = [f"{k} {tuple(weights[k].shape)} (expected {want[k]})" for k in want
             if k in weights and tuple(weights[k].shape) != want[k]]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    if wrong:
        problems.append(f"wrong shapes: {', '.join(wrong[:8])}")
    if problems:
        raise ValueError(f"{what} does not match the config: " + "; ".join(problems))
