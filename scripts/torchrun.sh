#!/usr/bin/env bash
# attnlab-train on one node of a multi-node run, started by torchrun; run it on every node.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=<node 0> scripts/torchrun.sh experiment=... trainer=ddp
# GPUS_PER_NODE defaults to every visible GPU. Lightning sees torchrun's variables and starts no
# processes of its own; trainer.num_nodes and trainer.devices are set to match.
set -euo pipefail
cd "$(dirname "$0")/.."
nnodes=${NNODES:-1}
gpus=${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}
exec uv run torchrun --nnodes="$nnodes" --nproc-per-node="$gpus" --node-rank="${NODE_RANK:-0}" \
  --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29500}" \
  -m attnlab.cli.train trainer.num_nodes="$nnodes" trainer.devices="$gpus" "$@"
