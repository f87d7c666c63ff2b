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
#   SHUTDOWN_TIMEOUT  seconds torchrun gives its workers to stop after a signal before it kills
#                   them [120]. A stop takes about 2 x checkpoint.stop_check_s, a step and one
#                   checkpoint write ("saved checkpoint ... in N s" in the log): keep it above
#                   twice that. A rank that has not stopped 5 s before it writes its Python
#                   stacks to <run.dir>/stacks/ and exits.
#   CONFIG          the YAML config [configs/default.yaml]
#   DRY_RUN=1       print the torchrun command (one line, shell-quoted) instead of running it;
#                   the same as --dry-run as the first argument
#
# Stopping: SIGTERM to this script (kill PID, docker stop, Kubernetes) is passed on to torchrun,
# which passes it on to the training processes: every rank finishes the same step, saves a
# checkpoint and exits with 75; torchrun then exits 1 whatever its workers did, and this script
# exits 75. Ctrl-C does the same (torchrun gets it from the terminal). To stop without that
# status, send USR1 or USR2 to this script, which passes it on the same way and exits 0:
#   kill -USR1 PID    or    pkill -USR1 -f launch/torchrun.sh
# Send a signal to this script or to torchrun, not to both: torchrun, signalled twice, turns
# the second into SIGTERM. Signalled alone, torchrun passes the signal on all the same, but this
# script, not told, reports torchrun's 1. A signal to the training processes alone (pkill -f
# {{ cookiecutter.package_name }}.train) stops them too; torchrun is then not signalled and
# reports what they did. A worker that exits 75 on its own (SIGTERM to it alone) is restarted
# by torchrun when MAX_RESTARTS allows, and resumes from that checkpoint.
#
# Exit status: 0 finished, or stopped on USR1/USR2; 75 stopped on SIGTERM or Ctrl-C with a
# checkpoint at the current step: launch the same command again to resume; 2 a bad setting;
# other failed.
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
    # Compared as text, not with -gt: [[ -gt ]] evaluates its operands as arithmetic.
    if [[ "$listed" =~ ^[1-9][0-9]*$ && -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        listed="$(awk -F, '{ print NF }' <<<"$CUDA_VISIBLE_DEVICES")"
    fi
    echo "${listed:-0}"
}

NNODES="${NNODES:-1}"
RDZV_ID="${RDZV_ID:-local}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-120}"
CONFIG="${CONFIG:-configs/default.yaml}"
DRY_RUN="${DRY_RUN:-0}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    gpus="$(gpu_count)"
    if [[ "$gpus" =~ ^[1-9][0-9]*$ ]]; then
        NPROC_PER_NODE="$gpus"
    else
        NPROC_PER_NODE=2
    fi
fi

# NNODES may also be an elastic range MIN:MAX (e.g. 2:4) for multi-node runs.
[[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || die "NNODES must be a positive number or MIN:MAX, got '$NNODES'"
[[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be a positive number, got '$NPROC_PER_NODE'"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be a number >= 0, got '$MAX_RESTARTS'"
[[ "$SHUTDOWN_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "SHUTDOWN_TIMEOUT must be a positive number of seconds, got '$SHUTDOWN_TIMEOUT'"

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
    --shutdown-timeout="$SHUTDOWN_TIMEOUT"
    "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
    -m {{ cookiecutter.package_name }}.train --config "$CONFIG" "$@"
)

if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q' "${command[0]}"
    printf ' %q' "${command[@]:1}"
    printf '\n'
    exit 0
fi
# A fresh rendezvous store for every torchrun restart (--max-restarts): in the shared one, a
# restarted rank could find the failed attempt's addresses and wait for ranks that are gone.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# The training processes read it too: a rank that has not stopped by then writes its stacks.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$SHUTDOWN_TIMEOUT"
# SIGTERM, USR1 and USR2 are passed on to torchrun, which passes them on to the training
# processes; SIGINT (Ctrl-C) reaches it from the terminal by itself. This script waits for it to
# finish either way, and remembers the signal for its exit status.
torchrun_pid=""
stopped_by=""
# shellcheck disable=SC2329  # called by the traps
pass_on() {
    if [[ "$stopped_by" != TERM ]]; then
        stopped_by="$1"
    fi
    if [[ "$1" != INT && -n "$torchrun_pid" ]]; then
        kill -"$1" "$torchrun_pid" 2>/dev/null || true
    fi
}
for signal in TERM USR1 USR2; do
    # shellcheck disable=SC2064  # the signal's name now
    trap "pass_on $signal" "$signal"
done
trap 'pass_on INT' INT
# torchrun runs in the background so that this script takes signals at once, with SIGINT and
# SIGQUIT at their defaults (bash ignores them in background commands), and USR1 and USR2
# ignored until torchrun sets its own handlers (an ignored signal stays ignored across exec).
(
    trap - INT QUIT
    trap '' USR1 USR2
    exec "${command[@]}"
) &
torchrun_pid=$!
# A signal ends `wait` early: keep waiting until torchrun has really ended.
status=0
while wait "$torchrun_pid" || status=$?; kill -0 "$torchrun_pid" 2>/dev/null; do
    status=0
done
# torchrun exits 1 after a signal, whatever its workers did: report the training's status.
if ((status == 1)); then
    case "$stopped_by" in
    TERM | INT) exit 75 ;;
    USR1 | USR2) exit 0 ;;
    esac
fi
exit "$status"
