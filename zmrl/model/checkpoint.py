"""Checkpoint I/O in HF layout: config.json (model_type "zmrl"), model.safetensors, tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zmrl.model.config import ModelConfig
from zmrl.model.layers import check_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_config(cfg: ModelConfig, out: str | Path) -> Path:
    """config.json readable by AutoConfig (after zmrl.model.hf.register()) and by vLLM."""
    d = cfg.to_dict()
    d.update(model_type="zmrl", architectures=["ZmrlForCausalLM"], dtype=d.pop("torch_dtype"))
    path = Path(out) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    return path


def read_config(path: str | Path) -> ModelConfig:
    d = json.loads((Path(path) / "config.json").read_text())
    d.pop("model_type", None)
    d.pop("architectures", None)
    if "dtype" in d:
        d["torch_dtype"] = str(d.pop("dtype")).replace("torch.", "")
    return ModelConfig.from_dict(d)


def save_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], out: str | Path) -> Path:
    check_weights(cfg, weights, "weights to save")
    path = Path(out) / "model.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata={"format": "pt"})
    return path


def check_tokenizer(path: Path, cfg: ModelConfig) -> None:
    """A model dir's tokenizer.json, if it has one, must have exactly cfg.vocab_size tokens."""
    tok_file = path / "tokenizer.json"
    if tok_file.is_file():
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(str(tok_file)).get_vocab_size()
        if size != cfg.vocab_size:
            raise ValueError(f"tokenizer {tok_file} has {size} tokens but config vocab_size is {cfg.vocab_size}")


def load_checkpoint(path: str | Path, device: str = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """-> (config, weights); raises naming every missing, extra or mis-shaped tensor, and a
    tokenizer (if present) whose size differs from vocab_size."""
    path = Path(path)
    cfg = read_config(path)
    check_tokenizer(path, cfg)
    weights = load_file(str(path / "model.safetensors"), device=device)
    check_weights(cfg, weights, f"checkpoint {path}")
    return cfg, weights


def check_model_dir(path: str | Path) -> ModelConfig:
    """config.json, tokenizer (if any) and model.safetensors agree -> the ModelConfig; else a
    ValueError/FileNotFoundError naming the file and what is wrong. Reads tensor shapes from the
    safetensors header only, so a large checkpoint is not loaded for the check."""
    from safetensors import safe_open

    path = Path(path)
    config_file, weights_file = path / "config.json", path / "model.safetensors"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json (create one with `zmrl init-model`)")
    if not weights_file.is_file():
        raise FileNotFoundError(f"{path} has no model.safetensors")
    try:
        cfg = read_config(path)
    except (ValueError, TypeError, UnicodeDecodeError) as e:  # JSON syntax, a missing or mistyped field
        raise ValueError(f"{config_file} is not a valid model config: {e}") from None
    check_tokenizer(path, cfg)
    try:
        with safe_open(str(weights_file), "pt") as f:
            shapes = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError for a cut or foreign file
        raise ValueError(f"{weights_file} is not a readable safetensors file ({e})") from None
    check_weights(cfg, shapes, f"checkpoint {path}")
    return cfg
