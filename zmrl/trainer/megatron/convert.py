"""HF checkpoint names <-> this rank's Megatron parameters, for base weights and LoRA factors.

A `Slot` says where one canonical tensor (an HF checkpoint tensor, or a zmrl.lora.LoraAdapter
factor) lives on one rank: whole, split into TP chunks along dim 0 or 1, or this rank's run of
routed experts (experts are split whole over the EP ranks, and a rank holds its run stacked in one
parameter per expert linear), optionally into a row block of the local parameter (a gated fc1
holds [gate_local; up_local]). `scatter` cuts canonical tensors into a
rank's parameters; `gather` reassembles them from every rank's parameters (a pure function of
the ranks' tensors, so mapping back is testable without processes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zmrl.lora.adapter import EXPERTS, LoraConfig, _key, factor_shapes
from zmrl.model.config import ModelConfig
from zmrl.model.layers import param_shapes
from zmrl.trainer.megatron.attention import NAMES as ATTN_NAMES
from zmrl.trainer.megatron.attention import SPLIT as ATTN_SPLIT


@dataclass(frozen=True)
class Slot:
    param: str
    """Megatron parameter (or buffer) name on this rank."""
    key: str
    """Canonical name: HF checkpoint tensor, or LoraAdapter.factors key."""
    split: str = "whole"
    """whole | dim0 | dim1 (TP chunks) | expert (canonical[expert : expert + num_experts])."""
    expert: int = -1
    """split "expert": the global id of the parameter's expert 0."""
    num_experts: int = 0
    """split "expert": how many experts the parameter stacks (its dim 0)."""
    block: tuple[int, int] | None = None
    """Rows [lo, hi) of the local parameter this slot fills (None: all of it)."""


