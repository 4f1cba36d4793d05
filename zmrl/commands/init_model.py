"""zmrl init-model --preset tiny|small|k31-layer --out DIR [--seed S]

Writes a fresh checkpoint made entirely on this machine: config.json, model.safetensors and
a byte-level BPE tokenizer trained locally (HF fast-tokenizer files). The config's
vocab_size is set to the trained tokenizer's size. `k31-layer` writes config.json only
(Kimi K3.1 Pro per-layer dims, for kernel benchmarks; never instantiated whole).
"""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from zmrl.model.presets import PRESETS

    p = subparsers.add_parser("init-model", help="write a fresh local checkpoint + tokenizer",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite a model already in --out")
    return p


def init_model(preset: str, out: str, seed: int = 0, force: bool = False) -> str:
    from pathlib import Path

    from zmrl.model.config import ModelConfig
    from zmrl.model.presets import CONFIG_ONLY, PRESETS
    from zmrl.model.tokenizer import train_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    fields = dict(PRESETS[preset])
    out_dir = Path(out)
    present = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if (out_dir / n).exists()]
    if present and not force:  # runs that use this model would silently continue on other weights
        raise FileExistsError(f"--out {out_dir} already holds a model ({', '.join(present)}); pass --force "
                              f"to overwrite it")
    out_dir.mkdir(parents=True, exist_ok=True)
    from zmrl.model.checkpoint import DTYPES, save_weights, write_config

    if preset in CONFIG_ONLY:
        write_config(ModelConfig(**fields), out_dir)
        return str(out_dir)
    tok = train_tokenizer(fields["vocab_size"], seed=seed)
    fields.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                  pad_token_id=tok.pad_token_id)
    cfg = ModelConfig(**fields)
    from zmrl.model.layers import init_weights

    save_weights(cfg, init_weights(cfg, seed=seed, dtype=DTYPES[cfg.torch_dtype]), out_dir)
    write_config(cfg, out_dir)
    tok.save_pretrained(str(out_dir))
    return str(out_dir)


def run(args) -> int:
    import sys

    try:
        path = init_model(args.preset, args.out, args.seed, force=args.force)
    except (FileExistsError, ValueError) as e:
        print(f"zmrl init-model: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0
