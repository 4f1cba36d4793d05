"""Triton implementations of every zmrl.batch_invariant op (docs/design.md, "The numerics contract").

The public functions in zmrl.batch_invariant call these for CUDA tensors, or for any tensor
when a test forces the Triton path; on a machine without a GPU that needs TRITON_INTERPRET=1
in the environment before this package is first imported (Triton picks compile vs interpret
when a kernel is defined). Only the modules in this package import triton.

Each function takes the public op's arguments and returns the same dtypes and shapes; the
ones used in training are autograd Functions with deterministic backward passes.
"""
from zmrl.batch_invariant.triton._common import INTERPRET
from zmrl.batch_invariant.triton.elementwise import add_scaled, sigmoid
from zmrl.batch_invariant.triton.indexer import indexer_scores, indexer_scores_varlen
from zmrl.batch_invariant.triton.leaf_tree import leaf_tree
from zmrl.batch_invariant.triton.matmul import bmm, linear, linear_leaves, matmul, weight_leaves
from zmrl.batch_invariant.triton.moe import moe_experts, slot_sum
from zmrl.batch_invariant.triton.moe_lora import moe_expert_slots
from zmrl.batch_invariant.triton.rope import rope
from zmrl.batch_invariant.triton.route import route_weights
from zmrl.batch_invariant.triton.route_select import MAX_EXPERTS as ROUTE_SELECT_MAX_EXPERTS
from zmrl.batch_invariant.triton.route_select import route_select
from zmrl.batch_invariant.triton.rowwise import log_softmax, mean, rms_norm, softmax
from zmrl.batch_invariant.triton.sparse_mla import sparse_mla, sparse_mla_leaves
from zmrl.batch_invariant.triton.topk import topk, topk_launch

__all__ = [
    "INTERPRET",
    "add_scaled",
    "bmm",
    "indexer_scores",
    "indexer_scores_varlen",
    "leaf_tree",
    "linear",
    "linear_leaves",
    "log_softmax",
    "matmul",
    "mean",
    "moe_expert_slots",
    "moe_experts",
    "rms_norm",
    "rope",
    "ROUTE_SELECT_MAX_EXPERTS",
    "route_select",
    "route_weights",
    "sigmoid",
    "slot_sum",
    "softmax",
    "sparse_mla",
    "sparse_mla_leaves",
    "topk",
    "topk_launch",
    "weight_leaves",
]
