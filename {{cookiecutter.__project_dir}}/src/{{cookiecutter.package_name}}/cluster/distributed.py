"""Process-group lifecycle: who am I, which device, how to start, how to stop.

One code path serves every launcher. torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; a Slurm step with
one task per GPU sets SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS; mpirun and mpiexec set their own
(OMPI_COMM_WORLD_*, PMI_*); a plain `python -m` run has none and trains as a single process
without a process group.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import re
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ..config import ConfigError, DistConfig
from ..faults.flight_recorder import record_collectives
from .debug_output import turn_on

#: Set by process_group(); None for a single process, and in tests that start their own group.
_control_group: dist.ProcessGroup | None = None
#: The same ranks with the short timeout, for collectives between steps (see step_group()).
_step_group: dist.ProcessGroup | None = None
#: The store the ranks met in, in this attempt's namespace (set by process_group()): what the
#: ranks tell each other where no collective can run (watchdog.py names missing ranks in it).
_store: dist.Store | None = None
# Newer torch renamed the forward-time buffer sync; passing the old name warns there.
_BUFFER_SYNC_ARGUMENT = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else "broadcast_buffers"
)


class DistributedError(RuntimeError):
    """The launch environment cannot start a process group as configured."""


class LaunchIncompleteError(RuntimeError):
    """Some ranks never reached the rendezvous (or rank 0 never answered) within the start-up
    timeout: they failed to start, or cannot reach it."""


class ReplicaMismatchError(RuntimeError):
    """The model replicas on different ranks no longer hold the same parameters."""


class GradientsNotReducedError(ReplicaMismatchError):
    """DDP did not all-reduce a step's gradients: the task's code must change (exit 2)."""


class CollectiveInEvaluationError(RuntimeError):
    """The task's evaluation called a collective, which the ranks would not all call alike:
    the task's code must change (exit 2)."""


class CollectiveInLossError(RuntimeError):
    """The task's training loss exchanges data between ranks, and the batch split gives each
    rank several micro-batches per step: another loss than the whole batch's (exit 2)."""


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, read from the launcher's environment variables."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    launcher: str = "single"

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the files that every rank holds a copy of."""
        return self.rank == 0


#: (rank, world size) as MPI launchers (mpirun, mpiexec) set them: Open MPI; MPICH, Intel MPI
#: and MVAPICH under Hydra (PMI); MVAPICH's mpirun_rsh.
_MPI_RANK_AND_SIZE = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)
#: A process's rank on its host, as they (or Cray's PMI) set it; LOCAL_RANK when exported by hand.
_MPI_LOCAL_RANK = (
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "PMI_LOCAL_RANK",
    "LOCAL_RANK",
)


def detect_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Read rank and world size from torchrun, then an MPI launcher, then Slurm, else assume a
    single process.

    MPI before Slurm: mpirun inside a Slurm allocation starts its processes from one Slurm task
    per node, and all processes of a node inherit that task's SLURM_PROCID. A process of an
    MPI launcher whose world size is unknown is refused: alone, it would train as a job of one
    rank in the same run directory as the others.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return DistEnv(
            rank=int(environ["RANK"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            world_size=int(environ["WORLD_SIZE"]),
            launcher="torchrun",
        )
    mpi = _mpi_env(environ)
    if mpi is not None:
        return mpi
    if "SLURM_PROCID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
        return DistEnv(
            rank=int(environ["SLURM_PROCID"]),
            local_rank=int(environ.get("SLURM_LOCALID", "0")),
            world_size=int(environ["SLURM_NTASKS"]),
            launcher="slurm",
        )
    if "PMIX_RANK" in environ and "SLURM_NTASKS" not in environ:
        raise DistributedError(
            "PMIX_RANK is set, but no variable gives the number of processes "
            "(OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS): this process would train alone "
            "beside the others in one run directory. Launch with Open MPI's mpirun, srun or "
            "torchrun, or export RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
        )
    return DistEnv()


def _mpi_env(environ: Mapping[str, str]) -> DistEnv | None:
    """This process's place in an MPI launch; None when no MPI launcher started it."""
    for rank_name, size_name in _MPI_RANK_AND_SIZE:
        if rank_name in environ and size_name in environ:
            break
    else:
        return None
    rank, world_size = int(environ[rank_name]), int(environ[size_name])
    if world_size == 1:
        return DistEnv()
    local_names = list(_MPI_LOCAL_RANK)
    if environ.get("SLURM_PROCID") == environ[rank_name]:
        local_names.append("SLURM_LOCALID")  # srun --mpi=... started this very process
    local_rank = next((environ[name] for name in local_names if name in environ), None)
    if local_rank is None:
        raise DistributedError(
            f"{rank_name} is set, but no local rank ({', '.join(_MPI_LOCAL_RANK)}): export "
            "LOCAL_RANK, this process's rank on its host, to every process, or use torchrun."
        )
    return DistEnv(rank=rank, local_rank=int(local_rank), world_size=world_size, launcher="mpi")


