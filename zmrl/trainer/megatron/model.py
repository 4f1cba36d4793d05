"""The zmrl model as a megatron-core GPTModel built from zmrl ModuleSpecs.

    GPTModel
      embedding.word_embeddings      VocabParallelEmbedding (a gather: exact)
      decoder (TransformerBlock)     TransformerLayer x L, from `layer_spec(cfg, i)`:
        input_layernorm              zmrl RMSNorm
        self_attention               ZmrlMLA          (zmrl mla_project / mla_attend / mla_output)
        self_attn_bda                Megatron's unfused bias-dropout-add (p = 0: residual + out)
        pre_mlp_layernorm            zmrl RMSNorm
        mlp                          ZmrlDenseMLP (layers < first_k_dense_replace) | ZmrlMoE
        mlp_bda                      as above
      decoder.final_layernorm        zmrl RMSNorm
      output_layer                   ColumnLinear, gathered (zmrl's GEMM)

TransformerLayer's residual structure is zmrl's decoder_layer: h + attn(norm(h)), then
h + mlp(norm(h)), adds in the activation dtype. No rotary module (RoPE is applied inside ZmrlMLA by
zmrl's tables) and no attention mask (each sequence attends over its own cache view).
"""
from __future__ import annotations

import itertools
import logging
import warnings

import torch

from zmrl.model.config import ModelConfig
from zmrl.batch_invariant.packing import longest_run
from zmrl.trainer.megatron.attention import ZmrlMLA, hold_packing
from zmrl.trainer.megatron.compat import import_megatron
from zmrl.lora import LoraConfig
from zmrl.trainer.megatron.convert import Layout
from zmrl.trainer.megatron.layers import ColumnLinear, Replicated, RMSNorm, column
from zmrl.trainer.megatron.mlp import ZmrlDenseMLP, ZmrlMoE

import_megatron()
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_config(cfg: ModelConfig, tp: int, ep: int | None = None) -> TransformerConfig:
    """Megatron's config for the parts Megatron itself runs (block, layers, embedding); ep None: = tp."""
    dtype = DTYPES[cfg.torch_dtype]
    with warnings.catch_warnings():
        # 0.16.1's own default cuda_graph_scope trips its deprecation warning; no CUDA graphs here
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        return _transformer_config(cfg, tp, tp if ep is None else ep, dtype)


def _transformer_config(cfg: ModelConfig, tp: int, ep: int, dtype: torch.dtype) -> TransformerConfig:
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.intermediate_size, layernorm_epsilon=cfg.rms_norm_eps, normalization="RMSNorm",
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        # Megatron validates EP against these; zmrl's ZmrlMoE does the routing and expert math
        num_moe_experts=cfg.n_routed_experts, moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_token_dispatcher_type="allgather",
        # dropout 0 makes bias-dropout-add exactly residual + x; the unfused form keeps it an
        # eager add (the fused one is torch.jit.script'ed: a compiler may reassociate)
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, add_bias_linear=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
        # weights come from the checkpoint: allocate on CPU, skip Megatron's random init
        use_cpu_initialization=True, perform_initialization=False,
    )


def layer_spec(cfg: ModelConfig, layer: int) -> ModuleSpec:
    mlp = ZmrlMoE if cfg.is_moe_layer(layer) else ZmrlDenseMLP
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=RMSNorm,
        self_attention=ModuleSpec(module=ZmrlMLA, params={"model_cfg": cfg}),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=RMSNorm,
        mlp=ModuleSpec(module=mlp, params={"model_cfg": cfg}),
        mlp_bda=get_bias_dropout_add,
    ))


def block_spec(cfg: ModelConfig) -> TransformerBlockSubmodules:
    return TransformerBlockSubmodules(layer_specs=[layer_spec(cfg, i) for i in range(cfg.num_hidden_layers)],
                                      layer_norm=RMSNorm)


