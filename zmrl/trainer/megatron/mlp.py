"""zmrl's dense SwiGLU MLP and routed MoE (+ shared expert) as Megatron MLP modules.

Parameters follow Megatron's names: a gated `linear_fc1` holds [gate; up] rows (this rank's
gate rows, then its up rows, under TP), `linear_fc2` the down projection; the MoE holds
`router.weight` / `router.expert_bias`, `experts.linear_fc{1,2}` (this rank's routed experts,
stacked: `ExpertStack`) and `shared_experts.linear_fc{1,2}`. The arithmetic is zmrl/model's:
dense_mlp and moe_mlp run over these modules through ModuleProjections.

The dense MLP is TP-split (fc1 column-parallel, fc2 row-parallel, by zmrl's canonical leaves). Routed
experts are split whole over the EP ranks (expert-TP = 1; EP independent of TP) in zmrl's canonical
expert leaves; the shared expert is replicated (whole on every rank, as the router is). Every EP
rank holds the same tokens (the whole batch: the dense part before it is TP-reduced or replicated). With EP = 1 the
forward is zmrl.model.mlp.moe_mlp itself, on the same path the other hosts take: the fused MoE
kernel when no expert carries an active adapter (over the stacked expert weights themselves), the
composed path when one does (on CUDA the grouped kernels over the stacked weights and factors, on
CPU the per-expert loop over views of them). With EP > 1 each rank
runs zmrl's composed expert loop over its own expert leaves (the same per-expert GEMMs, hence the
same bits; the gradient of the tokens summed over every rank's leaves by the canonical tree), the
ranks' per-slot outputs are all-gathered and each (token, slot) is taken from the rank that owns its
expert, and the combine is zmrl's: fp32 sum in ascending expert order, the shared expert added last.
Under zmrl.batch_invariant.collectives.ordinary_all_reduce() (the negative control) each rank
combines its own slots and the ranks' partial combines are all-reduced in the model's dtype, as
Megatron's dispatchers do with their default router dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from zmrl.model.config import ModelConfig
from zmrl.batch_invariant.collectives import Shards, is_ordinary
from zmrl.model.mlp import combine_slots, dense_mlp, expert_slot_outputs, moe_mlp, route, shared_expert
from zmrl.model.projections import BASE
from zmrl.trainer.megatron.compat import import_megatron
from zmrl.trainer.megatron.layers import ExpertStack, Replicated, column, row
from zmrl.trainer.megatron.projections import ModuleProjections

import_megatron()
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region  # noqa: E402
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region  # noqa: E402
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402


class GatedMLP(nn.Module):
    """A SwiGLU MLP: fc1 [gate; up] and fc2, TP-split (fc1 column-parallel [gate_local; up_local],
    fc2 row-parallel) or replicated (the shared expert)."""

    def __init__(self, config, hidden: int, inter: int, replicated: bool = False):
        super().__init__()
        self.build(config, hidden, inter, replicated)

    def build(self, config, hidden: int, inter: int, replicated: bool = False) -> None:
        if replicated:
            self.inter_local = inter
            self.linear_fc1, self.linear_fc2 = Replicated(hidden, 2 * inter, config), Replicated(inter, hidden, config)
            return
        self.inter_local = inter // config.tensor_model_parallel_size
        self.linear_fc1 = column(hidden, 2 * inter, config, gather_output=False, blocks=2)
        self.linear_fc2 = row(inter, hidden, config)

    def linears(self, prefix: str) -> dict:
        """checkpoint name -> (module, rows of this rank's fc1 output, LoRA part)."""
        i = self.inter_local
        return {prefix + "gate_proj.weight": (self.linear_fc1, slice(0, i), "gate"),
                prefix + "up_proj.weight": (self.linear_fc1, slice(i, 2 * i), "up"),
                prefix + "down_proj.weight": (self.linear_fc2, None, "")}


class _Layered(MegatronModule):
    layer = 0

    def set_layer_number(self, layer_number: int) -> None:
        """TransformerLayer calls this (Megatron counts layers from 1)."""
        self.layer = layer_number - 1


class ZmrlDenseMLP(_Layered):
    def __init__(self, config, submodules=None, *, model_cfg: ModelConfig, **unused):
        super().__init__(config=config)
        self.cfg = model_cfg
        # Megatron's MLP names: mlp.linear_fc1 / mlp.linear_fc2
        GatedMLP.build(self, config, model_cfg.hidden_size, model_cfg.intermediate_size)

    linears = GatedMLP.linears

    def forward(self, hidden_states: torch.Tensor, **unused):
        """[S, B, D] (post-attention-normed) -> ([S, B, D], None)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # row-wise: the token order does not matter
        proj = ModuleProjections(self.cfg, self.layer, self.linears("mlp."))
        w = {name: mod.weight for name, (mod, _, _) in proj.linears.items()}
        return dense_mlp(self.cfg, w, x, proj).view(shape), None


class _Experts:
    """gate_up_proj / down_proj as zmrl/model indexes them ([e] or [e, rows], e a global expert id):
    views of the stacked weight of this rank's experts first, first + 1, ..."""

    def __init__(self, weight: torch.Tensor, first: int):
        self.weight, self.first = weight, first

    def __getitem__(self, key):
        e, rows = key if isinstance(key, tuple) else (key, slice(None))
        return self.weight[e - self.first][rows]


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype))
        # selection-only bias (DeepSeek-V3's e_score_correction_bias): a checkpoint tensor, never trained
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=dtype))


