#!/usr/bin/env bash
# The GPU paths CI never runs (tests/test_gpu.py): every experiment's fast configuration under
# trainer=gpu in bf16-mixed and 16-mixed, each architecture compiled, FSDP. One line per case.
# Run it on a machine with a CUDA GPU, alone: bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# --dist load: the cases of this one file spread over the workers (the default keeps a file on one)
uv run pytest -p no:cacheprovider -m gpu -v --durations=0 --dist load tests/test_gpu.py "$@"