@dataclass(frozen=True)
class Layout:
    cfg: ModelConfig
    tp: int
    rank: int
    """TP rank."""
    ep: int | None = None
    """Expert-parallel size (None: = tp)."""
    ep_rank: int | None = None
    """EP rank (None: = rank)."""

    @property
    def experts(self) -> range:
        """The routed experts this rank holds (EP rank r of EP size ep: the r-th run of E / ep)."""
        ep, ep_rank = (self.tp, self.rank) if self.ep is None else (self.ep, self.ep_rank)
        count = self.cfg.n_routed_experts // ep
        return range(ep_rank * count, (ep_rank + 1) * count)

    def _gated(self, param_fc1: str, param_fc2: str, hf: str, inter: int, replicated: bool = False) -> list[Slot]:
        """A SwiGLU's [gate; up] fc1 and fc2: TP-split, or whole on every rank (the shared expert)."""
        i = inter if replicated else inter // self.tp
        col, row = ("whole", "whole") if replicated else ("dim0", "dim1")
        return [Slot(param_fc1, hf + "gate_proj.weight", col, block=(0, i)),
                Slot(param_fc1, hf + "up_proj.weight", col, block=(i, 2 * i)),
                Slot(param_fc2, hf + "down_proj.weight", row)]

    def base(self) -> list[Slot]:
        cfg = self.cfg
        out = [Slot("embedding.word_embeddings.weight", "model.embed_tokens.weight", "dim0"),
               Slot("decoder.final_layernorm.weight", "model.norm.weight")]
        if not cfg.tie_word_embeddings:
            out.append(Slot("output_layer.weight", "lm_head.weight", "dim0"))
        for layer in range(cfg.num_hidden_layers):
            hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
            out += [Slot(mg + "input_layernorm.weight", hf + "input_layernorm.weight"),
                    Slot(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight")]
            for name, path in ATTN_NAMES.items():
                split = {0: "dim0", 1: "dim1"}.get(ATTN_SPLIT.get(name), "whole")
                out.append(Slot(f"{mg}self_attention.{path}.weight", hf + name, split))
            if not cfg.is_moe_layer(layer):
                out += self._gated(mg + "mlp.linear_fc1.weight", mg + "mlp.linear_fc2.weight", hf + "mlp.",
                                   cfg.intermediate_size)
                continue
            out += [Slot(mg + "mlp.router.weight", hf + "mlp.gate.weight"),
                    Slot(mg + "mlp.router.expert_bias", hf + "mlp.gate.e_score_correction_bias")]
            run = dict(split="expert", expert=self.experts.start, num_experts=len(self.experts))
            out += [Slot(mg + "mlp.experts.linear_fc1.weight", hf + "mlp.experts.gate_up_proj", **run),
                    Slot(mg + "mlp.experts.linear_fc2.weight", hf + "mlp.experts.down_proj", **run)]
            if cfg.n_shared_experts:
                out += self._gated(mg + "mlp.shared_experts.linear_fc1.weight",
                                   mg + "mlp.shared_experts.linear_fc2.weight", hf + "mlp.shared_experts.",
                                   cfg.moe_intermediate_size * cfg.n_shared_experts, replicated=True)
        return out

    def lora_modules(self, lcfg: LoraConfig) -> list[tuple[str, str, str, str]]:
        """(layer target) -> where its factors live: [(adapter key stem, module path, part, kind)]
        with kind column (B split over TP) | row | whole | expert (this rank's experts, stacked), for the
        targets the model has."""
        out = []
        for (layer, target) in factor_shapes(self.cfg, lcfg):
            mg = f"decoder.layers.{layer}."
            stem = _key(layer, target, "X")[:-1]
            if target in ATTN_NAMES:
                kind = {0: "column", 1: "row"}.get(ATTN_SPLIT.get(target), "whole")
                out.append((stem, f"{mg}self_attention.{ATTN_NAMES[target]}", "", kind))
            elif target in EXPERTS:
                fc = "linear_fc1" if target == "mlp.experts.gate_up_proj" else "linear_fc2"
                out.append((stem, f"{mg}mlp.experts.{fc}", "", "expert"))
            else:  # dense or shared-expert SwiGLU: gate/up are parts of one fc1
                shared = ".shared_experts." in target
                base = "mlp.shared_experts" if shared else "mlp"
                proj = target.split(".")[-2]
                if proj == "down_proj":
                    out.append((stem, f"{mg}{base}.linear_fc2", "", "whole" if shared else "row"))
                else:
                    out.append((stem, f"{mg}{base}.linear_fc1", proj.removesuffix("_proj"),
                                "whole" if shared else "column"))
        return out

    def lora(self, lcfg: LoraConfig) -> list[Slot]:
        out = []
        for stem, path, part, kind in self.lora_modules(lcfg):
            sfx = f"_{part}" if part else ""
            if kind == "expert":
                run = dict(split="expert", expert=self.experts.start, num_experts=len(self.experts))
                out += [Slot(f"{path}.lora_A", stem + "A", **run), Slot(f"{path}.lora_B", stem + "B", **run)]
            else:
                # column-parallel B holds this rank's output rows; row-parallel factors are whole
                out += [Slot(f"{path}.lora_A{sfx}", stem + "A"),
                        Slot(f"{path}.lora_B{sfx}", stem + "B", "dim0" if kind == "column" else "whole")]
        return out


def _piece(slot: Slot, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if slot.split == "dim0":
        return t.chunk(tp, 0)[rank]
    if slot.split == "dim1":
        return t.chunk(tp, 1)[rank]
    if slot.split == "expert":
        return t[slot.expert:slot.expert + slot.num_experts]
    return t


@torch.no_grad()
def scatter(layout: Layout, slots: list[Slot], canonical: dict[str, torch.Tensor],
            params: dict[str, torch.Tensor]) -> None:
    """Copy this rank's pieces of the canonical tensors into its parameters (in place), casting to
    the parameters' dtype (rounded as `.to` rounds). The copies within one device run as one
    foreach copy: a step's write of the masters is a few launches, not one or two per factor."""
    dsts, srcs = [], []
    for slot in slots:
        piece = _piece(slot, canonical[slot.key], layout.tp, layout.rank)
        dst = params[slot.param]
        if slot.block is not None:
            dst = dst[slot.block[0]:slot.block[1]]
        if dst.shape != piece.shape:
            raise ValueError(f"{slot.key} -> {slot.param}: piece {tuple(piece.shape)} does not fit "
                             f"{tuple(dst.shape)}")
        if slot.split == "expert" and piece.device != dst.device and not piece.is_contiguous():
            # a copy across devices first makes the source contiguous: one expert at a time, not
            # the whole run (an expanded matrix standing for every expert would be E copies)
            for d, p in zip(dst, piece):
                d.copy_(p)
        elif piece.device != dst.device:
            dst.copy_(piece)
        else:
            dsts.append(dst)
            srcs.append(piece)
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def gather(layouts: list[Layout], slots: list[list[Slot]], params: list[dict[str, torch.Tensor]],
           shapes: dict[str, tuple], copy: bool = True) -> dict[str, torch.Tensor]:
    """Every rank's slots and parameters (rank order) -> the canonical tensors named in `shapes`.
    copy=False: a tensor one rank holds whole comes back as that parameter itself, not a copy (for
    a reader that copies it anyway, such as the gradient's cast onto the fp32 masters)."""
    out = {}
    for key, shape in shapes.items():
        pieces = [(lay, s, p) for lay, ss, p in zip(layouts, slots, params) for s in ss if s.key == key]
        if not pieces:
            raise KeyError(f"no rank holds {key}")

        def get(s, p):
            t = p[s.param]
            return (t if s.block is None else t[s.block[0]:s.block[1]]).detach()

        lay, s0, p0 = pieces[0]
        if s0.split == "whole":
            out[key] = get(s0, p0).clone() if copy else get(s0, p0)
        elif s0.split in ("dim0", "dim1"):
            by_rank = {lay.rank: get(s, p) for lay, s, p in pieces}
            if lay.tp == 1 and not copy:
                out[key] = by_rank[0]
            else:
                out[key] = torch.cat([by_rank[r] for r in range(lay.tp)], 0 if s0.split == "dim0" else 1)
        else:
            # each rank's run of experts (replicas hold the same run), laid end to end
            runs = {s.expert: (s.num_experts, get(s, p)) for _, s, p in pieces}
            starts = sorted(runs)
            if [0] + [s + runs[s][0] for s in starts[:-1]] != starts:
                raise ValueError(f"the ranks' expert runs of {key} do not tile it: "
                                 f"{[(s, s + runs[s][0]) for s in starts]}")
            only = runs[starts[0]][1] if len(starts) == 1 else None
            out[key] = only if only is not None and not copy else torch.cat([runs[s][1] for s in starts])
        if tuple(out[key].shape) != tuple(shape):
            raise ValueError(f"gathered {key} has shape {tuple(out[key].shape)}, expected {tuple(shape)}")
    return out


def lora_shapes(cfg: ModelConfig, lcfg: LoraConfig) -> dict[str, tuple]:
    out = {}
    for (layer, target), (a, b) in factor_shapes(cfg, lcfg).items():
        out[_key(layer, target, "A")], out[_key(layer, target, "B")] = a, b
    return out


def base_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    return param_shapes(cfg)
