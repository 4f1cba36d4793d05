"""zmrl.batch_invariant: the kernels both engines share (docs/design.md, "The numerics contract").

Every op has a readable reference, a CPU fast path and a Triton path; the public function
picks by device, and `use_path("reference" | "cpu" | "triton")` forces one. On a CPU,
matmul/linear/bmm take BLAS tiles where a per-shape self-check proves them row-invariant, else
an exact GEMM; `use_cpu_gemm("tiles" | "exact")` forces one (see cpu_gemm.py). `use_path("torch")`
runs torch's default kernels instead: the batch-variant control. This package
imports torch only (Triton inside its kernel files, on first use).
"""
from zmrl.batch_invariant._checks import defers_checks, fail_if, raise_failed_checks
from zmrl.batch_invariant._cpu_threads import settle_intra_op_threads
from zmrl.batch_invariant._paths import PATHS, set_path, use_path
from zmrl.batch_invariant.cpu_gemm import use_cpu_gemm
from zmrl.batch_invariant.elementwise import add_scaled
from zmrl.batch_invariant.indexer import indexer_scores, indexer_scores_varlen
from zmrl.batch_invariant.matmul import bmm, linear, matmul
from zmrl.batch_invariant.mode import batch_invariant_mode, disable, enable, is_enabled
from zmrl.batch_invariant.packing import Packing
from zmrl.batch_invariant.moe import (
    grouped_expert_slots_run_here,
    moe_expert_slots,
    moe_experts,
    moe_route,
    sigmoid,
    silu,
    slot_sum,
    slot_sum_composed,
)
from zmrl.batch_invariant.rope import rope
from zmrl.batch_invariant.rowwise import log_softmax, mean, rms_norm, softmax
from zmrl.batch_invariant.sparse_mla import sparse_mla, sparse_mla_leaves
from zmrl.batch_invariant.topk import topk

__all__ = [
    "PATHS",
    "Packing",
    "add_scaled",
    "batch_invariant_mode",
    "bmm",
    "defers_checks",
    "disable",
    "enable",
    "fail_if",
    "grouped_expert_slots_run_here",
    "indexer_scores",
    "indexer_scores_varlen",
    "is_enabled",
    "linear",
    "log_softmax",
    "matmul",
    "mean",
    "moe_expert_slots",
    "moe_experts",
    "moe_route",
    "raise_failed_checks",
    "rms_norm",
    "rope",
    "set_path",
    "sigmoid",
    "silu",
    "slot_sum",
    "slot_sum_composed",
    "softmax",
    "sparse_mla",
    "sparse_mla_leaves",
    "topk",
    "use_cpu_gemm",
    "use_path",
]

settle_intra_op_threads()  # before any op of ours: torch's first parallel CPU op can round otherwise
