"""Entry point of training: `python -m <package>.train [--config FILE] [section.key=value ...]`.

The same command runs as a single process, under `torchrun --nproc-per-node=N`, and under Slurm.
Running it again with the same run directory resumes from the newest complete checkpoint.
"""

from __future__ import annotations

from .dependencies import require_installed
from .faults.signals import record_early, release_early

if __name__ == "__main__":
    # Before the heavy imports (torch takes seconds): a stop signal that arrives meanwhile is
    # recorded and acted on once training can save, instead of killing the process; a package
    # the project needs and this environment lacks is named in one line (exit 2).
    record_early()
    require_installed()

import argparse
import logging
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .checkpointing.checkpoint import CheckpointSaveError, restore_run_files
from .checkpointing.layout import new_job_token
from .checkpointing.resume import ResumeError, require_fresh_run_dir
from .checkpointing.retention import remove_foreign_staging
from .checkpointing.run_lock import EXIT_RUN_DIR_BUSY, RunDirBusyError, RunLock, owned_run_dir
from .checkpointing.storage import Location, ObjectPath, local_dir_of, run_location
from .checkpointing.weights import WeightsError
from .cluster import network
from .cluster.agreement import (
    LaunchIncompleteError,
    agree_on_launch,
    identity,
    refuse_launch,
    require_shared_run_dir,
    roster,
)
from .cluster.debug_output import debug_dir
from .cluster.distributed import (
    CollectiveInEvaluationError,
    CollectiveInLossError,
    DistEnv,
    ReplicaMismatchError,
    barrier,
    detect_env,
    open_store,
    process_group,
    refuse_static_graph_with_accumulation,
)
from .config import Config, ConfigError, DistConfig, load_config, settings, to_yaml
from .contract import ContractError, member_of
from .faults.flight_recorder import traces_dir
from .faults.parent_watch import launcher_watched
from .faults.stopping import EXIT_INTERRUPTED, StopRequests
from .faults.watchdog import aborts_reported, hangs_reported, startup_bounded, stop_deadline
from .launch import exit_status_recorded, record_run_dir
from .loading.data import SampleLoadError
from .loading.workers import describe_worker_death
from .monitoring.logs import log_file_name, setup_logging
from .monitoring.metrics import MetricsLogger
{%- if cookiecutter.tracker != "none" %}
from .monitoring.tracker import Tracker
{%- endif %}
from .task import Task
from .training.divergence import EXIT_DIVERGED, DivergenceError
from .training.trainer import Trainer, batch_split, describe_split

log = logging.getLogger(__name__)


class _ArgumentParser(argparse.ArgumentParser):
    """Ends `--help` with every setting, read only then: reading them takes a tenth of a second."""

    def format_help(self) -> str:
        return f"{super().format_help()}\n{_settings_help()}\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _ArgumentParser(
        prog={{ (cookiecutter.project_slug ~ "-train") | python_string }},
        description="Train with DistributedDataParallel (single process, torchrun or Slurm).",
    )
    parser.add_argument("--config", type=Path, help="YAML file on top of the defaults")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_args(argv)


