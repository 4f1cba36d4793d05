"""Megatron's parallel linears with zmrl's canonical TP arithmetic and LoRA inside, and zmrl's RMSNorm.

`ColumnLinear` / `RowLinear` are thin subclasses of megatron.core.tensor_parallel's
ColumnParallelLinear / RowParallelLinear: Megatron creates the (sharded) weight with its TP
attributes and its groups; the forwards compute through zmrl.batch_invariant.collectives, the very
functions zmrl/model's Projections call on a single host: one GEMM per canonical leaf of the split
dimension, the cross-rank sums (a row-parallel GEMM's partials, a column-parallel GEMM's input
gradient) by the canonical tree over an all-gather of tensors. So TP = 1, 2, 4 and 8 give the same
bits, and the same bits as the reference host and vLLM. `Replicated` holds a whole weight on every
rank (MLA's down-projections, the indexer, the shared expert: what vLLM replicates too).
The gathers (column outputs, a row-parallel LoRA branch's input) are Megatron's: exact copies.

LoRA (zmrl.lora's canonical form, docs/design.md "LoRA"): y = x W^T + ((x A^T) B^T) * scale, the delta in the activation
dtype, added to the base output of each leaf. A linear carries one LoRA "part" per adapted
checkpoint weight: part "" covers all its output rows, and a gated fc1 of a dense MLP or shared
expert carries parts "gate" and "up" (zmrl adapts gate_proj and up_proj separately). Under TP a
column-parallel B holds this rank's output rows and A is whole; a row-parallel linear gathers its
input for the LoRA branch, so A and B are whole and the delta is the TP=1 delta, bit for bit.
Routed experts are whole on their rank: `ExpertStack` holds one linear of all of a rank's experts
stacked (the grouped MoE kernels read it as it is; the per-expert path applies plain GEMMs to views).

With batch invariance off (the negative control) the trainer forces zmrl.batch_invariant's "torch"
path, so these GEMMs, like every zmrl op, run on torch's default kernels.
"""
from __future__ import annotations

import torch
from torch import nn

from zmrl.batch_invariant import add_scaled
from zmrl.batch_invariant import linear as bi_linear
from zmrl.batch_invariant import rms_norm
from zmrl.batch_invariant.collectives import LOCAL, Shards, column_linear, num_leaves, row_linear
from zmrl.trainer.megatron.compat import import_megatron

import_megatron()
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region  # noqa: E402


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

    #: canonical leaves of the split dimension (per gate/up block of a gated fc1); None: a plain
    #: GEMM (an expert linear: whole on its rank)
    leaves: int | None = None
    shards: Shards = LOCAL

    def with_delta(self, y: torch.Tensor, x: torch.Tensor, pair) -> torch.Tensor:
        """y + ((x A^T) B^T) * scale, the scale and the sum in one launch on CUDA (add_scaled)."""
        a, b = pair
        return add_scaled(y, gemm(gemm(x, a), b), self.lora_scale)


class ColumnLinear(_LoraMixin, ColumnParallelLinear):
    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None,
                rows: slice | None = None, part: str = "") -> tuple[torch.Tensor, None]:
        """x [*, in] (whole) -> ([*, out] if gathering else [*, out/tp], None). rows: one block of
        this rank's output rows (the gate or up half of a gated fc1); part: which LoRA part applies."""
        w = self.weight if weight is None else weight
        w = w if rows is None else w[rows]
        pair = self.lora_pair(part)
        if pair is not None and self.lora_rows[part] is None and rows is not None:
            pair = (pair[0], pair[1][rows])
        if self.leaves is None:
            y = gemm(x, w)
            y = y if pair is None else self.with_delta(y, x, pair)
        else:
            y = column_linear(x, w, self.leaves, self.shards, pair, self.lora_scale)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.shards.size > 1:
            y = gather_from_tensor_model_parallel_region(y, group=self.tp_group)
        return y, None


