#!/usr/bin/env bash
# Issue 56's GPU check in one command, one markdown table: a GPT of GPT-2 small's shape through
# the Trainer (tokens/s, MFU); ViT-S/16 against timm's; ALiBi, T5 and a sliding window through
# flex against flash SDPA at T = 4,096; the trainer's overhead against a plain loop. The table is
# also written to $OUT/gpu_bench.md when OUT is set. Sized to end within 8 minutes on one
# H100/H200, compiles included; run it alone on the GPU:
#   bash scripts/gpu_bench.sh [--parts abcd] [--set batch=64] [--override model.optim.compile=regional]
#   bash scripts/gpu_bench.sh --smoke         # the same code reduced, on a CPU, in seconds (CI)
# Python: $PYTHON if set, else `uv run python` where uv is installed, else python3 with src/ on
# PYTHONPATH (an image that already holds torch, Lightning, Hydra and timm).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [[ -n "${PYTHON:-}" ]]; then
  py=("$PYTHON")
elif command -v uv >/dev/null 2>&1; then
  py=(uv run python)
else
  py=(python3)
fi
if [[ "${py[0]}" != uv ]]; then
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
exec "${py[@]}" benchmarks/gpu_bench.py "$@"
