"""Named model sizes for `zmrl init-model`. Every dim is a multiple of 16.

- tiny: an RL step on 2 CPU cores in seconds; index_topk=16 so any prompt longer than 16
  tokens really attends sparsely.
- small: a single-GPU test size.
- k31-layer: Kimi K3.1 Pro's per-layer dims (NoPE MLA + DSA indexer, 896 experts top-16)
  for kernel benchmarks. Only its config is ever written: it is never instantiated whole.
"""
from __future__ import annotations

PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        index_n_heads=4, index_head_dim=32, index_topk=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
        intermediate_size=256, first_k_dense_replace=1, routed_scaling_factor=2.5,
        max_position_embeddings=1024,
    ),
    "small": dict(
        vocab_size=4096, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
        q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        index_n_heads=8, index_head_dim=64, index_topk=256,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=256,
        intermediate_size=2048, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        max_position_embeddings=4096,
    ),
    "k31-layer": dict(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=1, num_attention_heads=96,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=0, v_head_dim=128,
        index_n_heads=32, index_head_dim=128, index_topk=2048,
        n_routed_experts=896, num_experts_per_tok=16, n_shared_experts=2, moe_intermediate_size=2048,
        intermediate_size=18432, first_k_dense_replace=0, routed_scaling_factor=2.5,
        max_position_embeddings=131072, torch_dtype="bfloat16",
    ),
}
CONFIG_ONLY = {"k31-layer"}