class RowLinear(_LoraMixin, RowParallelLinear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """x [*, in/tp] (this rank's slice, input_is_parallel) -> ([*, out] summed over ranks, None)."""
        pair = self.lora_pair("")
        if self.leaves is None:
            y = gemm(x, self.weight)
            return (y if pair is None else self.with_delta(y, x, pair)), None
        y = row_linear(x, self.weight, self.leaves, self.shards)
        if pair is not None:
            xf = gather_from_tensor_model_parallel_region(x, group=self.tp_group) if self.shards.size > 1 else x
            y = self.with_delta(y, xf, pair)
        return y, None


class Replicated(_LoraMixin, nn.Module):
    """A whole weight on every rank, applied by zmrl's GEMM: no communication, the TP = 1 bits.
    Its input gradient is whole wherever its output gradient is (every consumer downstream
    completes its own cross-rank sums)."""

    def __init__(self, in_features: int, out_features: int, config):
        super().__init__()
        self.input_size, self.output_size = in_features, out_features
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor, rows: slice | None = None, part: str = "") -> tuple[torch.Tensor, None]:
        w = self.weight if rows is None else self.weight[rows]
        pair = self.lora_pair(part)
        if pair is not None and self.lora_rows[part] is None and rows is not None:
            pair = (pair[0], pair[1][rows])
        y = gemm(x, w)
        return (y if pair is None else self.with_delta(y, x, pair)), None


class ExpertStack(_LoraMixin, nn.Module):
    """One linear of every routed expert on this rank, stacked: `weight` [E_local, out, in] (frozen:
    LoRA trains) and, after add_lora, `lora_A` [E_local, r, in] and `lora_B` [E_local, out, r]
    (trained), in the layout zmrl.model.projections.GroupedExperts and zmrl.lora.LoraAdapter hold.

    The stacked tensors are the parameters (not per-expert parameters viewing one storage): the
    grouped kernels take them as they are, so no forward stacks a copy and their factor gradients
    arrive stacked; `Module.to` and `load_state_dict` keep them whole, where views of one storage
    would each become a copy of their own; and the optimizer never sees these names (it steps fp32
    masters in zmrl.lora's canonical layout, and convert.py maps each stacked parameter to its run of
    the canonical [E, ...] tensor). The per-expert path reads views: `weight[j]`, and the factors
    unbound once per forward (ModuleProjections), so one unbind backward stacks their gradients.

    `weight` is allocated uninitialized on the default device (the trainer moves the model to its
    device, then copies the checkpoint in; untouched host pages cost no memory on the way)."""

    def __init__(self, count: int, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.count, self.input_size, self.output_size = count, in_features, out_features
        self.weight = nn.Parameter(torch.empty(count, out_features, in_features, dtype=dtype), requires_grad=False)

    def add_lora(self, parts: dict[str, slice | None], r: int, scale: float, a_in: int, b_out: int) -> None:
        """parts: {"": None}: an expert's factors cover all its rows (zmrl.lora adapts gate_up_proj whole)."""
        if parts != {"": None} or (a_in, b_out) != (self.input_size, self.output_size):
            raise ValueError(f"an expert stack takes one LoRA part over all its {self.output_size} x "
                             f"{self.input_size} rows, got parts {sorted(parts)} for {b_out} x {a_in}")
        self.lora_rows, self.lora_scale = {"": None}, scale
        like = dict(dtype=self.weight.dtype, device=self.weight.device)
        # zeros here; the trainer copies in zmrl.lora.LoraAdapter's initial factors
        self.lora_A = nn.Parameter(torch.zeros(self.count, r, a_in, **like))
        self.lora_B = nn.Parameter(torch.zeros(self.count, b_out, r, **like))


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


def tp_shards() -> Shards:
    from megatron.core import parallel_state as ps

    return Shards(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                  ps.get_tensor_model_parallel_group())


def column(in_features: int, out_features: int, config, *, gather_output: bool, is_expert: bool = False,
           blocks: int = 1, cls=ColumnLinear, **kwargs) -> ColumnLinear:
    """A column-parallel linear (an expert's: a plain GEMM). blocks: equal row blocks applied as
    separate weights (a gated fc1's gate and up: 2), each split into its own canonical leaves."""
    m = cls(in_features, out_features, config=config, init_method=config.init_method, bias=False,
            gather_output=gather_output, skip_bias_add=False, is_expert=is_expert, tp_group=_group(is_expert),
            **kwargs)
    if not is_expert:
        m.leaves, m.shards = num_leaves(out_features // blocks), tp_shards()
    return m


def row(in_features: int, out_features: int, config, *, is_expert: bool = False, cls=RowLinear) -> RowLinear:
    m = cls(in_features, out_features, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=False, is_expert=is_expert,
            tp_group=_group(is_expert))
    if not is_expert:
        m.leaves, m.shards = num_leaves(in_features), tp_shards()
    return m
