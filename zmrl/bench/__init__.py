"""The benchmarks behind `zmrl bench`: the CPU kernels against torch's defaults (cpu_kernels),
vLLM generation with invariance on and off (vllm_throughput), the trainer against transformers +
PEFT (train_throughput, with train_flops); collectives.py times the canonical reductions. Each run
checks its arguments before it builds or times anything."""
from __future__ import annotations


class BenchInputError(ValueError):
    """A bad benchmark argument, found before anything is built or timed (`zmrl bench` prints it
    in one line and exits 2)."""


def check_out_file(out: str | None) -> None:
    """--out names a file this process can create or replace (checked before a run of minutes)."""
    import os
    from pathlib import Path

    if out is None:
        return
    path = Path(out)
    parent = path.parent  # "." for a bare file name
    if path.is_dir():
        raise BenchInputError(f"--out {out} is a directory")
    if not parent.is_dir():
        raise BenchInputError(f"--out {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise BenchInputError(f"--out {out} is not writable")
