#!/usr/bin/env bash
# Sets up (if needed) and runs the main job: the tiny CPU RL recipe end to end (vLLM rollout,
# Megatron trainer, LoRA, mismatch checked bit for bit at every step), then its report.
# Usage: bash scripts/main.sh [--set key=value ...]     (extra arguments go to `zmrl train`)
# Each call is a new run: runs/tiny_cpu the first time, runs/tiny_cpu-<time> after that
# (continue an earlier one with: zmrl train recipes/tiny_cpu.toml --resume RUN_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
run_dir=runs/tiny_cpu
[ -e "$run_dir" ] && run_dir=runs/tiny_cpu-$(date +%Y%m%d-%H%M%S)
zmrl train recipes/tiny_cpu.toml --set "run.dir=\"$run_dir\"" "$@"
zmrl report "$run_dir"