class ZmrlGPTModel(GPTModel):
    def __init__(self, cfg: ModelConfig, tp: int = 1, ep: int | None = None):
        config = transformer_config(cfg, tp, ep)
        # TransformerLayer logs "Unknown MLP type ... Using default kwargs" for every layer whose
        # MLP is not Megatron's: expected (ZmrlMoE / ZmrlDenseMLP take the config only)
        layer_log = logging.getLogger("megatron.core.transformer.transformer_layer")
        level = layer_log.level
        layer_log.setLevel(logging.ERROR)
        try:
            self._build(cfg, config)
        finally:
            layer_log.setLevel(level)
        self.cfg = cfg
        # Megatron's output layer, same shape and sharding, with zmrl's GEMM
        self.output_layer = column(cfg.hidden_size, cfg.vocab_size, config, gather_output=True,
                                   skip_weight_param_allocation=cfg.tie_word_embeddings)

    def _build(self, cfg: ModelConfig, config) -> None:
        super().__init__(config=config, transformer_layer_spec=block_spec(cfg), vocab_size=cfg.vocab_size,
                         max_sequence_length=cfg.max_position_embeddings, parallel_output=False,
                         share_embeddings_and_output_weights=cfg.tie_word_embeddings,
                         position_embedding_type="none")

    def add_lora(self, layout: Layout, lcfg: LoraConfig) -> None:
        """Give every adapted linear its LoRA parameters (zeros; the trainer copies in the initial
        factors), every routed expert included."""
        for _stem, path, part, kind in layout.lora_modules(lcfg):
            m = self.get_submodule(path)
            rows = None
            if isinstance(m, (ColumnLinear, Replicated)):
                b_out = m.output_size_per_partition if isinstance(m, ColumnLinear) else m.output_size
                if part:  # a gated fc1: gate rows first, then up rows
                    half = b_out // 2
                    rows, b_out = (slice(0, half) if part == "gate" else slice(half, b_out)), half
            else:  # row-parallel: the LoRA branch sees the gathered input, so A and B are whole
                b_out = m.output_size
            m.add_lora({part: rows}, lcfg.r, lcfg.scale, a_in=m.input_size,
                       b_out=b_out if rows is None else rows.stop - rows.start)
        self._lora_found = None  # found again on the next call

    _lora_found: list | None = None

    def lora_modules(self) -> list:
        """The modules holding LoRA parameters. Found once after `add_lora` (the only maker of
        them): walking every module costs ~0.4 ms, and the trainer asks twice per forward."""
        if self._lora_found is None:
            self._lora_found = [m for m in self.modules() if getattr(m, "lora_rows", None)]
        return list(self._lora_found)

    def set_lora_enabled(self, on: bool) -> None:
        for m in self.lora_modules():
            if m.lora_on != on:  # reading is cheap, nn.Module's __setattr__ is not: set what changes
                m.lora_on = on

    def attention(self, layer: int) -> ZmrlMLA:
        return self.decoder.layers[layer].self_attention

    def mlp(self, layer: int):
        return self.decoder.layers[layer].mlp

    def forward_sequences(self, token_ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """One packed (THD) forward over whole sequences: [L_b] token ids each -> logits [L_b, V] each."""
        logits, bounds = self.forward_packed(token_ids)
        return [logits[lo:hi] for lo, hi in zip(bounds, bounds[1:])]

    def forward_packed(self, token_ids: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """The same forward -> (logits [T, V] of every sequence end to end, their row offsets [B + 1])."""
        lengths = [int(t.numel()) for t in token_ids]
        device = self.embedding.word_embeddings.weight.device
        ids = torch.cat([t.reshape(-1) for t in token_ids]).long()
        # checked where the ids are (a batch is built on the host: free), then one asynchronous copy
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, vocab_size={self.cfg.vocab_size}), "
                             f"got [{int(ids.min())}, {int(ids.max())}]")
        if max(lengths, default=0) > self.cfg.max_position_embeddings:
            raise ValueError(f"a sequence of {max(lengths)} tokens exceeds max_position_embeddings="
                             f"{self.cfg.max_position_embeddings}")
        ids = ids.to(device, non_blocking=True)
        bounds = [0, *itertools.accumulate(lengths)]
        return self.forward_ids(ids, self.packing(bounds)), bounds

    def packing(self, bounds: list[int], width: int | None = None) -> PackedSeqParams:
        """Megatron's packed-sequence parameters for these offsets with their device Packing built
        now: a forward given them copies nothing from the host (what a CUDA graph capture needs).
        width: the longest sequence the kernels plan for (default: the longest held), so that the
        params can be refilled with other lengths up to it (attention.refill_packing)."""
        cu = torch.tensor(bounds, dtype=torch.int32)
        longest = longest_run(bounds)
        if width is not None and width < longest:
            raise ValueError(f"width={width} is narrower than the longest sequence ({longest} tokens)")
        planned = longest if width is None else width
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=planned, max_seqlen_kv=planned)
        hold_packing(packed, self.embedding.word_embeddings.weight.device)
        return packed

    def forward_ids(self, ids: torch.Tensor, packed: PackedSeqParams) -> torch.Tensor:
        """Token ids [T] already on the device, packed as `packed` says -> logits [T, V]."""
        logits = self(ids.view(1, -1), position_ids=None, attention_mask=None, packed_seq_params=packed)
        return logits.view(-1, logits.shape[-1])
