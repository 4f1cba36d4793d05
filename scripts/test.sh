#!/usr/bin/env bash
# Sets up (if needed) and runs the test suite. Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest "$@"
