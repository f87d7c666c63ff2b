#!/usr/bin/env bash
# Launch training with torchrun: on one machine, or on each machine of a multi-node run.
# Run it from the project root (CONFIG and the run directory are relative paths).
#
# Usage:
#   launch/torchrun.sh [--dry-run] [section.key=value ...]
#
# Arguments are config overrides for the training entry point, e.g.
#   launch/torchrun.sh train.max_steps=1000 run.dir=runs/exp1
#
# Settings, from the environment (default in brackets):
#   NNODES          number of machines [1]. With 1, torchrun runs --standalone (a local
#                   rendezvous on a free port, so several single-node runs can share a machine).
#   NPROC_PER_NODE  processes on this machine [one per GPU that `nvidia-smi -L` lists, limited
#                   to CUDA_VISIBLE_DEVICES when set; 2 without GPUs, which then train on CPU
#                   with gloo]
#   RDZV_ENDPOINT   HOST:PORT where the machines meet, required when NNODES > 1: the same value
#                   on every machine, a host all of them can reach and a port free on it
#   RDZV_ID         an id shared by all machines of one run and unique per run [local]
#   LOCAL_ADDR      the address the other machines reach this one at [looked up from the host
#                   name]; set it when the host name resolves to an address they cannot reach.
#                   The machine whose LOCAL_ADDR is the host of RDZV_ENDPOINT hosts the
#                   rendezvous (otherwise torchrun decides that from the host name)
#   MAX_RESTARTS    how often torchrun restarts all workers after a failure [0]; restarted
#                   workers resume from the newest checkpoint in run.dir
#   CONFIG          the YAML config [configs/default.yaml]
#   DRY_RUN=1       print the torchrun command (one line, shell-quoted) instead of running it;
#                   the same as --dry-run as the first argument
#
# To stop a run cleanly with a checkpoint, send USR1 to all its processes, e.g.
#   pkill -USR1 -f {{ cookiecutter.package_name }}.train
#
# Two machines, 8 GPUs each: on both, with the same run directory on a shared file system,
#   NNODES=2 RDZV_ENDPOINT=node01:29500 RDZV_ID=exp1 launch/torchrun.sh run.dir=/shared/runs/exp1
# On Slurm clusters use launch/slurm/train.sbatch instead, which sets all of this per job.
set -euo pipefail

if [[ "${1:-}" == "--dry-run" ]]; then
    DRY_RUN=1
    shift
fi

die() {
    echo "error: $*" >&2
    exit 2
}

# GPUs this process may use: those nvidia-smi lists, or the CUDA_VISIBLE_DEVICES subset; 0 when
# there is no NVIDIA driver.
gpu_count() {
    local listed=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        listed="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
    fi
    if [[ "${listed:-0}" -gt 0 && -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        listed="$(awk -F, '{ print NF }' <<<"$CUDA_VISIBLE_DEVICES")"
    fi
    echo "${listed:-0}"
}

NNODES="${NNODES:-1}"
RDZV_ID="${RDZV_ID:-local}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
CONFIG="${CONFIG:-configs/default.yaml}"
DRY_RUN="${DRY_RUN:-0}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    gpus="$(gpu_count)"
    if [[ "$gpus" -gt 0 ]]; then
        NPROC_PER_NODE="$gpus"
    else
        NPROC_PER_NODE=2
    fi
fi

# NNODES may also be an elastic range MIN:MAX (e.g. 2:4) for multi-node runs.
[[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || die "NNODES must be a positive number or MIN:MAX, got '$NNODES'"
[[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be a positive number, got '$NPROC_PER_NODE'"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be a number >= 0, got '$MAX_RESTARTS'"

command=(torchrun)
if [[ "$NNODES" == 1 ]]; then
    command+=(--standalone --nnodes=1)
else
    if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
        die "NNODES=$NNODES needs RDZV_ENDPOINT=HOST:PORT, the same on every node and reachable from all of them (e.g. RDZV_ENDPOINT=node01:29500)"
    fi
    [[ "$RDZV_ENDPOINT" == *:* ]] || die "RDZV_ENDPOINT must be HOST:PORT, got '$RDZV_ENDPOINT'"
    command+=(
        --nnodes="$NNODES"
        --rdzv-backend=c10d
        --rdzv-endpoint="$RDZV_ENDPOINT"
        --rdzv-id="$RDZV_ID"
    )
    if [[ -n "${LOCAL_ADDR:-}" ]]; then
        command+=(--local-addr="$LOCAL_ADDR")
        if [[ "$LOCAL_ADDR" == "${RDZV_ENDPOINT%:*}" ]]; then
            command+=(--rdzv-conf=is_host=true)
        fi
    fi
fi
command+=(
    --nproc-per-node="$NPROC_PER_NODE"
    --max-restarts="$MAX_RESTARTS"
    -m {{ cookiecutter.package_name }}.train --config "$CONFIG" "$@"
)

if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q' "${command[0]}"
    printf ' %q' "${command[@]:1}"
    printf '\n'
    exit 0
fi
# torchrun and its workers start with USR1 ignored (an ignored signal stays ignored across exec
# and in child processes): torchrun would die of it, and the training sets its own handler
# (checkpoint.stop_on_sigusr1) once it is ready.
trap '' USR1
exec "${command[@]}"
