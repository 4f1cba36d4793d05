"""zmrl's MLA (absorbed) + DSA indexer as a Megatron self-attention module.

The module holds Megatron parallel linears under Megatron's MLA names and runs zmrl/model's
three stages, exactly as zmrl.model.packed.forward_packed does for a fresh forward:

    query, new = mla_project(cfg_local, w, x, positions, proj)         # all tokens of all sequences
    o = mla_attend_packed(cfg_local, query, new, packing)               # all sequences in one call,
                                                                        # each over its own tokens
    out = mla_output(cfg_local, w, o, proj)                             # all tokens

Sequences arrive packed (THD: hidden [T, 1, D] with PackedSeqParams.cu_seqlens_q) or as the
columns of [S, B, D] (each column one whole sequence). Positions restart at 0 in every sequence.

TP: q_b_proj and kv_b_proj are column-parallel over heads (this rank's heads, `cfg_local`), o_proj
is row-parallel, both by zmrl's canonical leaves; the down-projections and the indexer's
projections are replicated (as vLLM does), so every rank computes whole latents, whole index keys
and the whole DSA selection with no communication. mla_attend runs this rank's head leaves; the
gradient of the latents and rope keys, which every head reads, is summed over all ranks' leaves by
the canonical tree inside it.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from zmrl.batch_invariant import Packing
from zmrl.batch_invariant.packing import longest_run
from zmrl.model.attention import mla_attend_packed, mla_output, mla_project
from zmrl.model.config import ModelConfig
from zmrl.trainer.megatron.compat import import_megatron
from zmrl.trainer.megatron.layers import RMSNorm, Replicated, column, row, tp_shards
from zmrl.trainer.megatron.projections import ModuleProjections

import_megatron()
from megatron.core.transformer.module import MegatronModule  # noqa: E402

# checkpoint name inside a decoder layer -> module path inside the attention module
NAMES = {
    "self_attn.q_a_proj.weight": "linear_q_down_proj",
    "self_attn.q_a_layernorm.weight": "q_layernorm",
    "self_attn.q_b_proj.weight": "linear_q_up_proj",
    "self_attn.kv_a_proj_with_mqa.weight": "linear_kv_down_proj",
    "self_attn.kv_a_layernorm.weight": "kv_layernorm",
    "self_attn.kv_b_proj.weight": "linear_kv_up_proj",
    "self_attn.o_proj.weight": "linear_proj",
    "self_attn.indexer.wq_b.weight": "indexer.linear_wq_b",
    "self_attn.indexer.wk.weight": "indexer.linear_wk",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm",
    "self_attn.indexer.weights_proj.weight": "indexer.linear_weights_proj",
}
# how each TP-split weight is split (dim 0 = output rows; "row" = row-parallel input dim 1)
SPLIT = {"self_attn.q_b_proj.weight": 0, "self_attn.kv_b_proj.weight": 0, "self_attn.o_proj.weight": 1}


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config as one TP rank sees it: its share of the attention heads."""
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp)


def sequence_rows(hidden: torch.Tensor, packed_seq_params) -> tuple[torch.Tensor, Packing, bool]:
    """hidden [S, B, D] -> (x [T, D] with each sequence's tokens contiguous, their Packing (empty
    sequences dropped), transposed: whether x is hidden's columns laid end to end).

    The Packing is built once per forward and read by every layer: packed sequences keep it on
    their PackedSeqParams (the same object reaches every layer; offsets on the host cost nothing
    to read, a GPU cu_seqlens_q one host sync per forward), columns in a small cache by shape."""
    s, b, d = hidden.shape
    if packed_seq_params is None:
        return hidden.transpose(0, 1).reshape(b * s, d), _columns(s, b, hidden.device), True
    if b != 1:
        raise ValueError(f"packed sequences (THD) need batch dim 1, got hidden {tuple(hidden.shape)}")
    packing = hold_packing(packed_seq_params, hidden.device)
    if packing.num_rows != s:
        raise ValueError(f"cu_seqlens_q {list(packing.bounds)} does not partition the {s} packed tokens")
    return hidden.view(s, d), packing, False


