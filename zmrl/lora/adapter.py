"""The canonical LoRA (docs/design.md, "LoRA"): unmerged, y = x W^T + ((x A^T) B^T) * scale.

Every term runs through zmrl.batch_invariant (linear / bmm / matmul), the delta is computed
in the activation dtype and added once to the base GEMM's output (the joining point is
fixed by zmrl.model.projections). scale = lora_alpha / r. B starts at zero, so a fresh
adapter leaves every output bitwise unchanged (base + 0.0).

Factor shapes (per decoder layer, keyed by the checkpoint name of the adapted weight):
  2-D weight [out, in]:            A [r, in],     B [out, r]
  3-D experts [E, out, in]:        A [E, r, in],  B [E, out, r]   (expert e: A[e], B[e])
kv_b_proj in the absorbed form stays unmerged by moving the factors to the other side:
  q_latent[h] = W_UK[h]^T q[h] + s * A^T (B_K[h]^T q[h]),  o[h] = W_UV[h] o_lat[h] + s * B_V[h] (A o_lat[h])
where B_K, B_V are B's rows of head h's nope and v parts (B viewed [H, nope + v, r]).

Targets: every attention projection, every routed expert and the shared expert by default; the
dense MLP of the first layers on request. Refused: the router (mlp.gate: routing stays the base
model's) and the DSA indexer's projections: the indexer only selects tokens, top-k selection has
no gradient, so factors there would never train (an indexer trained by its own loss, as
DeepSeek-V3.2 does, is not implemented).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from zmrl.batch_invariant import add_scaled, bmm, linear
from zmrl.batch_invariant.matmul import weight_leaves
from zmrl.batch_invariant.collectives import fan_out, num_leaves
from zmrl.model.config import ModelConfig
from zmrl.model.layers import layer_param_shapes
from zmrl.model.projections import GroupedExperts, Projections, sharded_linear, stacked_experts

ATTENTION = ["self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
             "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight"]
INDEXER = ["self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight", "self_attn.indexer.weights_proj.weight"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SHARED = ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
          "mlp.shared_experts.down_proj.weight"]
DENSE = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
DEFAULT_TARGETS = ATTENTION + EXPERTS + SHARED
ALLOWED_TARGETS = DEFAULT_TARGETS + DENSE
# weights the model has but no training signal reaches through a LoRA on them: refused by name
NO_GRADIENT_TARGETS = {t: "the DSA indexer only selects tokens and top-k has no gradient" for t in INDEXER}


@dataclass(kw_only=True)
class LoraConfig:
    r: int = 8
    """Rank of every adapted weight."""
    lora_alpha: float = 16.0
    """scale = lora_alpha / r."""
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Checkpoint names inside a decoder layer (ALLOWED_TARGETS); the indexer is refused with its
    reason, the router is simply not a target (unknown names are refused)."""

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRA r must be an int >= 1, got {self.r!r}")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        dead = [t for t in self.targets if t in NO_GRADIENT_TARGETS]
        if dead:
            raise ValueError(f"LoRA target {dead[0]} would never train ({NO_GRADIENT_TARGETS[dead[0]]}); "
                             f"remove it from the targets")
        bad = [t for t in self.targets if t not in ALLOWED_TARGETS]
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; allowed: {ALLOWED_TARGETS}")

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.r


def factor_shapes(cfg: ModelConfig, lcfg: LoraConfig) -> dict[tuple[int, str], tuple[tuple, tuple]]:
    """(layer, target) -> (A shape, B shape) for every target the model has."""
    out = {}
    for layer in range(cfg.num_hidden_layers):
        shapes = layer_param_shapes(cfg, layer)
        for t in lcfg.targets:
            if t not in shapes:
                continue  # e.g. expert targets on a dense layer
            shape = shapes[t]
            if len(shape) == 3:
                out[(layer, t)] = ((shape[0], lcfg.r, shape[2]), (shape[0], shape[1], lcfg.r))
            else:
                out[(layer, t)] = ((lcfg.r, shape[1]), (shape[0], lcfg.r))
    return out


def _key(layer: int, target: str, which: str) -> str:
    return f"layers_{layer}__{target.replace('.', '__')}__{which}"


