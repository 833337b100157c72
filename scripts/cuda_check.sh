#!/usr/bin/env bash
# Every CUDA check in one command, for whenever a GPU machine is at hand (nothing else needs one):
# the model, layer, engine, overlap and tier tests on the GPU, then the decode/prefill benchmark.
#   bash scripts/cuda_check.sh            # extra pytest arguments are passed on, e.g. -x
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("cuda_check: torch sees no CUDA device (a CPU-only torch build?)")
print("cuda_check:", torch.cuda.get_device_name(0), "| torch", torch.__version__)
PY
DEEPINFER_TEST_DEVICE=cuda python -m pytest -q tests/layers tests/models tests/test_engine.py tests/test_overlap.py \
    tests/kv/tiers/test_engine_*.py tests/kv/tiers/test_l3_processes.py tests/kv/tiers/test_cache_cli.py "$@"
python benchmarks/decode.py --device cuda --batches 1 8 32 --context 2048 --prefill 512 2048 8192 \
    --out results/cuda/decode
