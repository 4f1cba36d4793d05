"""How the layer functions apply a weight matrix: the single hook through which LoRA enters.

The layer functions never multiply by a weight themselves; they ask a `Projections` object.
The base class applies the weight alone through `zmrl.batch_invariant`. `zmrl.lora`
subclasses it and adds the unmerged adapter term at the points pinned here, so the model
(which may not import zmrl.lora) still fixes *where* the delta joins and in which dtype:
the delta is computed in the activation dtype and added to the base output once, right
after the base GEMM (y = base + delta), never inside the accumulator.

`name` is the parameter's path inside the decoder layer, e.g. "self_attn.q_a_proj.weight"
or "mlp.experts.gate_up_proj" (with `expert` set), so adapters key on checkpoint names.
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant import bmm, linear


class Projections:
    """Weights only (no adapter). Stateless; `BASE` is the shared instance."""

    #: True when routed experts carry an adapter (the MoE then runs the composed expert path)
    has_expert_adapter = False

    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [*, in], weight [out, in] -> [*, out]."""
        return linear(x, weight)

    def expert_linear(self, name: str, expert: int, x: torch.Tensor, weight: torch.Tensor,
                      rows: slice | None = None) -> torch.Tensor:
        """One routed expert's slice of a 3-D parameter: x [N, in], weight [out', in] -> [N, out'].

        `rows` says which output rows of the full [out, in] expert matrix `weight` is (the gate
        and up halves of gate_up_proj are separate GEMMs), so an adapter can slice its B."""
        return linear(x, weight)

    def absorb_uk(self, name: str, q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope], w_uk [H, nope, C] -> q_latent [T, H, C] = W_UK[h]^T q_nope[t, h]."""
        return bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_uv(self, name: str, o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """o_latent [T, H, C], w_uv [H, v, C] -> [T, H, v] = W_UV[h] o_latent[t, h]."""
        return bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


BASE = Projections()
