"""Generation throughput of the zmrl model served by vLLM, batch invariance on vs off, one run.

    zmrl bench vllm [--presets tiny,small] [--num-requests 8] [--prompt-len 64] [--max-tokens 64]
                    [--repeats 2] [--threads N] [--out FILE.md]

For each preset it writes a fresh checkpoint (zmrl.model.factory, what `zmrl init-model` runs),
starts one in-process vLLM engine, and times `engine.generate` over the same prompts with
invariance on and off, alternating on/off/on/off so that a change in machine load hits both
modes alike. Throughput
is generated tokens / wall time of the whole call (prefill included; EOS ignored so every
request makes exactly --max-tokens tokens); the table gives the median over --repeats.
Prefix caching is off, so a repeat recomputes its prompts instead of hitting the cache.
Each preset runs in its own subprocess: vLLM's distributed state is per process.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time


def _measure(preset: str, num_requests: int, prompt_len: int, max_tokens: int, repeats: int,
             threads: int) -> dict:
    """Runs in the preset's subprocess -> {"on": [tok/s...], "off": [...], ...}."""
    import torch

    from zmrl.model.factory import init_model
    from zmrl.model.checkpoint import read_config
    from zmrl.rollout.vllm import VllmEngine

    model_dir = init_model(preset, tempfile.mkdtemp(prefix=f"zmrl-bench-{preset}-"), seed=0)
    cfg = read_config(model_dir)
    engine = VllmEngine(model_dir, max_model_len=prompt_len + max_tokens + 16, max_num_seqs=num_requests,
                        max_num_batched_tokens=max(256, num_requests * prompt_len // 2),
                        kv_cache_gib=0.5, num_threads=threads, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    # ids >= 2 skip eos/pad; every request is distinct
    prompts = [torch.randint(2, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(num_requests)]
    rates: dict[str, list[float]] = {"on": [], "off": []}
    engine.set_batch_invariant(True)
    engine.generate(prompts[:2], max_tokens=4, stop_at_eos=False, seed=0)  # warm-up (allocations, caches)
    for rep in range(repeats):
        for mode in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            engine.set_batch_invariant(mode == "on")
            t0 = time.perf_counter()
            out = engine.generate(prompts, n=1, max_tokens=max_tokens, temperature=1.0, seed=rep, stop_at_eos=False)
            elapsed = time.perf_counter() - t0
            rates[mode].append(sum(len(s[0].token_ids) for s in out) / elapsed)
    engine.set_batch_invariant(True)
    engine.shutdown()
    return {"preset": preset, **rates, "load": os.getloadavg()[0]}


def check_args(args: argparse.Namespace) -> None:
    from zmrl.bench import BenchInputError, check_out_file
    from zmrl.model.presets import CONFIG_ONLY, PRESETS

    for flag, value in (("--num-requests", args.num_requests), ("--prompt-len", args.prompt_len),
                        ("--max-tokens", args.max_tokens), ("--repeats", args.repeats),
                        ("--threads", 1 if args.threads is None else args.threads)):
        if value < 1:
            raise BenchInputError(f"{flag} must be >= 1, got {value}")
    runnable = sorted(set(PRESETS) - set(CONFIG_ONLY))
    for preset in args.presets.split(","):
        if preset not in runnable:
            raise BenchInputError(f"--presets: {preset!r} is not a preset vLLM can serve here; choose from "
                                  f"{', '.join(runnable)}")
    check_out_file(args.out)


def run(args: argparse.Namespace) -> None:
    check_args(args)
    threads = args.threads or os.cpu_count() or 1
    header = (f"{datetime.date.today()} | {_cpu_name()} | {threads} torch threads | "
              f"torch {_version('torch')} | vllm {_version('vllm')} | load average (1 min) at start "
              f"{os.getloadavg()[0]:.2f} | {args.num_requests} requests x {args.prompt_len} prompt tokens "
              f"-> {args.max_tokens} generated tokens each, median of {args.repeats}")
    rows = ["| preset | invariance on (tok/s) | invariance off (tok/s) | on / off | load at end |",
            "|---|---|---|---|---|"]
    for preset in args.presets.split(","):
        job = json.dumps(dict(preset=preset, num_requests=args.num_requests, prompt_len=args.prompt_len,
                              max_tokens=args.max_tokens, repeats=args.repeats, threads=threads))
        proc = subprocess.run([sys.executable, "-m", "zmrl.bench.vllm_throughput", job],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark of {preset} failed:\n{proc.stderr[-4000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        on, off = statistics.median(result["on"]), statistics.median(result["off"])
        rows.append(f"| {preset} | {on:.1f} | {off:.1f} | {on / off:.2f} | {result['load']:.2f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    table = "\n".join([header, "", *rows])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in (name, f"{name}-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "?"


if __name__ == "__main__":  # one preset, in its own process (see run); prints one JSON line
    print(json.dumps(_measure(**json.loads(sys.argv[1]))))
