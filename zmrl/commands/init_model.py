"""zmrl init-model --preset tiny|small|k31-layer --out DIR [--seed S] [--dtype float32|bfloat16]

Writes a fresh checkpoint made entirely on this machine: config.json, model.safetensors and
a byte-level BPE tokenizer trained locally (HF fast-tokenizer files). The config's
vocab_size is set to the trained tokenizer's size. `k31-layer` writes config.json only
(Kimi K3.1 Pro per-layer dims, for kernel benchmarks; never instantiated whole).
--dtype (default: the preset's, float32 for tiny and small) is the dtype the weights are stored in,
stated as "dtype" in config.json; every host then runs the model in it.
--out must be new, empty, or hold a model (replaced only with --force); the files are written
beside it first and moved in when complete, so an interrupted call leaves --out as it was.
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
    p.add_argument("--force", action="store_true", help="overwrite a model already in --out")
    return p


def run(args) -> int:
    import sys

    from zmrl.model.factory import init_model  # the logic lives in the model layer

    try:
        path = init_model(args.preset, args.out, args.seed, dtype=args.dtype, force=args.force)
    except (FileExistsError, ValueError) as e:
        print(f"zmrl init-model: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0
