"""zmrl init-model --preset tiny|small|k31-layer --out DIR [--seed S] [--dtype float32|bfloat16]

Writes a fresh checkpoint made entirely on this machine: config.json, model.safetensors and
a byte-level BPE tokenizer trained locally (HF fast-tokenizer files). The config's
vocab_size is set to the trained tokenizer's size. `k31-layer` writes config.json only
(Kimi K3.1 Pro per-layer dims, for kernel benchmarks; never instantiated whole).
--dtype (default: the preset's, float32 for tiny and small) is the dtype the weights are stored in,
stated as "dtype" in config.json; every host then runs the model in it.
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
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="weight dtype (default: the preset's)")
    return p


def init_model(preset: str, out: str, seed: int = 0, dtype: str | None = None) -> str:
    from pathlib import Path

    from zmrl.model.config import ModelConfig
    from zmrl.model.presets import CONFIG_ONLY, PRESETS
    from zmrl.model.tokenizer import train_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    fields = dict(PRESETS[preset])
    if dtype is not None:
        fields["torch_dtype"] = dtype  # ModelConfig validates the name
    out_dir = Path(out)
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
    path = init_model(args.preset, args.out, args.seed, args.dtype)
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0
