"""Megatron's parallel linears with zmrl's GEMM and the canonical LoRA inside, and zmrl's RMSNorm.

`ColumnLinear` / `RowLinear` are thin subclasses of megatron.core.tensor_parallel's
ColumnParallelLinear / RowParallelLinear: Megatron creates the (sharded) weight with its TP
attributes and its groups, and these forwards keep Megatron's collectives (copy-to-region before a
column-parallel GEMM, gather after it when asked, reduce after a row-parallel one) but compute the
local GEMM with zmrl.batch_invariant.linear. Why a subclass and not `zmrl.batch_invariant.enable()`
under Megatron's own forward: the subclass calls exactly the function the reference host and vLLM
call (on GPU the Triton path's `linear`, not its `mm` override), independently of a process-wide
switch; and it can run one GEMM over a block of the weight's rows, which zmrl's arithmetic needs
(the gate and up halves of a gated fc1 are two GEMMs in zmrl/model, never one fused GEMM).

LoRA (zmrl.lora's canonical form, docs/design.md "LoRA"): y = x W^T + ((x A^T) B^T) * scale, the delta
in the activation dtype, added once to the base GEMM's output. A linear carries one LoRA "part" per
adapted checkpoint weight: part "" covers all its output rows, and a gated fc1 of a dense or shared-
expert MLP carries parts "gate" and "up" (zmrl adapts gate_proj and up_proj separately). Under TP a
column-parallel B holds this rank's output rows; A is whole, and x A^T passes copy-to-region so that
A's gradient (and the branch's input gradient) is summed over the ranks. A row-parallel linear
gathers its input for the LoRA branch, so A and B are whole and the delta is the TP=1 delta, bit for
bit.

With batch invariance off (the negative control) the trainer forces zmrl.batch_invariant's "torch"
path, so these GEMMs, like every zmrl op, run on torch's default kernels.
"""
from __future__ import annotations

import torch
from torch import nn

from zmrl.batch_invariant import linear as bi_linear
from zmrl.batch_invariant import rms_norm
from zmrl.trainer.megatron.compat import import_megatron

import_megatron()
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [*, in], weight [out, in] -> [*, out]: zmrl.batch_invariant.linear (whose "torch" path,
    forced by the trainer's batch_invariant=False, is torch's default kernel: the control)."""
    return bi_linear(x, weight)


class _LoraMixin:
    """LoRA parts on a parallel linear: parameters lora_A{_part} [r, in], lora_B{_part} [out', r]."""

    lora_rows: dict[str, slice | None] = {}
    lora_scale: float = 0.0
    lora_on: bool = True
    """False: the LoRA branch is skipped (the reference policy: base model only)."""

    def add_lora(self, parts: dict[str, slice | None], r: int, scale: float, a_in: int, b_out: int) -> None:
        """parts: name -> the rows of this rank's output it covers (None: all, b_out rows)."""
        self.lora_rows = {**self.lora_rows, **parts}
        self.lora_scale = scale
        like = dict(dtype=self.weight.dtype, device=self.weight.device)
        for part, rows in parts.items():
            n_out = b_out if rows is None else rows.stop - rows.start
            sfx = f"_{part}" if part else ""
            # zeros here; the trainer copies in zmrl.lora.LoraAdapter's initial factors
            self.register_parameter(f"lora_A{sfx}", nn.Parameter(torch.zeros(r, a_in, **like)))
            self.register_parameter(f"lora_B{sfx}", nn.Parameter(torch.zeros(n_out, r, **like)))

    def lora_pair(self, part: str = "") -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.lora_on or part not in self.lora_rows:
            return None
        sfx = f"_{part}" if part else ""
        return getattr(self, f"lora_A{sfx}"), getattr(self, f"lora_B{sfx}")

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters(recurse=False) if n.startswith("lora_")}

    def _tp_comm(self) -> bool:
        # expert linears (EP > 1 or expert-TP > 1) do their own communication; ours have none
        return self.tp_group is not None and self.tp_group.size() > 1 and not self.explicit_expert_comm


class ColumnLinear(_LoraMixin, ColumnParallelLinear):
    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None,
                rows: slice | None = None, part: str = "") -> tuple[torch.Tensor, None]:
        """x [*, in] (whole) -> ([*, out] if gathering else [*, out/tp], None). rows: one block of
        this rank's output rows (one GEMM over those weight rows); part: which LoRA part applies."""
        w = self.weight if weight is None else weight
        comm = self._tp_comm()
        xb = copy_to_tensor_model_parallel_region(x, group=self.tp_group) if comm else x
        y = gemm(xb, w if rows is None else w[rows])
        pair = self.lora_pair(part)
        if pair is not None:
            a, b = pair
            if self.lora_rows[part] is None and rows is not None:
                b = b[rows]
            # the region sits after A (not before it): the gradient of x A^T is summed over the
            # ranks there, so A's gradient and this branch's input gradient are already whole and
            # must not pass the base branch's region a second time
            h = gemm(x, a)
            if comm:
                h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            y = y + gemm(h, b) * self.lora_scale
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and comm:
            y = gather_from_tensor_model_parallel_region(y, group=self.tp_group)
        return y, None


class RowLinear(_LoraMixin, RowParallelLinear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """x [*, in/tp] (this rank's slice, input_is_parallel) -> ([*, out] summed over ranks, None)."""
        comm = self._tp_comm()
        y = gemm(x, self.weight)
        if comm:
            y = reduce_from_tensor_model_parallel_region(y, group=self.tp_group)
        pair = self.lora_pair("")
        if pair is not None:
            a, b = pair
            xf = gather_from_tensor_model_parallel_region(x, group=self.tp_group) if comm else x
            y = y + gemm(gemm(xf, a), b) * self.lora_scale
        return y, None


class RMSNorm(nn.Module):
    """zmrl.batch_invariant.rms_norm (fp32 inside, cast back) with Megatron's norm constructor."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        dtype = dtype or (config.params_dtype if config is not None else torch.float32)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _group(is_expert: bool):
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_group() if is_expert else ps.get_tensor_model_parallel_group()


def column(in_features: int, out_features: int, config, *, gather_output: bool, is_expert: bool = False,
           cls=ColumnLinear, **kwargs) -> ColumnLinear:
    return cls(in_features, out_features, config=config, init_method=config.init_method, bias=False,
               gather_output=gather_output, skip_bias_add=False, is_expert=is_expert, tp_group=_group(is_expert),
               **kwargs)


def row(in_features: int, out_features: int, config, *, is_expert: bool = False, cls=RowLinear) -> RowLinear:
    return cls(in_features, out_features, config=config, init_method=config.output_layer_init_method,
               bias=False, input_is_parallel=True, skip_bias_add=False, is_expert=is_expert,
               tp_group=_group(is_expert))
