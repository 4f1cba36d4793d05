#!/usr/bin/env bash
# Sets up (if needed) and runs the main job. Usage: bash scripts/main.sh [args for the job]
# Until the RL loop lands this is the CPU kernel benchmark (quick shapes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec zmrl bench kernels --quick "$@"
