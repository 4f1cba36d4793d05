"""A fresh checkpoint from a named preset, made entirely on this machine (what `zmrl init-model`
writes, and what a recipe's model.init_preset creates).

    from zmrl.model.factory import init_model
    init_model("tiny", "runs/models/tiny", seed=0)   # config.json, model.safetensors, tokenizer files

The tokenizer is a byte-level BPE trained locally (zmrl.model.tokenizer); the config's vocab_size
is set to its size. Config-only presets (`k31-layer`, see presets.py) write config.json alone.
"""
from __future__ import annotations

from pathlib import Path

from zmrl.model.checkpoint import DTYPES, save_weights, write_config
from zmrl.model.config import ModelConfig
from zmrl.model.presets import CONFIG_ONLY, PRESETS


def init_model(preset: str, out: str, seed: int = 0, dtype: str | None = None, force: bool = False) -> str:
    """Write preset `preset` with weights seeded by `seed` into directory `out` -> `out`.

    Refuses (FileExistsError) to overwrite a model already in `out` unless `force`: runs that use
    that model would otherwise carry on silently against other weights."""
    from zmrl.model.layers import init_weights
    from zmrl.model.tokenizer import train_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    fields = dict(PRESETS[preset])
    if dtype is not None:
        fields["torch_dtype"] = dtype  # ModelConfig validates the name
    out_dir = Path(out)
    present = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if (out_dir / n).exists()]
    if present and not force:
        raise FileExistsError(f"--out {out_dir} already holds a model ({', '.join(present)}); pass --force "
                              f"to overwrite it")
    out_dir.mkdir(parents=True, exist_ok=True)
    if preset in CONFIG_ONLY:
        write_config(ModelConfig(**fields), out_dir)
        return str(out_dir)
    tok = train_tokenizer(fields["vocab_size"], seed=seed)
    fields.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                  pad_token_id=tok.pad_token_id)
    cfg = ModelConfig(**fields)
    save_weights(cfg, init_weights(cfg, seed=seed, dtype=DTYPES[cfg.torch_dtype]), out_dir)
    write_config(cfg, out_dir)
    tok.save_pretrained(str(out_dir))
    return str(out_dir)
