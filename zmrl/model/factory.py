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


MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def foreign_files(out_dir: Path) -> list[str]:
    """The names in `out_dir` when it holds files but none of a model's: a directory a model must
    not be written into (a run dir, a dataset's folder). Empty for a new, empty or model dir."""
    if not out_dir.is_dir() or any((out_dir / n).exists() for n in MODEL_FILES):
        return []
    return sorted(p.name for p in out_dir.iterdir())


def init_model(preset: str, out: str, seed: int = 0, dtype: str | None = None, force: bool = False) -> str:
    """Write preset `preset` with weights seeded by `seed` into directory `out` -> `out`.

    `out` must be new, empty, or hold a model. Refuses (FileExistsError) to overwrite a model
    already in `out` unless `force`: runs that use that model would otherwise carry on silently
    against other weights; and refuses, even with `force`, a directory that holds other files and
    no model (a run dir, a dataset's folder). The files are written in a sibling temp dir first and
    moved in when complete, so an interrupted call leaves `out` as it was."""
    import os
    import shutil

    from zmrl.model.layers import init_weights
    from zmrl.model.tokenizer import train_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    fields = dict(PRESETS[preset])
    if dtype is not None:
        fields["torch_dtype"] = dtype  # ModelConfig validates the name
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"--out {out_dir} is a file, not a directory")
    present = [n for n in MODEL_FILES if (out_dir / n).exists()]
    if present and not force:
        raise FileExistsError(f"--out {out_dir} already holds a model ({', '.join(present)}); pass --force "
                              f"to overwrite it")
    others = foreign_files(out_dir)
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise FileExistsError(f"--out {out_dir} is not empty and holds no model ({shown}); choose a new or "
                              f"empty directory")
    # this process's own temp dir beside --out (two processes never share one; one left by a killed
    # process of the same pid is stale), removed on failure
    tmp = out_dir.resolve().with_name(f".{out_dir.resolve().name}.init-model-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        if preset in CONFIG_ONLY:
            write_config(ModelConfig(**fields), tmp)
        else:
            tok = train_tokenizer(fields["vocab_size"], seed=seed)
            fields.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                          pad_token_id=tok.pad_token_id)
            cfg = ModelConfig(**fields)
            save_weights(cfg, init_weights(cfg, seed=seed, dtype=DTYPES[cfg.torch_dtype]), tmp)
            write_config(cfg, tmp)
            tok.save_pretrained(str(tmp))
        if not out_dir.exists():
            tmp.rename(out_dir)
            return str(out_dir)
        for f in sorted(tmp.iterdir()):
            os.replace(f, out_dir / f.name)
        if preset in CONFIG_ONLY:  # a forced config-only preset over a whole model: no stale weights beside it
            for name in MODEL_FILES[1:]:
                (out_dir / name).unlink(missing_ok=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return str(out_dir)
