#!/usr/bin/env bash
# Launch training with torchrun: on one machine, or on each machine of a multi-node run.
# Run it from the project root (CONFIG and the run directory are relative paths).
#
# Usage:
#   launch/torchrun.sh [--dry-run] [--doctor] [section.key=value ...]
#
# Arguments are config overrides for the training entry point, e.g.
#   launch/torchrun.sh train.max_steps=1000 run.dir=runs/exp1
# --doctor runs the preflight check (python -m {{ cookiecutter.package_name }}.doctor) instead of
# training, launched exactly as training is, with the same settings and overrides.
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
#                   The machine whose address is the host of RDZV_ENDPOINT hosts the rendezvous
#   JOIN_TIMEOUT    seconds the machines wait for each other at the start, and torchrun's join
#                   timeout for a restart [300]. Every 10 s each machine says who has joined;
#                   a machine given another NNODES or RDZV_ID stops them all at once
#   MAX_RESTARTS    how often torchrun restarts all workers after a failure [0]; restarted
#                   workers resume from the newest checkpoint in run.dir
#   SHUTDOWN_TIMEOUT  seconds torchrun gives its workers to stop after a signal before it kills
#                   them [120]. A stop takes about 2 x checkpoint.stop_check_s, a step and one
#                   checkpoint write ("saved checkpoint ... in N s" in the log): keep it above
#                   twice that. A rank that has not stopped 5 s before it writes its Python
#                   stacks to <run.dir>/stacks/ and exits.
#   EXIT_TIMEOUT    seconds torchrun may take to exit once its workers have ended [30]; past it,
#                   torchrun (waiting for a rendezvous store on a node that is gone) is ended
#   CONFIG          the YAML config [configs/default.yaml]
#   PYTHON          the Python that runs torchrun and the training [python3]
#   DRY_RUN=1       print the command (one line, shell-quoted) instead of running it; the same
#                   as --dry-run as the first argument
#
# Before torchrun starts, python -m {{ cookiecutter.package_name }}.launch checks the addresses and
# interfaces (RDZV_ENDPOINT resolves, and not to a loopback address; LOCAL_ADDR or the host
# name is this machine's and not loopback; GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME exist),
# and the machines meet; each failure says what to set. See the launching guide for the ports
# that must be open between machines.
#
# Stopping: SIGTERM to this script (kill PID, docker stop, Kubernetes) is passed on to torchrun,
# which passes it on to the training processes: every rank finishes the same step, saves a
# checkpoint and exits with 75, and so does this script. Ctrl-C does the same (torchrun gets
# it from the terminal). To stop without that status, send USR1 or USR2 to this script, which
# passes it on the same way and exits 0:
#   kill -USR1 PID    or    pkill -USR1 -f launch/torchrun.sh
# Send a signal to this script, to torchrun or to the training processes (pkill -f
# {{ cookiecutter.package_name }}.train): each reaches the training, which stops the same way. A
# worker that exits 75 on its own (SIGTERM to it alone) is restarted by torchrun when
# MAX_RESTARTS allows, and resumes from that checkpoint.
#
# Exit status, on every machine: the training's, not torchrun's (which is 1 whenever a worker
# did not exit 0): 0 finished, or stopped on USR1/USR2; 75 stopped with a checkpoint at the
# current step (SIGTERM or Ctrl-C, here or on another machine): launch the same command again
# to resume; 2 a bad setting, on any machine; 3 the training diverged; 4 another job holds the
# run directory; 1 the machines did not all join, or another failure. Unless it is 0, the last
# line says it after the training's own message; torchrun's own output (its report of a
# failure) is kept in <run.dir>/torchrun_<host>.log.
#
# Two machines, 8 GPUs each: on both, with the same run directory on a shared file system,
#   NNODES=2 RDZV_ENDPOINT=node01:29500 RDZV_ID=exp1 launch/torchrun.sh run.dir=/shared/runs/exp1
# On Slurm clusters use launch/slurm/train.sbatch instead, which sets all of this per job.
set -euo pipefail

entry={{ cookiecutter.package_name }}.train
while [[ "${1:-}" == --dry-run || "${1:-}" == --doctor ]]; do
    if [[ "$1" == --dry-run ]]; then
        DRY_RUN=1
    else
        entry={{ cookiecutter.package_name }}.doctor
    fi
    shift
done

die() {
    echo "error: $*" >&2
    exit 2
}

# GPUs this process may use: those nvidia-smi lists, or the CUDA_VISIBLE_DEVICES subset; 0 when
# there is no NVIDIA driver, or when CUDA_VISIBLE_DEVICES is set and empty (CUDA then sees none).
gpu_count() {
    local listed=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        listed="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
    fi
    # Compared as text, not with -gt: [[ -gt ]] evaluates its operands as arithmetic.
    if [[ "$listed" =~ ^[1-9][0-9]*$ && -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        listed="$(awk -F, '{ print NF }' <<<"$CUDA_VISIBLE_DEVICES")"
    fi
    echo "${listed:-0}"
}

NNODES="${NNODES:-1}"
RDZV_ID="${RDZV_ID:-local}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-120}"
JOIN_TIMEOUT="${JOIN_TIMEOUT:-300}"
EXIT_TIMEOUT="${EXIT_TIMEOUT:-30}"
CONFIG="${CONFIG:-configs/default.yaml}"
PYTHON="${PYTHON:-python3}"
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
[[ "$JOIN_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "JOIN_TIMEOUT must be a positive number of seconds, got '$JOIN_TIMEOUT'"
[[ "$EXIT_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "EXIT_TIMEOUT must be a positive number of seconds, got '$EXIT_TIMEOUT'"

# python -m {{ cookiecutter.package_name }}.launch checks the settings, lets the machines meet, runs
# torchrun with these options, and exits with the training's status.
command=("$PYTHON" -m {{ cookiecutter.package_name }}.launch)
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
        --rdzv-conf=join_timeout="$JOIN_TIMEOUT"
    )
    if [[ -n "${LOCAL_ADDR:-}" ]]; then
        command+=(--local-addr="$LOCAL_ADDR")
    fi
fi
command+=(
    --nproc-per-node="$NPROC_PER_NODE"
    --max-restarts="$MAX_RESTARTS"
    --shutdown-timeout="$SHUTDOWN_TIMEOUT"
    "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
    -m "$entry" --config "$CONFIG" "$@"
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
export JOIN_TIMEOUT EXIT_TIMEOUT
# The launcher takes this script's place (and pid): a signal sent to the script reaches it.
exec "${command[@]}"