def select_device(env: DistEnv, config: DistConfig) -> torch.device:
    """Pick this rank's device; on CUDA, bind the process to its GPU before any CUDA work.

    Local rank i takes visible GPU i. A process that sees exactly one GPU takes it whatever its
    local rank: Slurm's GPU binding (`--gpus-per-task=1`, `--gpu-bind`) gives every task its own
    GPU, numbered 0 in that task. torchrun binds nothing: all its local ranks see the same GPUs.
    """
    want_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DistributedError(
            "dist.device=cuda but no CUDA device is visible; use dist.device=cpu"
        )
    visible = torch.cuda.device_count()
    if env.local_rank < visible:
        index = env.local_rank
    elif visible == 1 and env.launcher != "torchrun":
        index = 0
    else:
        raise DistributedError(
            f"local rank {env.local_rank} has no GPU: only {visible} visible to it. Start at "
            "most one process per GPU (torchrun --nproc-per-node=gpu), or let Slurm bind one "
            "GPU to each task (--gpus-per-task=1)."
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def select_backend(device: torch.device, config: DistConfig) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones, unless the config insists."""
    if config.backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if config.backend == "nccl" and device.type != "cuda":
        raise DistributedError("dist.backend=nccl needs CUDA devices; use dist.backend=gloo on CPU")
    if config.backend == "mpi" and not dist.is_mpi_available():
        raise ConfigError(
            f"dist.backend=mpi needs a torch built with MPI, and this one (torch "
            f"{torch.__version__}) is not: torch.distributed.is_mpi_available() is False. Use "
            "dist.backend=auto (NCCL on GPUs, gloo on CPU), or build torch from source with MPI."
        )
    return config.backend


@contextmanager
def process_group(
    env: DistEnv,
    config: DistConfig,
    agree: Callable[[dist.Store, torch.device], object] | None = None,
    starting: AbstractContextManager | None = None,
    comm_traces: Path | None = None,
    debug_output: Path | None = None,
) -> Iterator[torch.device]:
    """Start the process group (if there is more than one rank) and always tear it down.

    Two timeouts: `dist.timeout_s` bounds start-up and every training collective, so that a hung
    or lost rank ends the job in about a minute; `dist.barrier_timeout_s` bounds the barriers
    around checkpoint writes and rank-0-only work (a large save, a tracker that starts slowly),
    which run on a separate gloo group (CPU, so waiting never touches the GPU).

    `agree(store, device)` runs once the ranks have met in the rendezvous store and before the
    group starts (agreement.py: the ranks compare how they were launched). `starting` is
    entered around the whole start (watchdog.startup_bounded: a bound, and stop signals).
    With `comm_traces`, an NCCL group's flight recorder writes there when a collective times
    out (flight_recorder.py). With `debug_output` (dist.debug), NCCL's and torch.distributed's
    debug output are turned on as the group starts, NCCL's log written there (debug_output.py).

    On success every rank meets at a barrier before leaving, so no rank exits while another still
    needs it. On an exception there is no barrier (the peers may be gone or hung): the group is
    destroyed and the error propagates: the process exits non-zero and the launcher ends the job.
    """
    device = select_device(env, config)
    if env.world_size > 1:
        with starting or nullcontext():
            try:
                _start(env, config, device, agree, comm_traces, debug_output)
            except BaseException:
                destroy_process_groups()
                raise
    try:
        yield device
    except BaseException:
        destroy_process_groups()
        raise
    if dist.is_initialized():
        # Free unreachable DDP objects now: a process group still referenced at interpreter
        # exit can abort the process from gloo's worker threads.
        gc.collect()
        barrier()
    destroy_process_groups()


def _start(
    env: DistEnv,
    config: DistConfig,
    device: torch.device,
    agree: Callable[[dist.Store, torch.device], object] | None,
    comm_traces: Path | None,
    debug_output: Path | None,
) -> None:
    """Meet in the rendezvous store, agree, then start the default group and the gloo ones."""
    global _store
    backend = select_backend(device, config)
    timeout = timedelta(seconds=config.timeout_s)
    _store = open_store(env, timeout)
    if agree is not None:
        agree(_store, device)
    if backend == "nccl" and comm_traces is not None:  # torch reads them as the group starts
        record_collectives(config.flight_recorder_entries, comm_traces, env.rank, env.local_rank)
    if debug_output is not None:
        turn_on(debug_output, env.rank, env.local_rank)
    options: dict[str, Any] = {}
    if backend != "mpi":  # MPI knows its ranks and needs no store
        options = {"store": dist.PrefixStore("default_pg", _store)}
        options.update(rank=env.rank, world_size=env.world_size)
    dist.init_process_group(
        backend=backend,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
        **options,
    )
    start_control_group(config.barrier_timeout_s, config.timeout_s)


def start_control_group(timeout_s: float, step_timeout_s: float | None = None) -> None:
    """Start the gloo groups of every rank: the control group, whose waits (barriers around
    checkpoint writes, exchanges after slow work) last up to `timeout_s`, and the step group,
    for collectives between steps, which wait up to `step_timeout_s` (default: `timeout_s`).

    A collective: every rank calls it once, right after the default group has started.
    """
    global _control_group, _step_group
    _control_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    step_timeout = timedelta(seconds=step_timeout_s or timeout_s)
    _step_group = dist.new_group(backend="gloo", timeout=step_timeout)


def control_group() -> dist.ProcessGroup | None:
    """The group for barriers and exchanges after slow work (dist.barrier_timeout_s): None (the
    default group) until one is started."""
    return _control_group


def step_group() -> dist.ProcessGroup | None:
    """The group for collectives between steps (the stop checks, evaluation's layout), which
    never wait for slow work: a rank that does not answer within dist.timeout_s is gone, or cut
    off, and the job ends then rather than after dist.barrier_timeout_s."""
    return _step_group


def destroy_process_groups() -> None:
    """Tear down the control groups and the default group, if they are running."""
    global _control_group, _step_group, _store
    _control_group = _step_group = _store = None
    if dist.is_initialized():
        dist.destroy_process_group()


def rendezvous_store() -> dist.Store | None:
    """The store the ranks met in, in this attempt's namespace; None without a process group."""
    return _store


def open_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """The store the ranks meet in (MASTER_ADDR:MASTER_PORT), in a namespace of this attempt.

    torchrun hosts that store itself (TORCHELASTIC_USE_AGENT_STORE) and keeps it across
    `--max-restarts` restarts, so the keys of the failed attempt's process groups (each rank's
    address) are still there: a restarted rank that reads its peer's old address connects to a
    dead process ("Connection refused"), or both ranks wait for each other until gloo gives up.
    A prefix per attempt (TORCHELASTIC_RESTART_COUNT) keeps the attempts apart. The launchers also
    set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt), which holds across
    machines whose torchruns count restarts differently.
    """
    if env.launcher in _RENDEZVOUS_HINTS:
        _require_rendezvous_address(env.launcher)
    try:
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    except dist.DistError as error:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise LaunchIncompleteError(
            f"rank {env.rank}: the {env.world_size} ranks did not all reach the rendezvous "
            f"store at {where} within dist.timeout_s={timeout.total_seconds():.0f} s "
            f"({str(error).splitlines()[0]}). A rank failed to start (its node's log says "
            "why), or cannot reach that address: a firewall, or a wrong MASTER_ADDR."
        ) from error
    store.set_timeout(timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"attempt_{attempt}", store)
    return store


#: Launchers that start every rank themselves, with how to give the ranks a meeting point.
_RENDEZVOUS_HINTS = {
    "slurm": "with one Slurm task per GPU the ranks meet at MASTER_ADDR:MASTER_PORT. Export "
    'them in the batch script (the first host of `scontrol show hostnames "$SLURM_JOB_NODELIST"` '
    "and a free port), or use torchrun.",
    "mpi": "under mpirun the ranks meet at MASTER_ADDR:MASTER_PORT. Pass them to every process "
    "(Open MPI: `mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=<free port>`; MPICH and "
    "Intel MPI: `mpiexec -genv MASTER_ADDR <first host> -genv MASTER_PORT <free port>`), or "
    "use torchrun.",
}


def _require_rendezvous_address(launcher: str) -> None:
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise DistributedError(f"{' and '.join(missing)} not set: {_RENDEZVOUS_HINTS[launcher]}")


def is_distributed() -> bool:
    """True when a process group is running (more than one rank)."""
    return dist.is_available() and dist.is_initialized()


def barrier(timeout_s: float | None = None, group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank, for up to `timeout_s` (default `dist.barrier_timeout_s`); a no-op
    for a single process. With `timeout_s`, a rank that does not arrive in time is named in the
    error (a monitored barrier). `group` (a gloo group) defaults to the control group; a save
    in the background passes its own, so that its waits never interleave with training's."""
    if not is_distributed():
        return
    group = group or _control_group
    if timeout_s is None:
        dist.barrier(group=group)
    else:
        dist.monitored_barrier(
            group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True
        )


#: What to do about parameters that get no gradient in a step.
_UNUSED_PARAMETERS_FIX = (
    "Set dist.find_unused_parameters=true (costs a graph traversal per step), or make every "
    "parameter take part in the loss."
)


#: What DDP's own errors in a backward mean for a task: a phrase of each, and what to change.
_DDP_ERRORS = (
    (
        re.compile(r"find_unused_parameters"),
        "some parameters got no gradient in a step, so DDP never finished reducing gradients. "
        f"{_UNUSED_PARAMETERS_FIX}",
    ),
    (
        re.compile(r"mark a variable ready only once(?:.*with name (\S+) has been)?", re.S),
        "DDP all-reduces each parameter's gradient once per backward, and {parameter} got "
        "gradients twice in one: reentrant activation checkpointing "
        "(torch.utils.checkpoint.checkpoint(..., use_reentrant=True)) around a block the "
        "forward calls more than once runs a backward of its own each time, or a parameter "
        "was used outside the model's forward. Pass use_reentrant=False to checkpoint "
        "(torch's advice; DDP takes it, with gradient accumulation too), or set "
        "dist.static_graph=true, which takes reentrant backwards but no gradient "
        "accumulation (train.micro_batch_size at least train.global_batch_size / ranks).",
    ),
)


def explain_ddp_error(error: RuntimeError) -> None:
    """Raise GradientsNotReducedError (exit status 2) in our words for DDP's own error about
    the backward of a task's model: a parameter without gradient, or one that got gradients
    twice (reentrant activation checkpointing of a block used twice); return on any other
    error. DDP's own message is chained to it."""
    for pattern, explanation in _DDP_ERRORS:
        found = pattern.search(str(error))
        if found:
            parameter = found.group(1) if found.groups() and found.group(1) else "a parameter"
            raise GradientsNotReducedError(explanation.format(parameter=parameter)) from error


def refuse_static_graph_with_accumulation(
    config: DistConfig, accumulation_steps: int, batch: str
) -> None:
    """dist.static_graph and gradient accumulation (no_sync) do not go together in DDP
    (pytorch/pytorch#143580): the backward fails with an internal assert, and torch's pending
    fix leaves gradients that stop being all-reduced after the first step. As the accumulation
    follows from the world size, a setting that trains on 8 GPUs would fail on 4: refused before
    the process group starts, naming the batch split that needs the accumulation."""
    if config.static_graph and accumulation_steps > 1:
        raise ConfigError(
            f"dist.static_graph=true cannot train with gradient accumulation, and {batch} takes "
            f"{accumulation_steps} micro-batches per step: DDP's static graph fails under "
            "no_sync (pytorch/pytorch#143580). Set dist.static_graph=false, or make a step one "
            "micro-batch per rank (train.micro_batch_size at least train.global_batch_size / "
            "ranks)."
        )


def wrap_ddp(
    model: torch.nn.Module, device: torch.device, config: DistConfig, powersgd_start_step: int
) -> DistributedDataParallel:
    """Wrap `model` in DDP with the dist.* settings, and the gradient compression chosen."""
    if config.comm_hook == "bf16" and dist.get_backend() != "nccl":
        raise ConfigError(
            "dist.comm_hook=bf16 needs the NCCL backend (CUDA GPUs); use dist.comm_hook=fp16 "
            f"with {dist.get_backend()}"
        )
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=config.bucket_cap_mb,
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
        gradient_as_bucket_view=True,
        **{_BUFFER_SYNC_ARGUMENT: config.broadcast_buffers},
    )
    if config.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif config.comm_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif config.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=config.powersgd_rank,
            start_powerSGD_iter=max(2, powersgd_start_step),
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def check_gradients_reduced(
    model: torch.nn.Module,
    step: int,
    device: torch.device,
    ignored: Collection[str] = (),
    prefix: str = "",
) -> None:
    """Raise on every rank if the gradients DDP should have all-reduced differ between ranks.

    DDP reduces gradients only for a backward through its own forward: a training_loss that
    calls a method of the inner module (`model.module.losses(...)`, or
    `getattr(model, "module", model)`, a common way to reach a GAN's two halves) skips it, and
    each rank steps on its own gradients to the end of the run. After the all-reduce every
    rank holds the same bits, so one float64 checksum per parameter, all-gathered once,
    shows it. `ignored`: parameters DDP was told to leave alone. `prefix` goes before the
    names in a message: where `model` is a part of the task's model ("generator.").
    """
    if not is_distributed():
        return
    trainable = [
        (prefix + name, param)
        for name, param in model.named_parameters()
        if param.requires_grad and name not in ignored
    ]
    named = [(name, param) for name, param in trainable if param.grad is not None]
    with torch.no_grad():
        local = torch.zeros(len(named), dtype=torch.float64, device=device)
        for index, (_, param) in enumerate(named):
            local[index] = param.grad.detach().double().sum().to(device)
    rows = torch.nan_to_num(gather_rows(local), nan=0.0)
    differing = [
        name
        for (name, _), column in zip(named, rows.T, strict=True)
        if not (column == column[0]).all()
    ]
    if differing and (without := [n for n, p in trainable if p.grad is None]):
        raise GradientsNotReducedError(
            f"step {step}: {len(without)} parameter(s) got no gradient ({_some(without)}), so DDP "
            f"never finished all-reducing the others. {_UNUSED_PARAMETERS_FIX}"
        )
    if differing:
        raise GradientsNotReducedError(
            f"step {step}: the gradients of {len(differing)} of {len(named)} parameter(s) differ "
            f"between ranks ({_some(differing)}): "
            "DDP did not all-reduce them. DDP reduces gradients only for a backward through its "
            "own forward, so training_loss must call the model it is given (`model(...)`); "
            "calling a method of the inner module (`model.module.f(...)`, "
            "`getattr(model, 'module', model).f(...)`) skips it and every rank trains alone. "
            "Put what the loss needs in the model's forward (it may return several outputs, or "
            "take an argument that chooses the part to run)."
        )


def _some(names: list[str]) -> str:
    """The first three names, and an ellipsis for the rest."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place and return it; unchanged for a single process."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_rows(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `values`, stacked in rank order (one row for a single process).

    A collective on the default group: every rank must call it at the same point.
    """
    if not is_distributed():
        return values.unsqueeze(0)
    rows = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, values)
    return torch.stack(rows)


def gather_objects(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable `value`, in rank order, through `group` (a gloo group; default:
    the control group).

    A collective: every rank must call it at the same point. For small values, rarely: it
    pickles.
    """
    if not is_distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=group or _control_group)
    return values


def all_ranks_agree(flag: bool) -> bool:
    """Whether `flag` is true on every rank: the same answer everywhere (MIN on the control group).

    A collective: every rank must call it at the same point.
    """
    if not is_distributed():
        return flag
    tensor = torch.tensor([int(flag)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_control_group)
    return bool(tensor.item())


#: The calls that exchange data between ranks, by the module a task calls them from:
#: torch.distributed's collectives and point-to-point calls (torch.distributed.nn.functional
#: calls these), and the functional collectives, which carry autograd. Names a torch release
#: lacks are skipped.
_TORCH_DISTRIBUTED_CALLS = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "send_object_list",
    "recv_object_list",
    "_all_gather_base",
    "_reduce_scatter_base",
)
_EXCHANGES = {
    "torch.distributed": _TORCH_DISTRIBUTED_CALLS,
    "torch.distributed.distributed_c10d": _TORCH_DISTRIBUTED_CALLS,
    "torch.distributed._functional_collectives": (
        "broadcast",
        "all_reduce",
        "all_reduce_coalesced",
        "all_reduce_inplace",
        "all_gather_single",
        "all_gather_single_autograd",
        "all_gather_single_coalesced",
        "all_gather_tensor",
        "all_gather_tensor_autograd",
        "all_gather_into_tensor_coalesced",
        "all_gather_inplace",
        "all_gather_tensor_inplace",
        "reduce_scatter_single",
        "reduce_scatter_single_autograd",
        "reduce_scatter_single_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_autograd",
        "reduce_scatter_tensor_coalesced",
        "reduce_scatter_tensor_inplace",
        "all_to_all_single",
        "all_to_all_single_autograd",
        "all_to_all_inplace",
        "permute_tensor",
    ),
}


#: (thread, what to do at each exchange called in it: refuse it, or note it) while a task's
#: method runs under collectives_refused or collectives_noted; else None.
_watch: tuple[int, Callable[[str], None]] | None = None
#: The watching stand-in of each exchange function, made once: (module, name) -> (the
#: function, its stand-in).
_stand_ins: dict[tuple[str, str], tuple[Callable[..., Any], Callable[..., Any]]] = {}
#: torch's own files; among them, those a task's call passes through on its way to a
#: collective (torch.distributed.nn.functional's autograd functions, torch.distributed's).
_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
_ON_THE_WAY = tuple(os.path.join(_TORCH_DIR, part, "") for part in ("distributed", "autograd"))


@contextmanager
def collectives_refused(method: str) -> Iterator[None]:
    """Around a call of the task's `method` in evaluation: a collective it calls raises
    CollectiveInEvaluationError, naming it, before any data moves.

    Evaluation counts every sample once, so the ranks hold shares of the evaluation set that
    differ by up to a sample, and their batches can differ in size or in number: a collective
    there pairs tensors of different sizes (gloo aborts the process) or waits for a rank that
    has finished. Every rank refuses at its first call, with the same message; so does a
    single process, whose code would fail on several. Calls from other threads (a checkpoint
    written in the background) go through. The modules' own functions are back on leaving:
    the stand-ins live only around the call (about 0.1 ms per batch).
    """

    def refuse(name: str) -> None:
        raise CollectiveInEvaluationError(
            f"the task's {method} called {name}, which every rank must call alike, "
            f"and {method} cannot: evaluation counts every sample once, so each rank evaluates "
            "its own share of the evaluation set, the shares differ by up to a sample, and the "
            "ranks' batches can differ in size or in number (a collective would pair tensors "
            "of different sizes, or wait for a rank that has finished). Return sums over the "
            "batch instead: the trainer adds them up over every rank, once, after the last "
            "batch. Compute what needs the totals (a ratio, an F1) in evaluation_metrics; a "
            "metric that needs every sample at once (retrieval over all embeddings) is no sum "
            "of batches: compute it after training, from the exported model (load_model)."
        )

    with _collectives_watched(refuse):
        yield


@contextmanager
def collectives_noted() -> Iterator[list[tuple[str, str]]]:
    """Around a call of the task's `training_loss`: the exchanges between ranks that the
    task's code calls, as (function, where the task called it), in a list filled as they run.
    They go through. Those that torch's own modules make on their own (SyncBatchNorm's
    statistics, DDP's) are not the task's, and are left out. Other threads' calls go through
    unseen, as under collectives_refused."""
    noted: list[tuple[str, str]] = []

    def note(name: str) -> None:
        where = _task_call_site()
        if where is not None:
            noted.append((name, where))

    with _collectives_watched(note):
        yield noted


@contextmanager
def exchanges_checked(accumulation_steps: int, batch: str, per_rank: int) -> Iterator[None]:
    """Around a call of the task's `training_loss` at a launch's first step: refuse a loss
    that exchanges data between ranks when the batch split (`batch`, in words) gives a rank
    `accumulation_steps` > 1 micro-batches per step.

    With one micro-batch per rank and step, an exchange (targets normalised by an all-reduced
    mean, negatives gathered from every rank) reaches the step's whole batch, as one process
    with that batch would: the loss is exact. Under accumulation each call exchanges only the
    micro-batches of its turn, and the step trains another loss, by 1e-3 after a few steps,
    with nothing to show for it. Refused (CollectiveInLossError) once the loss returns, on
    every rank alike (every rank calls the collective), naming it, where the task called it,
    and the micro-batch size of one micro-batch per rank (`per_rank`).
    """
    with collectives_noted() as exchanges:
        yield
    if not exchanges or accumulation_steps == 1:
        return
    name, where = exchanges[0]
    raise CollectiveInLossError(
        f"the task's training_loss called {name} ({where}), which exchanges data between the "
        f"ranks, and {batch} takes {accumulation_steps} micro-batches per rank and step: each "
        "call then exchanges only the micro-batches of its turn, never the step's whole batch, "
        "and the step trains another loss than one process with that batch would, with nothing "
        f"to show for it. Set train.micro_batch_size={per_rank} (train.global_batch_size / "
        "ranks: one micro-batch per rank and step, where the exchange is exact), or launch more "
        "ranks; with Task.whole_batch_loss = True such a split is refused before the launch. "
        "torch's own layers (SyncBatchNorm) are not counted."
    )


@contextmanager
def _collectives_watched(handle: Callable[[str], None]) -> Iterator[None]:
    """Every exchange function of `_EXCHANGES` replaced by a stand-in that passes its name to
    `handle` before it runs, in this thread; the modules' own functions are back on leaving."""
    global _watch
    replaced = []
    for module_name, names in _EXCHANGES.items():
        module = sys.modules.get(module_name)
        if module is None:  # the functional collectives, until something imports them
            continue
        for name in names:
            original = getattr(module, name, None)
            if original is not None:
                setattr(module, name, _stand_in(module_name, name, original))
                replaced.append((module, name, original))
    _watch = (threading.get_ident(), handle)
    try:
        yield
    finally:
        _watch = None
        for module, name, original in replaced:
            setattr(module, name, original)


def _stand_in(module_name: str, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """`original`, whose calls in the watched thread are handed to `_watch` first."""
    made = _stand_ins.get((module_name, name))
    if made is not None and made[0] is original:
        return made[1]
    qualified_name = f"{module_name}.{name}"

    @functools.wraps(original)
    def watched(*args: Any, **kwargs: Any) -> Any:
        watch = _watch
        if watch is not None and watch[0] == threading.get_ident():
            watch[1](qualified_name)
        return original(*args, **kwargs)

    _stand_ins[module_name, name] = (original, watched)
    return watched


def _task_call_site() -> str | None:
    """Where the exchange being watched was called from ("task.py line 87"): the nearest
    caller past this module, torch.distributed and autograd (which a task's call passes
    through); None when that caller is torch's own code (a layer such as SyncBatchNorm)."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_ON_THE_WAY)
    ):
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith(_TORCH_DIR):
        return None
    return f"{Path(frame.f_code.co_filename).name} line {frame.f_lineno}"
