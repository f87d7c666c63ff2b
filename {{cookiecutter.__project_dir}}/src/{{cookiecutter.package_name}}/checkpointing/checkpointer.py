"""A run's checkpoints, as the Trainer uses them: what a save holds and what follows a complete
one, resuming from the newest usable checkpoint or starting fresh, and the export at the end.

The Trainer builds one Checkpointer over the objects it trains (`TrainingState`) and calls it
once per operation; the step count stays the Trainer's, passed in to a save and returned by a
resume. The files are checkpoint.py's (the on-disk protocol; which one to resume,
newest_intact.py's; which to keep, retention.py's), the writing thread
background_save.py's, the best checkpoint's verdict best.py's, what a resume may change
resume.py's, the weights' files weights.py's. A save and a resume are collectives: every rank
calls them at the same step.
"""

from __future__ import annotations

import copy
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel

from .. import __version__
from ..cluster.distributed import DistEnv
from ..config import Config, to_yaml
from ..contract import TaskBase
from ..faults.stopping import StopRequests
from ..loading.data import ResumableDistributedSampler
from ..monitoring.metrics import MetricsLogger
from ..monitoring.throughput import StepMeter
from ..training import rng
from ..training.divergence import SkipPolicy
from ..training.losses import WindowSums
from ..training.optimizer import follow_settings
from ..training.updates import Update
from .background_save import BackgroundSaver, CompletedSave
from .best import BestCheckpoint
from .checkpoint import (
    CheckpointReadError,
    CheckpointSaveError,
    LoadedCheckpoint,
    room_warning,
    save_checkpoint,
    save_timeout_s,
)
from .layout import INCOMPATIBLE_SUFFIX
from .newest_intact import NoUsableCheckpointError, load_newest_intact
from .resume import (
    ResumeError,
    announce_world_size_change,
    changed_settings,
    check_changes,
    continue_sample_seeds,
)
from .retention import set_aside
from .storage import Location, local_dir_of
from .weights import (
    export_weights,
    load_initial_weights,
    load_plain_state_dict,
    plain_state_dict,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint holds, as the Trainer built it: the Checkpointer reads these objects at
    each save and loads into them on resume; the Trainer trains them in between."""

    model: torch.nn.Module
    #: Each optimizer with its schedule and loss scaler (one, unless the task has updates).
    updates: list[Update]
    ema: AveragedModel | None
    task: TaskBase
    sampler: ResumableDistributedSampler
    best: BestCheckpoint
    skips: SkipPolicy
    #: This rank's share of the log line's sums: in its rank file, so that resumed logs match.
    window: WindowSums
    steps_per_epoch: int
    accumulation_steps: int


class Checkpointer:
    """Saves, resumes and exports one rank's TrainingState; every rank has one."""

    def __init__(
        self,
        config: Config,
        env: DistEnv,
        device: torch.device,
        run_dir: Location,
        state: TrainingState,
        *,
        metrics: MetricsLogger,
        meter: StepMeter,
        stop: StopRequests,
        job: str,
        background: BackgroundSaver | None,
    ) -> None:
        self.config = config
        self.env = env
        self.device = device
        self.run_dir = run_dir
        self.state = state
        #: Flushed to the tracker up to each complete checkpoint, cut back on resume.
        self.metrics = metrics
        #: Paused while a save copies or writes: its time is left out of throughput.
        self.meter = meter
        #: Its deadline must cover a background write (watchdog.py).
        self.stop = stop
        #: This job's name (rank 0's, on every rank): it names the staging of its saves.
        self.job = job
        #: checkpoint.async: the writer of scheduled saves, with its own gloo group.
        self.background = background
        #: Seconds the previous save of this launch took: it bounds the waits of the next.
        self.last_save_s: float | None = None

    # --- saving -----------------------------------------------------------------------------

    def state_dict(self, step: int) -> dict[str, Any]:
        """The replicated state at `step`: identical on every rank, written once by rank 0."""
        state = self.state
        return {
            "model": plain_state_dict(state.model),
            **_updates_state(state.updates),
            "step": step,
            "epoch": step // state.steps_per_epoch,
            "step_in_epoch": step % state.steps_per_epoch,
            "sampler": {
                "seed": state.sampler.seed,
                "epoch": state.sampler.epoch,
                "start_index": state.sampler.start_index,
                "sample_seeds": state.sampler.sample_seeds,
            },
            "task": state.task.state_dict(),
            "ema": None if state.ema is None else plain_state_dict(state.ema),
            "best": state.best.state_dict(),
            "skipped_steps": state.skips.skipped,
            "world_size": self.env.world_size,
            "global_batch_size": self.config.train.global_batch_size,
            "config": self.config.to_dict(),
            "versions": {
                "package": __version__,
                "torch": str(torch.__version__),
                "python": platform.python_version(),
            },
        }

    def rank_state_dict(self) -> dict[str, Any]:
        """What differs between ranks: RNG streams and this rank's share of the logging window.

        The throughput units are left out: they go with the meter's clock, which restarts with
        every launch.
        """
        window = {k: v for k, v in self.state.window.state_dict().items() if k != "units"}
        return {
            "rank": self.env.rank,
            "rng": rng.capture(self.device),
            "window": window,
        }

    def save(self, step: int) -> Path:
        """Write a checkpoint of `step` (a collective); its time is left out of throughput.

        A save in the background still in flight is waited for first. The ranks wait for each
        other around the save for dist.barrier_timeout_s the first time in a launch, then for a
        bound from the previous save's write time (checkpoint.py), so a rank hung in a save ends
        the job soon, named.
        """
        self.meter.pause()
        write, done = self._writer(step)
        started = time.perf_counter()
        path = write((self.state_dict(step), self.rank_state_dict()))
        done(CompletedSave(step, path, stall_s=0.0, write_s=time.perf_counter() - started))
        self.meter.resume()
        return path

    def save_in_background(self, step: int) -> None:
        """Copy the state of `step` to host memory and write its checkpoint in a thread while
        training goes on (checkpoint.async; a collective). A save still in flight is waited for
        first; what follows a complete checkpoint runs once it is (background_save.py)."""
        if self.background is None:
            raise RuntimeError("save_in_background needs checkpoint.async=true")
        self.meter.pause()
        write, done = self._writer(step, background=True)
        states = (self.state_dict(step), self.rank_state_dict())
        self.background.start(step, states, write, done)
        self.meter.resume()

    def wait_for_save(self) -> None:
        """Wait for the save in the background, if one is in flight, and finish it: raises
        CheckpointSaveError when it failed (on every rank alike)."""
        if self.background is not None:
            self.background.wait()

    def wait_after_failure(self) -> None:
        """Training failed: finish the save in flight, whose state was checked before it was
        taken, and say how it ended; the failure itself is raised by the caller."""
        try:
            self.wait_for_save()
        except CheckpointSaveError as error:
            log.error("%s", error)

    def _writer(
        self, step: int, background: bool = False
    ) -> tuple[Callable[[tuple[dict, dict]], Path], Callable[[CompletedSave], None]]:
        """(write, done) of a save of `step`, after waiting for the save in flight: `write`
        takes (state, rank state) and writes them, `done` follows a complete checkpoint."""
        self.wait_for_save()  # at most one save in flight; last_save_s is then its write time
        best = self.state.best.checkpoint_name
        # A new best at this step: best.json names this checkpoint once it is complete, with
        # the verdict as of this step (a later evaluation may find a newer best meanwhile).
        kept_best = copy.copy(self.state.best) if self.state.best.step == step else None
        timeout_s = save_timeout_s(self.last_save_s, self.config.dist.barrier_timeout_s)
        group = None if self.background is None else self.background.group

        def write(states: tuple[dict, dict]) -> Path:
            return save_checkpoint(
                self.run_dir,
                step,
                *states,
                self.env,
                keep_last=self.config.checkpoint.keep_last,
                job=self.job,
                timeout_s=timeout_s,
                keep=[best] if best else [],
                group=group,
            )

        return write, partial(self._saved, best=kept_best, background=background)

    def _saved(
        self, completed: CompletedSave, best: BestCheckpoint | None, background: bool
    ) -> None:
        """What follows a complete checkpoint: the records up to its step may reach the
        tracker, and best.json may name it."""
        self.last_save_s = completed.write_s
        self.metrics.flush(through=completed.step)
        if background:
            # A stop waits for the save in flight, then saves: its deadline (watchdog.py),
            # sized from the longest step, must cover a background write too.
            self.stop.longest_step_s = max(self.stop.longest_step_s, completed.write_s)
            log.info(
                "saved checkpoint %s, written in %.2f s in the background (training paused "
                "%.2f s to copy the state)",
                completed.path,
                completed.write_s,
                completed.stall_s,
            )
        else:
            log.info("saved checkpoint %s, written in %.2f s", completed.path, completed.write_s)
        if best is not None and self.env.is_main:
            best.write(self.run_dir)
            log.info("new %s: checkpoint %s is kept", best.describe(), best.checkpoint_name)

    # --- resuming ---------------------------------------------------------------------------

    def resume(self) -> int | None:
        """Continue from the newest checkpoint that every rank can load: returns its step, or
        None when there is none (or a new run starts over).

        A collective. Settings changed since the checkpoint are refused or applied (resume.py),
        each optimizer group follows the current settings and its own options again
        (optimizer.py); on another number of ranks, the per-rank random streams are derived
        afresh. When the run directory holds checkpoints and none can be used, or one cannot be
        read for a reason that is not damage (memory, permissions, I/O), raises ResumeError;
        with checkpoint.start_over_if_unusable, a new run starts at step 0 instead.
        """
        loaded = self._load_newest()
        if loaded is None:
            return None
        state, announce = loaded.state, self.env.is_main
        changes = changed_settings(state["config"], self.config.to_dict())
        own = not all(
            update.as_built.default_optimizer and update.as_built.default_schedule
            for update in self.state.updates
        )
        check_changes(changes, loaded.path, announce, own_optimizer=own)
        self._restore(state, loaded.path, announce)
        step = state["step"]
        if loaded.rank_state is not None:
            rng.restore(loaded.rank_state["rng"], self.device)
            window = _window_state(loaded.rank_state, self.state.accumulation_steps)
            self.state.window.load_state_dict(window)
        else:
            announce_world_size_change(loaded.world_size, self.env.world_size, announce)
            rng.seed_rank(self.config.run.seed, self.env.rank, step)
        if announce:
            self._tidy_after_resume(loaded)
        self.metrics.truncate_after(step)
        if self.config.init.weights and announce:
            log.info("init.weights is not used: the run continues from its own checkpoint")
        log.info("resumed from %s at step %d", loaded.path, step)
        return step

    def _load_newest(self) -> LoadedCheckpoint | None:
        """The newest checkpoint every rank can load; None when the run has none, or when none
        can be used and checkpoint.start_over_if_unusable starts a new run."""
        try:
            return load_newest_intact(self.run_dir, self.env)
        except CheckpointReadError as error:
            raise ResumeError(str(error)) from error
        except NoUsableCheckpointError as error:
            if not self.config.checkpoint.start_over_if_unusable:
                raise ResumeError(
                    f"{error} The run's metrics are untouched. Launch again once the cause is "
                    "fixed, start a new run with another run.dir, or set "
                    "checkpoint.start_over_if_unusable=true to start a new run in this one "
                    "(the old metrics are kept aside)."
                ) from error
            self._start_over(error.incompatible)
            return None

    def _restore(self, saved: dict[str, Any], path: Path, announce: bool) -> None:
        """Load the replicated state into the objects trained; the optimizer groups follow the
        current settings where they set none of their own."""
        state = self.state
        load_plain_state_dict(state.model, saved["model"])
        for update in state.updates:
            _restore_update(update, _saved_update(saved, update, state.updates, path), path)
            follow_settings(
                update.optimizer,
                update.scheduler,
                update.as_built,
                update.own_group_options,
                announce,
            )
        self._resume_ema(saved.get("ema"), announce)
        state.best.load_state_dict(saved.get("best"), announce)
        state.skips.skipped = saved.get("skipped_steps", 0)
        seeded = saved.get("sampler", {}).get("sample_seeds")
        state.sampler.sample_seeds = continue_sample_seeds(
            seeded, state.sampler.sample_seeds, saved["step"], announce
        )
        if "task" in saved:  # checkpoints of contract version 1 hold no task state
            state.task.load_state_dict(saved["task"])

    def _resume_ema(self, saved: dict[str, Any] | None, announce: bool) -> None:
        ema = self.state.ema
        if ema is not None and saved is not None:
            load_plain_state_dict(ema, saved)
        elif ema is not None and announce:
            log.info("ema.decay is on from now: the average starts from the resumed weights")
        elif saved is not None and announce:
            log.info("ema.decay=0: the checkpoint's moving average is dropped")

    def _tidy_after_resume(self, loaded: LoadedCheckpoint) -> None:
        """Rank 0: checkpoints of another format out of reach of this run's saves and pruning,
        and a warning when the file system cannot hold the checkpoints kept."""
        for path in loaded.skipped:
            log.warning(
                "moved %s, of another format, to %s",
                path.name,
                set_aside(path, INCOMPATIBLE_SUFFIX).name,
            )
        warning = room_warning(self.run_dir, self.config.checkpoint.keep_last)
        if warning:
            log.warning("%s", warning)

    def _start_over(self, incompatible: list[Path]) -> None:
        """A new run at step 0 where no checkpoint can be used (checkpoint.start_over_if_unusable):
        the old run's metrics and checkpoints of another format are kept aside, not lost."""
        if not self.env.is_main:
            return
        for path in incompatible:
            set_aside(path, INCOMPATIBLE_SUFFIX)
        kept = self.metrics.set_aside(f"before-start-over-{time.strftime('%Y%m%dT%H%M%S')}")
        log.warning(
            "no checkpoint can be used; starting a new run at step 0 "
            "(checkpoint.start_over_if_unusable=true)%s",
            f"; the old run's metrics are in {kept.name}" if kept else "",
        )

    def start_fresh(self) -> None:
        """Begin at step 0: forget records of a run that died before its first checkpoint, and
        load init.weights when set (fine-tuning: the optimizer and schedule start afresh)."""
        self.metrics.truncate_after(0)
        if self.config.init.weights:
            source = load_initial_weights(self.state.model, self.config.init.weights)
            if self.env.is_main:
                log.info("initialised the model with the %s", source)

    # --- the end of training ----------------------------------------------------------------

    def export(self) -> None:
        """Rank 0 writes the weights (and their moving average) as safetensors with the config,
        for `weights.load_model` and other programs."""
        if not self.env.is_main:
            return
        config_yaml = to_yaml(self.config)
        local_dir = local_dir_of(self.run_dir)
        path = export_weights(self.state.model, local_dir, config_yaml, task=self.state.task)
        if self.state.ema is not None:
            export_weights(self.state.ema.module, local_dir, config_yaml, name="model_ema")
        log.info("exported the weights to %s", path.parent)


def _updates_state(updates: list[Update]) -> dict[str, Any]:
    """The optimizers, schedules and loss scalers: the one update's as they are, or each of
    `Task.updates`'s by name (with the names, in order, under "updates")."""
    states = {
        "optimizer": {u.name: u.optimizer.state_dict() for u in updates},
        "scheduler": {u.name: u.scheduler.state_dict() for u in updates},
        "scaler": {u.name: u.scaler.state_dict() for u in updates},
    }
    if updates[0].name is None:
        return {key: value[None] for key, value in states.items()}
    return {**states, "updates": [update.name for update in updates]}


def _saved_update(
    saved: dict[str, Any], update: Update, updates: list[Update], path: Path
) -> dict[str, Any]:
    """The optimizer, schedule and loss scaler a checkpoint holds for `update`; ResumeError
    when the checkpoint's updates are not the task's."""
    names = [u.name for u in updates if u.name is not None]
    before = saved.get("updates", [])
    if before != names:
        raise ResumeError(
            f"cannot resume {path}: it was saved with "
            f"{_describe_updates(before)}, and the task now trains {_describe_updates(names)} "
            "(Task.updates). Restore the task's updates, or start a new run with another "
            "run.dir."
        )
    if update.name is None:
        return {key: saved[key] for key in ("optimizer", "scheduler", "scaler")}
    return {key: saved[key][update.name] for key in ("optimizer", "scheduler", "scaler")}


def _describe_updates(names: list[str]) -> str:
    if not names:
        return "one optimizer for the whole model"
    return f"updates {', '.join(names)}"


def _restore_update(update: Update, saved: dict[str, Any], path: Path) -> None:
    """Load one update's optimizer, schedule and loss scaler."""
    try:
        update.optimizer.load_state_dict(saved["optimizer"])
    except ValueError as error:  # other groups, or groups of other sizes
        before = [len(group["params"]) for group in saved["optimizer"]["param_groups"]]
        now = [len(group["params"]) for group in update.optimizer.param_groups]
        of = "" if update.name is None else f" of {update.name}"
        raise ResumeError(
            f"cannot resume {path}: its optimizer{of} has parameter groups of {before} "
            f"tensors, and the task's param_groups now makes groups of {now} ({error}). "
            "Restore the task's param_groups, or start a new run with another run.dir."
        ) from error
    update.scheduler.load_state_dict(saved["scheduler"])
    if saved["scaler"]:  # empty when saved without fp16 loss scaling
        update.scaler.load_state_dict(saved["scaler"])


def _window_state(rank_state: dict[str, Any], accumulation_steps: int) -> dict[str, torch.Tensor]:
    """The logging window of a rank file; those of release 0.4 hold the sum of micro-batch
    means alone, over window_steps x accumulation_steps micro-batches."""
    if "window" in rank_state:
        return rank_state["window"]
    micro_batches = rank_state["window_steps"] * accumulation_steps
    return {"loss": rank_state["window_loss"], "count": torch.tensor(float(micro_batches))}
