"""PEFT-format adapter files: adapter_config.json + adapter_model.safetensors.

Names are what PEFT 0.21 writes for the transformers host (a test saves through PEFT and compares):
  2-D targets (target_modules):  base_model.model.model.layers.{i}.<module>.lora_A.weight [r, in]
                                                                       .lora_B.weight [out, r]
  experts (target_parameters, gate_up_proj registered before down_proj, so gate_up is the
  inner wrapper): ...mlp.experts.base_layer.lora_{A,B}.weight (gate_up), ...mlp.experts.lora_{A,B}.weight
  (down), with A [r*E, in] = zmrl's A [E, r, in] flattened, and B [out, r*E] laid out
  (out, r, E): B_peft[:, j, e] = zmrl's B[e][:, j]. This is PEFT's and vLLM's 3-D convention.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zmrl.lora.adapter import ALLOWED_TARGETS, EXPERTS, NO_GRADIENT_TARGETS, LoraAdapter, LoraConfig, factor_shapes
from zmrl.model.config import ModelConfig

PREFIX = "base_model.model.model.layers."


def _module_suffix(target: str) -> str:
    """PEFT target_modules entry for a 2-D target: its module path without '.weight' and
    without 'self_attn.' (shared-expert names keep their parent so they never match the dense MLP)."""
    mod = target[: -len(".weight")]
    return mod.replace("self_attn.", "")


def _peft_names(layer: int, target: str) -> tuple[str, str]:
    if target == "mlp.experts.gate_up_proj":
        base = f"{PREFIX}{layer}.mlp.experts.base_layer"
    elif target == "mlp.experts.down_proj":
        base = f"{PREFIX}{layer}.mlp.experts"
    else:
        base = f"{PREFIX}{layer}.{target[: -len('.weight')]}"
    return base + ".lora_A.weight", base + ".lora_B.weight"


def peft_tensors(adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """The adapter's factors under their PEFT names and layouts (what save_peft writes)."""
    tensors = {}
    for layer, target, a, b in adapter.items():
        name_a, name_b = _peft_names(layer, target)
        if a.dim() == 3:
            e, r, _ = a.shape
            tensors[name_a] = a.detach().reshape(e * r, a.shape[2])
            tensors[name_b] = b.detach().permute(1, 2, 0).reshape(b.shape[1], r * e)
        else:
            tensors[name_a], tensors[name_b] = a.detach(), b.detach()
    return tensors


def peft_config(lcfg: LoraConfig, base_model_name_or_path: str | None = None) -> dict:
    """adapter_config.json's fields for `lcfg`."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lcfg.r, "lora_alpha": lcfg.lora_alpha,
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
        "target_modules": sorted(_module_suffix(t) for t in lcfg.targets if t not in EXPERTS),
        "target_parameters": [t for t in EXPERTS if t in lcfg.targets],
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
    }


def save_peft(adapter: LoraAdapter, out: str | Path, base_model_name_or_path: str | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = peft_tensors(adapter)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = peft_config(adapter.lcfg, base_model_name_or_path)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_peft(path: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """-> a LoraAdapter for `cfg`; raises naming every tensor that does not fit this model."""
    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    return adapter_from_peft(config, tensors, cfg, dtype, where=str(path))


def _targets_named_by(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> list[str]:
    """The targets whose factors appear among the tensor names (in ALLOWED_TARGETS order)."""
    names = set(tensors)
    return [t for t in ALLOWED_TARGETS + list(NO_GRADIENT_TARGETS)
            if any(n in names for layer in range(cfg.num_hidden_layers) for n in _peft_names(layer, t))]


def adapter_from_peft(config: dict, tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                      dtype: torch.dtype = torch.float32, where: str = "adapter") -> LoraAdapter:
    """A PEFT adapter config and its tensors (PEFT names and layouts) -> a LoraAdapter for `cfg`;
    raises, prefixed by `where`, naming every tensor that does not fit this model.

    A `target_modules` given as a string (PEFT's "all-linear", the placeholder verl sends with a
    LoRA sync) names no module: the targets are then the ones the tensors carry."""
    if config.get("peft_type", "LORA") not in ("LORA", "lora"):
        raise ValueError(f"{where}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
    if config.get("use_dora") or config.get("bias", "none") != "none":
        raise ValueError(f"{where}: DoRA and LoRA biases are not part of zmrl's canonical LoRA")
    known = ALLOWED_TARGETS + list(NO_GRADIENT_TARGETS)  # the latter named, then refused by LoraConfig
    if isinstance(config.get("target_modules"), str):
        targets = _targets_named_by(tensors, cfg)
    else:
        modules, params = set(config.get("target_modules") or []), set(config.get("target_parameters") or [])
        targets = [t for t in known if (t in params if t in EXPERTS else _module_suffix(t) in modules)]
        unknown = (modules - {_module_suffix(t) for t in known if t not in EXPERTS}) | (params - set(EXPERTS))
        if unknown:
            raise ValueError(f"{where}: targets {sorted(unknown)} are not zmrl LoRA targets ({ALLOWED_TARGETS})")
    try:
        lcfg = LoraConfig(r=int(config["r"]), lora_alpha=float(config["lora_alpha"]), targets=list(targets))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    adapter = LoraAdapter(cfg, lcfg, dtype=dtype)
    expected, problems = set(), []
    for (layer, target), (a_shape, b_shape) in factor_shapes(cfg, lcfg).items():
        name_a, name_b = _peft_names(layer, target)
        expected |= {name_a, name_b}
        if name_a not in tensors or name_b not in tensors:
            problems.append(f"missing {name_a} / {name_b}")
            continue
        a, b = tensors[name_a], tensors[name_b]
        if len(a_shape) == 3:
            e, r, i = a_shape
            want_a, want_b = (e * r, i), (b_shape[1], r * e)
        else:
            want_a, want_b = a_shape, b_shape
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            problems.append(f"{name_a} {tuple(a.shape)} / {name_b} {tuple(b.shape)}, expected {want_a} / {want_b}")
            continue
        if len(a_shape) == 3:
            a = a.reshape(a_shape)
            b = b.reshape(b_shape[1], r, e).permute(2, 0, 1)
        pa, pb = adapter.pair(layer, target)
        with torch.no_grad():
            pa.copy_(a)
            pb.copy_(b)
    extra = sorted(set(tensors) - expected)
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}")
    if problems:
        raise ValueError(f"{where}: the adapter does not fit this model: " + "; ".join(problems[:6]))
    return adapter