class RoutedExperts(nn.Module):
    """This rank's routed experts first ... first + count - 1: `linear_fc1` ([gate; up] rows, as
    the checkpoint's gate_up_proj) and `linear_fc2` (down_proj), each an ExpertStack."""

    def __init__(self, cfg: ModelConfig, first: int, count: int, dtype: torch.dtype):
        super().__init__()
        self.first, self.count = first, count
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.linear_fc1 = ExpertStack(count, d, 2 * i, dtype)
        self.linear_fc2 = ExpertStack(count, i, d, dtype)


class ZmrlMoE(_Layered):
    def __init__(self, config, submodules=None, *, model_cfg: ModelConfig, **unused):
        super().__init__(config=config)
        cfg = self.cfg = model_cfg
        self.ep = ps.get_expert_model_parallel_world_size()
        count = cfg.n_routed_experts // self.ep
        first = ps.get_expert_model_parallel_rank() * count
        self.router = Router(cfg.n_routed_experts, cfg.hidden_size, config.params_dtype)
        self.experts = RoutedExperts(cfg, first, count, config.params_dtype)
        self.shared_experts = (GatedMLP(config, cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                        replicated=True) if cfg.n_shared_experts else None)
        self.ep_shards = Shards(self.ep, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_group())

    def weights_and_projections(self) -> tuple[dict, ModuleProjections]:
        first, fc1, fc2 = self.experts.first, self.experts.linear_fc1, self.experts.linear_fc2
        linears = self.shared_experts.linears("mlp.shared_experts.") if self.shared_experts is not None else {}
        experts = {"mlp.experts.gate_up_proj": (fc1, first), "mlp.experts.down_proj": (fc2, first)}
        w = {name: mod.weight for name, (mod, _, _) in linears.items()}
        w.update({"mlp.gate.weight": self.router.weight, "mlp.gate.e_score_correction_bias": self.router.expert_bias,
                  "mlp.experts.gate_up_proj": _Experts(fc1.weight, first),
                  "mlp.experts.down_proj": _Experts(fc2.weight, first)})
        return w, ModuleProjections(self.cfg, self.layer, linears, experts)

    def _adapted(self) -> bool:
        """Whether a LoRA part is active on a routed or shared expert."""
        mods = [self.experts.linear_fc1, self.experts.linear_fc2]
        if self.shared_experts is not None:
            mods += [self.shared_experts.linear_fc1, self.shared_experts.linear_fc2]
        return any(m.lora_pair(part) is not None for m in mods for part in m.lora_rows)

    def _fused_weights(self) -> dict:
        """The checkpoint tensors moe_mlp's fused path reads: the stacked expert weights themselves."""
        w = {"mlp.gate.weight": self.router.weight, "mlp.gate.e_score_correction_bias": self.router.expert_bias,
             "mlp.experts.gate_up_proj": self.experts.linear_fc1.weight,
             "mlp.experts.down_proj": self.experts.linear_fc2.weight}
        if self.shared_experts is not None:
            for name, (mod, rows, _) in self.shared_experts.linears("mlp.shared_experts.").items():
                w[name] = mod.weight if rows is None else mod.weight[rows]
        return w

    def forward(self, hidden_states: torch.Tensor, **unused):
        """[S, B, D] (post-attention-normed) -> ([S, B, D], None)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if self.ep == 1 and not self._adapted():
            # no expert adapter: zmrl's fused MoE kernel, the path every other host takes for the
            # base model (on CUDA the Triton grouped kernel is not bitwise the per-expert path)
            out = moe_mlp(self.cfg, self._fused_weights(), x, BASE)
        else:
            w, proj = self.weights_and_projections()
            out = moe_mlp(self.cfg, w, x, proj) if self.ep == 1 else self._expert_parallel(w, x, proj)
        return out.view(shape), None

    def _expert_parallel(self, w, x: torch.Tensor, proj: ModuleProjections) -> torch.Tensor:
        # zmrl.model.mlp's composed experts over this rank's expert leaves, the per-slot outputs
        # gathered from their owners before zmrl's combine
        cfg = self.cfg
        weights, ids = route(cfg, w, x)
        count = self.experts.count
        n_tokens, k = ids.shape
        group = ps.get_expert_model_parallel_group()
        slot_out = expert_slot_outputs(cfg, w, x, ids, proj, shards=self.ep_shards)
        if is_ordinary():
            # the control, Megatron's default dispatcher: this rank's slots combined (the others
            # are zeros) and rounded to the model's dtype (its router dtype by default), then an
            # all-reduce of the partial combines (its backward: identity), the shared expert added
            # after in that dtype. Reduced in fp32 instead, a bf16 model's control would round
            # back to the tree's bits almost everywhere and prove nothing. Each rank's
            # routing-weight gradient covers its own slots only: all-reduced in the backward (the
            # router is replicated, so its input gradient must be whole on every rank)
            wf = copy_to_tensor_model_parallel_region(weights.float(), group=group)
            partial = wf[:, 0, None] * slot_out[:, 0]
            for j in range(1, k):
                partial = partial + wf[:, j, None] * slot_out[:, j]
            routed = reduce_from_tensor_model_parallel_region(partial.to(x.dtype), group=group)
            shared = shared_expert(cfg, w, x, proj)
            return routed if shared is None else routed + shared.to(x.dtype)
        # all-gather along the last dim (backward: each rank keeps its own slice's gradient), then
        # pick each slot from its owner: a copy, so every slot holds its owner's exact bits
        gathered = gather_from_tensor_model_parallel_region(slot_out.reshape(n_tokens, -1), group=group)
        gathered = gathered.view(n_tokens, self.ep, k, x.shape[1])
        owner = ids // count
        slot_out = gathered[torch.arange(n_tokens, device=x.device)[:, None], owner,
                            torch.arange(k, device=x.device)[None, :]]
        return combine_slots(slot_out, weights, shared_expert(cfg, w, x, proj), x.dtype)