def _settings_help() -> str:
    """Every setting of the config with its default, type and the `#:` comment above its field."""
    lines = [
        "settings, each overridable as section.key=value (values in YAML syntax), e.g.",
        "  train.max_steps=100 run.dir=runs/exp1 optim.betas=[0.9,0.95]",
    ]
    section = ""
    for setting in settings():
        if not setting.key.startswith(f"{section}."):
            section = setting.key.split(".")[0]
            lines.append("")
        lines.append(f"  {setting.key}={setting.default}  ({setting.type})")
        lines.append(f"      {setting.help}")
    return "\n".join(lines)


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = detect_env()
    config = checked_config(args.config, args.overrides, env, tell=not args.print_config)
    if config is None:
        return 2
    if args.print_config:
        print(to_yaml(config), end="")
        return 0
    if not interfaces_present(env):
        return 2
    setup_logging(env.rank)  # stderr until the job owns its run directory

    run_dir = run_location(config.run.dir, config.run.local_dir)
    local_dir = local_dir_of(run_dir)
    # From here on a stop signal is recorded, not fatal: it is acted on once training can save.
    stop = StopRequests(config.checkpoint.stop_on_signals, config.checkpoint.stop_check_s)
    if not stop.enabled:
        release_early()
    try:
        with (
            stop.installed(),
            launcher_watched(env),
            process_group(
                env,
                config.dist,
                agree=lambda store, device: _agree(store, device, config, env),
                starting=startup_bounded(stop, env, config.dist.timeout_s),
                comm_traces=traces_dir(local_dir),
                debug_output=debug_dir(local_dir) if config.dist.debug else None,
            ) as device,
            owned_run_dir(run_dir, env) as lock,
            stop_deadline(stop, env, local_dir, config),
            hangs_reported(local_dir, env, config.dist.timeout_s, stop),
        ):
            token = lock.me.token if lock else None
            require_shared_run_dir(run_dir, config.run.dir, token, env, config.dist.timeout_s)
            # Nothing is written in the run directory before this job owns it: a job refused
            # leaves the holder's logs, metrics and checkpoints as they are.
            restored = _restore_run_files(run_dir, env)
            setup_logging(env.rank, local_dir)
            record_run_dir(local_dir)
            if env.is_main and env.world_size > 1:
                log.info("%s; agreed in %.2f s", roster().describe(), roster().seconds)
            if isinstance(run_dir, ObjectPath) and env.is_main:
                _announce_object_store(run_dir, restored)
            if lock is not None:
                _clear_dead_job(lock, run_dir)
            with aborts_reported(local_dir / log_file_name(env.rank)):
                return train(config, env, device, run_dir, stop)
    except RunDirBusyError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_RUN_DIR_BUSY
    except LaunchIncompleteError as error:
        log.error("%s", error)
        return 1
    except (
        ResumeError,
        WeightsError,
        ConfigError,
        ContractError,
        ReplicaMismatchError,
        CollectiveInEvaluationError,
        CollectiveInLossError,
    ) as error:
        log.error("%s", error)
        return 2
    except DivergenceError as error:
        log.error("%s", error)
        return EXIT_DIVERGED
    except CheckpointSaveError as error:  # a full disk: the earlier checkpoints are intact
        log.error("%s", error)
        return 1
    except SampleLoadError as error:
        log.error("the data set failed to give a sample:\n%s", error.details)
        log.error("rank %d on %s: %s", env.rank, socket.gethostname(), error.summary)
        return 1
    except RuntimeError as error:
        death = describe_worker_death(error)
        if death is None:
            raise
        log.error("rank %d on %s: %s", env.rank, socket.gethostname(), death)
        return 1
    except KeyboardInterrupt:
        log.error(
            "interrupted again: exiting now, without a checkpoint of this step; the newest "
            "complete checkpoint in %s is where the next launch resumes",
            run_dir,
        )
        return EXIT_INTERRUPTED


def _agree(store: dist.Store, device: torch.device, config: Config, env: DistEnv) -> None:
    """The ranks compare how they were launched before the process group starts."""
    mine = identity(config, device)
    agree_on_launch(store, env.rank, env.world_size, mine, config.dist.timeout_s)


def checked_config(
    path: Path | None, overrides: list[str], env: DistEnv, tell: bool = True
) -> Config | None:
    """The config of this launch; None once a refusal is printed and, with `tell`, the other
    ranks are told, so that they stop too (exit 2) instead of waiting for this one."""
    try:
        config = load_config(path, overrides)
        # Checked before any process group starts: a bad batch split fails fast on every rank.
        train = config.train
        _, accumulation = batch_split(
            train.global_batch_size, train.micro_batch_size, env.world_size
        )
        batch = describe_split(train.global_batch_size, train.micro_batch_size, env.world_size)
        refuse_static_graph_with_accumulation(config.dist, accumulation, batch)
        if accumulation > 1 and member_of(Task, "whole_batch_loss"):
            raise ConfigError(
                "Task.whole_batch_loss: a micro-batch's loss reads the step's samples together, "
                f"and {batch} takes {accumulation} micro-batches per step, each its own loss. Set "
                f"train.micro_batch_size={train.global_batch_size // env.world_size} "
                "(train.global_batch_size / ranks), or launch more ranks."
            )
        return config
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        if tell:
            tell_the_other_ranks(env, str(error))
        return None


