"""Checkpoint I/O in HF layout: config.json (model_type "zmrl"), model.safetensors, tokenizer.

Every host reads a checkpoint through here (`load_checkpoint`, or `check_checkpoint` where the
host loads the tensors itself: vLLM, transformers), so one set of rules decides what a model dir
may hold: config fields that agree (config.py; `dtype` and `torch_dtype` included), a tokenizer
of exactly vocab_size tokens, and every tensor present, of its config shape and of the config's
dtype. A bf16 checkpoint states `"dtype": "bfloat16"` and stores bf16 tensors; hosts never cast
it to another dtype, so they all run the same bits.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zmrl.model.config import ConfigError, ModelConfig
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
    """The model dir's config.json (its `dtype` and `torch_dtype`, when both are set, must agree)."""
    file = Path(path) / "config.json"
    d = json.loads(file.read_text())
    d.pop("model_type", None)
    d.pop("architectures", None)
    return ModelConfig.from_dict(d, source=str(file))


def save_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], out: str | Path) -> Path:
    check_weights(cfg, weights, "weights to save")
    check_weight_dtypes(cfg, {k: str(v.dtype).removeprefix("torch.") for k, v in weights.items()},
                        "weights to save")
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


def check_weight_dtypes(cfg: ModelConfig, dtypes: dict[str, str], where: str) -> None:
    """Every tensor (name -> dtype name, "bfloat16") must be stored in the config's dtype: a host
    that casts on load (vLLM does, to the config's dtype) and one that does not (the reference
    engine) would otherwise run different weights."""
    wrong = sorted(k for k, v in dtypes.items() if v != cfg.torch_dtype)
    if wrong:
        found = sorted({dtypes[k] for k in wrong})
        raise ValueError(f"{where} stores {len(wrong)} tensors as {'/'.join(found)} (e.g. {wrong[0]}) but "
                         f"config.json says dtype {cfg.torch_dtype!r}; convert the weights or fix the config")


# safetensors' dtype codes for the dtypes a checkpoint may hold; anything else is reported by its code
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def read_weight_header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) from a .safetensors header alone (no tensor is read); a
    ValueError when the header is not one, or when the file is shorter than the header says
    (a cut copy)."""
    size_on_disk = file.stat().st_size
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
        if size > size_on_disk - 8:
            raise ValueError(f"header length {size} exceeds the file ({size_on_disk} bytes)")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + size + end > size_on_disk:
        raise ValueError(f"the tensors end at byte {8 + size + end} but the file has {size_on_disk}: it was cut")
    return {k: (tuple(v["shape"]), _SAFETENSORS_DTYPES.get(v["dtype"], v["dtype"])) for k, v in header.items()}


def load_checkpoint(path: str | Path, device: str = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """-> (config, weights); raises naming every missing, extra, mis-shaped or mis-typed tensor,
    and a tokenizer (if present) whose size differs from vocab_size."""
    path = Path(path)
    cfg = read_config(path)
    check_tokenizer(path, cfg)
    weights = load_file(str(path / "model.safetensors"), device=device)
    check_weights(cfg, weights, f"checkpoint {path}")
    check_weight_dtypes(cfg, {k: str(v.dtype).removeprefix("torch.") for k, v in weights.items()},
                        f"checkpoint {path}")
    return cfg, weights


def check_model_dir(path: str | Path) -> ModelConfig:
    """config.json, tokenizer (if any) and model.safetensors agree (names, shapes and dtypes) -> the
    ModelConfig; else a ValueError/FileNotFoundError naming the file and what is wrong. Reads the
    safetensors header only, so a large checkpoint is not loaded for the check (hosts that load the
    tensors themselves call this first)."""
    path = Path(path)
    config_file, weights_file = path / "config.json", path / "model.safetensors"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json (create one with `zmrl init-model`)")
    if not weights_file.is_file():
        raise FileNotFoundError(f"{path} has no model.safetensors")
    try:
        cfg = read_config(path)
    except ConfigError:
        raise  # names the file already (missing fields, disagreeing dtype fields)
    except (ValueError, TypeError, UnicodeDecodeError) as e:  # JSON syntax, a mistyped field
        raise ValueError(f"{config_file} is not a valid model config: {e}") from None
    check_tokenizer(path, cfg)
    try:
        header = read_weight_header(weights_file)
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{weights_file} is not a readable safetensors file ({e})") from None
    check_weights(cfg, {k: torch.empty(shape, device="meta") for k, (shape, _) in header.items()},
                  f"checkpoint {path}")
    check_weight_dtypes(cfg, {k: dtype for k, (_, dtype) in header.items()}, f"checkpoint {path}")
    return cfg
