#!/usr/bin/env bash
# Launch training with torchrun on one node or several.
#
# Variables (set them in the environment to override the defaults):
#   NNODES          number of nodes (default 1)
#   NPROC_PER_NODE  processes per node (default: one per GPU, or 2 without GPUs)
#   RDZV_ENDPOINT   host:port where the nodes meet; required when NNODES > 1
#   RDZV_ID         a job id shared by all nodes of one run (default: local)
#   MAX_RESTARTS    how often torchrun restarts the workers after a failure (default 0)
#   CONFIG          YAML config file (default: configs/default.yaml)
#   DRY_RUN=1       print the command instead of running it
# Arguments are passed on as config overrides, e.g. train.max_steps=1000 run.dir=runs/exp1.
#
# One node:  launch/torchrun.sh
# Two nodes: on each, NNODES=2 RDZV_ENDPOINT=node0:29500 RDZV_ID=exp1 launch/torchrun.sh
set -euo pipefail

if [[ "${1:-}" == "--dry-run" ]]; then
    DRY_RUN=1
    shift
fi

gpu_count() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --list-gpus 2>/dev/null | wc -l
    else
        echo 0
    fi
}

NNODES="${NNODES:-1}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    gpus="$(gpu_count)"
    NPROC_PER_NODE=$((gpus > 0 ? gpus : 2))
fi
RDZV_ID="${RDZV_ID:-local}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
CONFIG="${CONFIG:-configs/default.yaml}"

command=(torchrun --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS")
if [[ "$NNODES" == 1 ]]; then
    command+=(--standalone)
else
    if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
        echo "error: NNODES=$NNODES needs RDZV_ENDPOINT=host:port, reachable from every node" >&2
        exit 2
    fi
    command+=(
        --nnodes="$NNODES"
        --rdzv-backend=c10d
        --rdzv-endpoint="$RDZV_ENDPOINT"
        --rdzv-id="$RDZV_ID"
    )
fi
command+=(-m {{ cookiecutter.package_name }}.train --config "$CONFIG" "$@")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${command[@]}"
    printf '\n'
    exit 0
fi
exec "${command[@]}"