def interfaces_present(env: DistEnv) -> bool:
    """Whether the interfaces that GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name are on this
    host, as the launcher checks them (network.interface_problems). Under plain torchrun or
    srun nothing else does: gloo's process group would fail with `enforce fail ... Unable to
    find address for: NAME`, NCCL's finding no socket interface. A refusal is printed and the
    other ranks are told, so that they stop too (exit 2). A single process opens no socket."""
    problems = network.interface_problems() if env.world_size > 1 else []
    if problems:
        reason = "\n".join(problems)
        print(f"error: {reason}", file=sys.stderr)
        tell_the_other_ranks(env, reason)
    return not problems


def tell_the_other_ranks(env: DistEnv, reason: str) -> None:
    """Stop the other ranks of a job that this rank cannot train in (exit 2 there, `reason`
    named), through the rendezvous store, before they wait for it in the process group's
    start; nothing to tell for a single process, or without a rendezvous address."""
    if env.world_size == 1:
        return
    try:
        store = open_store(env, timedelta(seconds=DistConfig().timeout_s))
    except (RuntimeError, ValueError):  # no rendezvous address, or nobody there
        return
    refuse_launch(store, env.rank, env.world_size, reason)


def _restore_run_files(run_dir: Location, env: DistEnv) -> Location | None:
    """Fetch the run's metrics and logs from the newest checkpoint where the local directory
    lacks them (checkpoint.restore_run_files); an object store out of reach ends the job."""
    try:
        return restore_run_files(run_dir, env.rank)
    except OSError as error:
        raise ResumeError(
            f"cannot read the checkpoints in {run_dir}: {error}. Check the endpoint, the "
            "network and the credentials in the environment (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL; GOOGLE_APPLICATION_CREDENTIALS), then "
            "launch again"
        ) from error


def _announce_object_store(run_dir: ObjectPath, restored: Location | None) -> None:
    log.info(
        "run.dir %s is in an object store: logs and metrics are kept in %s (run.local_dir)%s",
        run_dir,
        local_dir_of(run_dir),
        f"; continued the metrics and logs of {restored.name}" if restored else "",
    )


def _clear_dead_job(lock: RunLock, run_dir: Location) -> None:
    """Say whose lock was taken over, and remove the saves that job never finished (a full disk
    may have stopped it), before anything of the run directory is read."""
    if lock.replaced is not None:
        dead, age = lock.replaced
        log.warning("took over %s from a job that is gone: %s", run_dir, dead.describe(age))
    for staging in remove_foreign_staging(run_dir, new_job_token()):
        log.warning("removed %s, an unfinished save of a job that is gone", staging)


def train(
    config: Config, env: DistEnv, device: torch.device, run_dir: Location, stop: StopRequests
) -> int:
    """Build the task and trainer, resume if a checkpoint exists, and train to the end.

    Returns the exit status (see stopping.py).
    """
    task = Task(config.task, seed=config.run.seed)
    local_dir = local_dir_of(run_dir)
    metrics = MetricsLogger(local_dir, is_main=env.is_main)
    trainer = Trainer(config, task, env, device, run_dir, metrics, stop)
    if not config.checkpoint.resume:
        require_fresh_run_dir(run_dir)
    if not (config.checkpoint.resume and trainer.resume()):
        trainer.start_fresh()
    if env.is_main:
        (local_dir / "config.yaml").write_text(to_yaml(config))
{%- if cookiecutter.tracker != "none" %}
        if config.tracker.enabled:
            metrics.attach(Tracker(config, local_dir))
{%- endif %}
    barrier()  # rank 0's set-up above may take a while; the others wait with the long timeout
    try:
        return trainer.fit()
    finally:
        metrics.close()


if __name__ == "__main__":
    sys.exit(exit_status_recorded(main))