def hold_packing(packed_seq_params, device: torch.device) -> Packing:
    """The Packing of `packed_seq_params` on `device` (empty sequences dropped), built on the first
    call and kept on the params object; rebuilt where its offsets tensor was replaced or written to
    since (its version counter). A `max_seqlen_q` of at least the longest sequence is the Packing's
    width (what the kernels plan for, and the most a `refill_packing` may hold)."""
    cu = packed_seq_params.cu_seqlens_q
    held = getattr(packed_seq_params, "zmrl_packing", None)
    if held is None or held[0] is not cu or held[1] != _version(cu) or held[2].cu_seqlens.device != device:
        bounds = cu.tolist()
        if bounds[0] != 0 or any(hi < lo for lo, hi in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens_q {bounds} must rise from 0")
        nonempty = [0] + [hi for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        planned = packed_seq_params.max_seqlen_q
        width = planned if isinstance(planned, int) and planned >= longest_run(bounds) else None
        held = (cu, _version(cu), Packing.from_bounds(nonempty, device, width))
        packed_seq_params.zmrl_packing = held
    return held[2]


def refill_packing(packed_seq_params, bounds: list[int]) -> None:
    """The params (and the Packing `hold_packing` keeps on them) now hold these sequences: the same
    count, rows and width, other lengths, every tensor written in place (a CUDA graph captured over
    them reads the new packing)."""
    held = packed_seq_params.zmrl_packing
    if any(hi <= lo for lo, hi in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {list(bounds)}: a refilled packing holds no empty sequence")
    held[2].refill(bounds)
    cu = packed_seq_params.cu_seqlens_q
    cu.copy_(torch.tensor(bounds, dtype=cu.dtype))
    packed_seq_params.zmrl_packing = (cu, _version(cu), held[2])


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return None


@functools.lru_cache(maxsize=4)
def _columns(s: int, b: int, device: torch.device) -> Packing:
    return Packing.from_bounds([i * s for i in range(b + 1)], device)


class _Indexer(nn.Module):
    pass


class ZmrlMLA(MegatronModule):
    def __init__(self, config, submodules=None, layer_number: int = 1, *, model_cfg: ModelConfig,
                 pg_collection=None, **unused):
        super().__init__(config=config)
        cfg = model_cfg
        self.layer = layer_number - 1  # Megatron counts layers from 1
        tp = config.tensor_model_parallel_size
        self.cfg, self.cfg_local = cfg, local_config(cfg, tp)
        h, d, c, r = cfg.num_attention_heads, cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.linear_q_down_proj = Replicated(d, cfg.q_lora_rank, config)
        self.q_layernorm = RMSNorm(config, cfg.q_lora_rank, cfg.rms_norm_eps)
        self.linear_q_up_proj = column(cfg.q_lora_rank, h * cfg.qk_head_dim, config, gather_output=False)
        self.linear_kv_down_proj = Replicated(d, c + r, config)
        self.kv_layernorm = RMSNorm(config, c, cfg.rms_norm_eps)
        self.linear_kv_up_proj = column(c, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), config, gather_output=False)
        self.linear_proj = row(h * cfg.v_head_dim, d, config)
        self.indexer = _Indexer()
        self.indexer.linear_wq_b = Replicated(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, config)
        self.indexer.linear_wk = Replicated(d, cfg.index_head_dim, config)
        self.indexer.k_norm = RMSNorm(config, cfg.index_head_dim, cfg.rms_norm_eps)
        self.indexer.linear_weights_proj = Replicated(d, cfg.index_n_heads, config)
        self.shards = tp_shards()

    def module(self, name: str) -> nn.Module:
        return self.get_submodule(NAMES[name])

    def weights(self) -> dict[str, torch.Tensor]:
        """Checkpoint names -> this rank's tensors (what zmrl/model's functions index)."""
        return {name: self.module(name).weight for name in NAMES}

    def projections(self) -> ModuleProjections:
        linears = {name: (self.module(name), None, "") for name in NAMES if "norm" not in name}
        return ModuleProjections(self.cfg_local, self.layer, linears, kv_up=self.linear_kv_up_proj,
                                 shards=self.shards)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **unused):
        """hidden_states [S, B, D] (input-normed) -> ([S, B, D], None). attention_mask is ignored:
        causality and sequence boundaries come from the packing offsets (each query's candidates are
        its own sequence's tokens up to its position)."""
        s, b, d = hidden_states.shape
        x, packing, transposed = sequence_rows(hidden_states, packed_seq_params)
        w, proj, cfg = self.weights(), self.projections(), self.cfg_local
        # positions count from 0 in every sequence: the packing's row-within-sequence
        query, new = mla_project(cfg, w, x, packing.local, proj)
        o_latent = mla_attend_packed(cfg, query, new, packing, shards=self.shards) if packing.num_rows else query.q_latent
        out = mla_output(cfg, w, o_latent, proj)
        out = out.view(b, s, d).transpose(0, 1) if transposed else out.view(s, b, d)
        return out, None