class LoraAdapter(nn.Module):
    """The adapter's factors as trainable parameters; `projections(layer)` plugs it into the model."""

    def __init__(self, cfg: ModelConfig, lcfg: LoraConfig, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.lcfg = cfg, lcfg
        self.factors = nn.ParameterDict()
        gen = torch.Generator().manual_seed(seed)
        for (layer, target), (a_shape, b_shape) in factor_shapes(cfg, lcfg).items():
            fan_in = a_shape[-1]
            # A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform bound with a = sqrt(5)); B = 0
            bound = 1.0 / math.sqrt(fan_in)
            a = (torch.rand(a_shape, generator=gen) * 2 - 1) * bound
            self.factors[_key(layer, target, "A")] = nn.Parameter(a.to(dtype))
            self.factors[_key(layer, target, "B")] = nn.Parameter(torch.zeros(b_shape, dtype=dtype))

    def pair(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = _key(layer, target, "A")
        if key not in self.factors:
            return None
        return self.factors[key], self.factors[_key(layer, target, "B")]

    def items(self):
        """Yields (layer, target, A, B)."""
        for (layer, target) in factor_shapes(self.cfg, self.lcfg):
            a, b = self.pair(layer, target)
            yield layer, target, a, b

    def projections(self, layer: int) -> "LoraProjections":
        return LoraProjections(self, layer)


class LoraProjections(Projections):
    def __init__(self, adapter: LoraAdapter, layer: int):
        self.adapter, self.layer, self.scale = adapter, layer, adapter.lcfg.scale
        self.has_expert_adapter = any(adapter.pair(layer, t) is not None for t in EXPERTS)

    def linear(self, name, x, weight):
        return sharded_linear(name, x, weight, self.shards, self.adapter.pair(self.layer, name), self.scale)

    def expert_linear(self, name, expert, x, weight, rows=None):
        y = linear(x, weight)
        pair = self.adapter.pair(self.layer, name)
        if pair is None:
            return y
        a, b = pair[0][expert], pair[1][expert]
        return add_scaled(y, linear(linear(x, a), b if rows is None else b[rows]), self.scale)

    def grouped_experts(self, w):
        # an expert-parallel rank's factors hold its own experts, as its weight stacks do
        (gate_up, first), (down, _) = stacked_experts(w, EXPERTS[0]), stacked_experts(w, EXPERTS[1])
        return GroupedExperts(gate_up, down, self.adapter.pair(self.layer, EXPERTS[0]),
                              self.adapter.pair(self.layer, EXPERTS[1]), self.scale, first)

    def _kv_b(self, name, part):
        pair = self.adapter.pair(self.layer, name)
        if pair is None:
            return None
        cfg = self.adapter.cfg
        nope = cfg.qk_nope_head_dim
        b = pair[1].view(-1, nope + cfg.v_head_dim, pair[1].shape[-1])  # this host's heads
        return pair[0], (b[:, :nope] if part == "k" else b[:, nope:])

    def _per_head_leaf(self, a, heads: int):
        """A (whole, read by every head) once per canonical head leaf of this host's `heads`: A's
        gradient is summed over the leaves by the canonical tree (across the TP ranks, which hold
        some of the heads), never in one GEMM whose K spans this rank's heads."""
        return fan_out(a, num_leaves(heads * self.shards.size), self.shards)

    def absorb_uk(self, name, q_nope, w_uk):
        y = super().absorb_uk(name, q_nope, w_uk)
        f = self._kv_b(name, "k")
        if f is None:
            return y
        a, b_k = f  # a [r, C], b_k [H, nope, r]
        u = bmm(q_nope.transpose(0, 1), b_k)  # [H, T, r]
        delta = weight_leaves(u, self._per_head_leaf(a, u.shape[0]), 0)  # [H, T, C]: u's head leaves @ A
        return add_scaled(y, delta.transpose(0, 1), self.scale)

    def expand_uv(self, name, o_latent, w_uv):
        y = super().expand_uv(name, o_latent, w_uv)
        f = self._kv_b(name, "v")
        if f is None:
            return y
        a, b_v = f  # a [r, C], b_v [H, v, r]
        z = weight_leaves(o_latent, self._per_head_leaf(a, o_latent.shape[1]), 1, transposed=True)  # [T, H, r]
        return add_scaled(y, bmm(z.transpose(0, 1), b_v.transpose(1, 2)).transpose(0, 1), self.scale)
