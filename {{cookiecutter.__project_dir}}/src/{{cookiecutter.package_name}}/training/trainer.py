"""The training loop: accumulation under `no_sync`, mixed precision, clipping, scheduling,
exact evaluation, and when to checkpoint.

The task (task.py) supplies data, model, loss and metrics, through the contract of contract.py;
this module owns how a step runs. One optimizer step consumes `accumulation_steps` micro-batches
on every rank; gradients are all-reduced once, on the last of them. A task whose model has parts
trained apart (`Task.updates`, a GAN) makes one such optimizer step per part, in order, over the
step's same micro-batches (updates.py). Saving, resuming and the export are the Checkpointer's
(checkpointing/checkpointer.py), one call each.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ..checkpointing.background_save import BackgroundSaver
from ..checkpointing.best import BestCheckpoint
from ..checkpointing.checkpointer import Checkpointer, TrainingState
from ..checkpointing.layout import checkpoint_root, latest_checkpoint, new_job_token
from ..checkpointing.storage import Location, local_dir_of
from ..cluster.agreement import agree_on_data, roster
from ..cluster.agreement import describe_ranks as describe_ranks_on_hosts
from ..cluster.distributed import (
    DistEnv,
    all_reduce_sum,
    check_gradients_reduced,
    collectives_refused,
    exchanges_checked,
    explain_ddp_error,
    gather_objects,
    gather_rows,
    step_group,
    wrap_ddp,
)
from ..config import BestConfig, Config, ConfigError
from ..contract import TaskBase, adopt, check_datasets, defines
from ..faults.stopping import StopRequests
from ..loading.data import build_eval_loader, build_train_loader, loader_workers, usable_cores
from ..monitoring.logs import ProgressBar
from ..monitoring.metrics import MetricsLogger, read_metrics
from ..monitoring.profiling import StepProfiler, StepRanges
from ..monitoring.stragglers import Stragglers, describe_ranks
from ..monitoring.throughput import StepMeter, describe, peak_flops, window_figures
from . import rng
from .divergence import DivergenceGuard, SkipPolicy
from .lazy import lazy_names, materialise
from .losses import StepLoss, WindowSums, window_means
from .optimizer import as_built, build_optimizer, build_scheduler, clear_gradients, own_options
from .replicas import ReplicaCheck
from .updates import ModelParts, Update, log_prefix, model_parts, sync_context

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}
#: Around the task's loss once a launch's first step has checked it: nothing.
_UNWATCHED = nullcontext()


def batch_split(global_batch_size: int, max_micro: int, world_size: int) -> tuple[int, int]:
    """(micro-batch size, accumulation steps) that give `global_batch_size` on `world_size` ranks.

    Each rank takes global_batch_size / world_size samples per step, in the fewest equal
    micro-batches of at most `max_micro` (train.micro_batch_size). Refused only when the global
    batch cannot be shared equally, with the nearest global batches and world sizes that can.
    """
    if global_batch_size % world_size:
        below = global_batch_size // world_size * world_size
        batches = " or ".join(str(size) for size in (below, below + world_size) if size > 0)
        sizes = [size for size in range(1, global_batch_size + 1) if global_batch_size % size == 0]
        lower = max(size for size in sizes if size < world_size)
        higher = [size for size in sizes if size > world_size][:1]
        worlds = " or ".join(str(size) for size in [lower, *higher])
        raise ConfigError(
            f"train.global_batch_size={global_batch_size} cannot be shared equally by "
            f"{world_size} ranks. Use train.global_batch_size={batches}, or {worlds} ranks."
        )
    per_rank = global_batch_size // world_size
    micro = max(size for size in range(1, min(per_rank, max_micro) + 1) if per_rank % size == 0)
    return micro, per_rank // micro


def describe_split(global_batch_size: int, max_micro: int, world_size: int) -> str:
    """The batch settings of a launch, in words, for the refusals of a split."""
    return (
        f"train.global_batch_size={global_batch_size} on {world_size} rank(s) with "
        f"train.micro_batch_size={max_micro}"
    )


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a batch (tensor, tuple, list or dict of them) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    return batch


class Trainer:
    """Runs the optimization for one task on one rank; every rank runs the same Trainer."""

    def __init__(
        self,
        config: Config,
        task: object,
        env: DistEnv,
        device: torch.device,
        run_dir: Location,
        metrics: MetricsLogger,
        stop: StopRequests | None = None,
    ) -> None:
        self.config = config
        self.task: TaskBase = adopt(task)
        self.env = env
        self.device = device
        self.run_dir = run_dir
        #: Logs, metrics, profiles, exports: run_dir itself, or its local part on an object store.
        self.local_dir = local_dir_of(run_dir)
        self.metrics = metrics
        train = config.train
        self.micro_batch_size, self.accumulation_steps = batch_split(
            train.global_batch_size, train.micro_batch_size, env.world_size
        )
        #: The batch settings, in words, for the refusals of the split.
        self.split = describe_split(train.global_batch_size, train.micro_batch_size, env.world_size)
        checkpoint = config.checkpoint
        self.stop = stop or StopRequests(checkpoint.stop_on_signals, checkpoint.stop_check_s)
        self.step = 0
        # Two collectives at the same point of every rank's start, for the Checkpointer (built
        # last, over the objects it saves).
        #: This job's name (rank 0's, on every rank): it names the staging of its saves.
        self.job: str = gather_objects(new_job_token())[0]
        #: checkpoint.async: the writer of scheduled saves, with its own gloo group (a
        #: collective: every rank builds its Trainer at the same point).
        self.background: BackgroundSaver | None = None
        if checkpoint.async_save:
            self.background = BackgroundSaver(
                pin_memory=device.type == "cuda", timeout_s=config.dist.barrier_timeout_s
            )

        built_streams = self._build_model()
        self._build_data()
        parts = self._wrap_model(built_streams)
        self._build_optimization(parts)
        self._build_accounting()
        self.checkpointer = self._build_checkpointer()

    def _build_model(self) -> dict[str, Any] | None:
        """The task's model on the device, the same on every rank; then each rank's own random
        streams. Returns the streams as `build_model` left them where the model has lazy
        modules (lazy.py), which take them up when they get their shapes."""
        config, device = self.config, self.device
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = config.train.tf32
            torch.backends.cudnn.allow_tf32 = config.train.tf32
        # The same seed on every rank gives the same initial weights (DDP also broadcasts rank 0's).
        rng.seed_all(config.run.seed)
        self.model = self.task.build_model().to(device)
        self._announce_batch_norm()
        built_streams = rng.capture(device) if lazy_names(self.model) else None
        # From here on each rank draws its own random numbers (dropout, augmentation).
        rng.seed_rank(config.run.seed, self.env.rank, self.step)
        return built_streams

    def _wrap_model(self, built_streams: dict[str, Any] | None) -> list[tuple[Any, ...]]:
        """Each part an optimizer trains (the whole model, or those of `Task.updates`) wrapped
        in DDP (and torch.compile), once lazy modules have their shapes. Returns (name, part,
        DDP wrapper, what the loss calls, the task's parameter groups as it made them) per
        update."""
        config, device = self.config, self.device
        named_parts = model_parts(self.task, self.model)
        if built_streams is not None:
            by_name = dict(named_parts)
            materialise(self.model, lambda: self._first_losses(by_name), built_streams, device)
        parts = []
        for name, module in named_parts:
            groups = self.task.param_groups(module, **({} if name is None else {"update": name}))
            ddp = None
            if self.env.world_size > 1:
                # PowerSGD compresses only after the lr warmup, as its paper advises.
                ddp = wrap_ddp(module, device, config.dist, config.optim.warmup_steps)
            call = ddp or module
            if config.train.compile:
                call = torch.compile(call)
            parts.append((name, module, ddp, call, groups))
        return parts

    def _first_losses(self, parts: dict[str | None, torch.nn.Module]) -> None:
        """The task's loss of each update on the training set's first micro-batch, the same
        on every rank, with the bare model: what gives lazy modules their shapes."""
        train_set = self.train_loader.dataset
        samples = [train_set[index] for index in range(self.micro_batch_size)]
        batch = move_to_device(self.task.collate(samples), self.device)
        if None in parts:
            self.task.training_loss(self.model, batch)
            return
        model = ModelParts(self.model, parts)
        for name in parts:
            self.task.training_loss(model, batch, update=name)

    def _build_data(self) -> None:
        """The task's data sets, checked and agreed on by every rank, and their loaders; the
        steps per epoch and in the run."""
        config, train = self.config, self.config.train
        train_set, eval_set = self.task.build_datasets()
        check_datasets(train_set, eval_set)
        agree_on_data({"training set": train_set, "evaluation set": eval_set})
        workers = self._loader_workers()
        sample_seeds = self._sample_seeds(workers)
        self.train_loader, self.sampler = build_train_loader(
            train_set,
            self.env,
            config.data,
            self.micro_batch_size,
            config.run.seed,
            self.device,
            self.task.collate,
            workers,
            sample_seeds,
        )
        self.eval_loader = build_eval_loader(
            eval_set,
            self.env,
            config.data,
            train.eval_batch_size,
            config.run.seed,
            self.device,
            self.task.collate,
            workers,
        )
        # The same on any world size: step s of an epoch always trains on the same global samples.
        self.steps_per_epoch = len(train_set) // train.global_batch_size
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"the training set ({len(train_set)} samples) is smaller than one global batch "
                f"({train.global_batch_size}); lower train.global_batch_size"
            )
        self.total_steps = (
            train.max_steps if train.max_steps > 0 else train.epochs * self.steps_per_epoch
        )

    def _build_optimization(self, parts: list[tuple[Any, ...]]) -> None:
        """Per update, the task's optimizer over its groups and its schedule (AdamW and
        warmup-cosine by default) and loss scaling; mixed precision and the moving average."""
        self.autocast_dtype = AUTOCAST_DTYPES[self.config.train.mixed_precision]
        #: optim.grad_clip, read at every step.
        self.grad_clip = self.config.optim.grad_clip
        #: Mixed precision's context around every forward: built once (building a
        #: torch.autocast costs more than entering it), not re-entrant; nothing in fp32.
        self.autocast = (
            nullcontext()
            if self.autocast_dtype is None
            else torch.autocast(self.device.type, dtype=self.autocast_dtype)
        )
        self.updates = [self._build_update(*part) for part in parts]
        #: What training_loss calls in a task with updates: the parts as DDP wraps them.
        self.parts = ModelParts(
            self.model, {u.name: u.call for u in self.updates if u.name is not None}
        )
        self.ema = self._build_ema()

    def _build_update(
        self,
        name: str | None,
        module: torch.nn.Module,
        ddp: DistributedDataParallel | None,
        call: torch.nn.Module,
        groups: list[dict[str, Any]],
    ) -> Update:
        optim, train = self.config.optim, self.config.train
        keyword = {} if name is None else {"update": name}
        optimizer = build_optimizer(self.task, module, groups, optim, **keyword)
        scheduler = build_scheduler(self.task, optimizer, self.total_steps, optim, **keyword)
        return Update(
            name=name,
            module=module,
            parameters=list(module.parameters()),
            ddp=ddp,
            call=call,
            optimizer=optimizer,
            scheduler=scheduler,
            # Loss scaling only for fp16: bf16 has fp32's exponent range and needs none.
            scaler=torch.amp.GradScaler(self.device.type, enabled=train.mixed_precision == "fp16"),
            own_group_options=own_options(groups),
            as_built=as_built(self.task, optimizer, scheduler),
            loss=StepLoss(
                self.accumulation_steps,
                self.micro_batch_size,
                train.global_batch_size,
                self.device,
                log_prefix(name),
            ),
        )

    # The objects of the one update of a task without `Task.updates`.

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._only_update().optimizer

    @property
    def scheduler(self) -> LRScheduler:
        return self._only_update().scheduler

    @property
    def scaler(self) -> torch.amp.GradScaler:
        return self._only_update().scaler

    @property
    def ddp(self) -> DistributedDataParallel | None:
        return self._only_update().ddp

    def _only_update(self) -> Update:
        if len(self.updates) > 1:
            raise AttributeError(
                "the task trains its model in several updates (Task.updates): each has its own "
                "optimizer, schedule, loss scaler and DDP wrapper, in trainer.updates"
            )
        return self.updates[0]

    def _build_accounting(self) -> None:
        """What the steps keep account of: the log line's sums, the loss's scaling, the
        non-finite guard, the best checkpoint, the throughput and straggler figures, and the
        NVTX ranges of profile.nvtx."""
        train, device = self.config.train, self.device
        # What the log line reports (losses, counts, throughput units), summed since the last
        # one where it was computed: nothing in a step waits for the device. Kept in the
        # checkpoint so that resumed logs match.
        self.window = WindowSums(device)
        self.total_units = 0.0
        # fp16's loss scaler skips the steps whose gradients overflow: only its losses count.
        self.guard = DivergenceGuard(device, watch_gradients=train.mixed_precision != "fp16")
        self.skips = SkipPolicy(
            train.on_nonfinite == "skip", train.max_skipped_steps, self.env.is_main
        )
        #: Whether this launch's first step ran: it checks what a task's code can get wrong
        #: with DDP (gradients not all-reduced, exchanges in its loss under accumulation).
        self.first_step_done = False
        #: The replicas' checksums, compared in the gathers of log lines and saves.
        self.replicas = ReplicaCheck(self.model, self.updates, device)
        self.best = BestCheckpoint(self.config.best)
        #: What `_periodic` does falls on multiples of this, the intervals' greatest common
        #: divisor (or on the last step): at the other steps it has nothing to ask.
        self.periodic_every = math.gcd(
            train.log_every,
            train.eval_every,
            self.config.checkpoint.every_steps,
            self.config.dist.check_replicas_every,
        )
        self.saved_step: int | None = None
        self.meter = StepMeter(device)
        self.stragglers = Stragglers(
            device, self.env.world_size, train.straggler_threshold, train.log_every
        )
        self.ranges = StepRanges(self.config.profile, device)
        self.unit = self.task.throughput_unit
        self.units_per_micro_batch = self.micro_batch_size * self.task.units_per_sample
        self.units_per_step = train.global_batch_size * self.task.units_per_sample
        #: Whether the task counts the units of each batch itself (`Task.units`).
        self.units_of_batches = defines(self.task, "units")
        flops = self.task.flops_per_sample(self.model)
        self.flops_per_step = None if flops is None else train.global_batch_size * flops
        precision = train.mixed_precision
        if precision == "none":
            precision = "tf32" if train.tf32 and device.type == "cuda" else "fp32"
        self.peak_flops = peak_flops(device, precision, train.peak_tflops)

    def _build_checkpointer(self) -> Checkpointer:
        """The saves, the resume and the export, over the objects a checkpoint holds."""
        state = TrainingState(
            model=self.model,
            updates=self.updates,
            ema=self.ema,
            task=self.task,
            sampler=self.sampler,
            best=self.best,
            skips=self.skips,
            window=self.window,
            steps_per_epoch=self.steps_per_epoch,
            accumulation_steps=self.accumulation_steps,
        )
        return Checkpointer(
            self.config,
            self.env,
            self.device,
            self.run_dir,
            state,
            metrics=self.metrics,
            meter=self.meter,
            stop=self.stop,
            job=self.job,
            background=self.background,
        )

    def _loader_workers(self) -> int:
        """data.num_workers, resolved for the ranks of this host; `auto` says so in one line,
        and more workers than cores are warned about."""
        ranks_here = roster().ranks_on(socket.gethostname()) or self.env.world_size
        cores = usable_cores()
        workers = loader_workers(self.config.data, ranks_here, cores)
        if self.env.local_rank == 0:
            if self.config.data.num_workers == "auto":
                log.info(
                    "data.num_workers=auto: %d loader worker(s) per rank (%d usable core(s) "
                    "for %d rank(s) on %s)",
                    workers,
                    cores,
                    ranks_here,
                    socket.gethostname(),
                )
            if ranks_here * workers > cores:
                log.warning(
                    "%d rank(s) x %d loader workers on %s exceed its %d usable cores: they "
                    "compete for them; lower data.num_workers",
                    ranks_here,
                    workers,
                    socket.gethostname(),
                    cores,
                )
        return workers

    def _sample_seeds(self, workers: int) -> bool:
        """Whether the data's random draws are seeded per sample: wherever a rank loads in
        worker processes, which have no stream of the rank's, and then on every rank, so that
        hosts with other core counts (other `auto` worker counts) draw alike. A resume keeps
        what the run did (Checkpointer)."""
        counts = gather_objects(workers)
        seeded = any(counts)
        without = [rank for rank, count in enumerate(counts) if count == 0]
        if seeded and without and self.env.is_main:
            log.info(
                "%s load in the training process, the others in loader workers "
                "(data.num_workers): every rank seeds each sample's random draws alike",
                describe_ranks_on_hosts(without, roster()),
            )
        return seeded

    def _announce_batch_norm(self) -> None:
        """Batch statistics come from each rank's micro-batch: say what that means, once.
        SyncBatchNorm takes them over every rank's, which is what it is for: not counted."""
        norms = sum(
            isinstance(module, _BatchNorm) and not isinstance(module, torch.nn.SyncBatchNorm)
            for module in self.model.modules()
        )
        if norms and self.env.is_main:
            log.warning(
                "the model has %d BatchNorm layer(s): in training they normalize with the "
                "statistics of one micro-batch on one rank (%d samples here), so the training "
                "depends on the micro-batch size and the world size, unlike the rest of the "
                "step, and the running statistics of rank 0 are kept",
                norms,
                self.micro_batch_size,
            )

    def _build_ema(self) -> AveragedModel | None:
        """The weights' moving average (ema.decay > 0), updated after every optimizer step."""
        decay = self.config.ema.decay
        if decay == 0:
            return None
        return AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)

    # --- the step ---------------------------------------------------------------------------

    def train_step(self, batches: Iterator[Any]) -> dict[str, torch.Tensor]:
        """One step: the optimizer step of each update, in order (one, for most tasks), over
        the same `accumulation_steps` micro-batches; then the moving average, the non-finite
        guard's record and the schedules.

        Returns the gradient norms before clipping (as "grad_norm", or "<update>/grad_norm")
        where they are computed anyway (clipping on) or will be logged after this step.
        """
        self.stragglers.start_step(self.step + 1)
        micro_batches: Iterable[Any] = self._read_micro_batches(batches)
        if len(self.updates) > 1:  # each update trains on the same micro-batches
            micro_batches = list(micro_batches)
        norms: dict[str, torch.Tensor] = {}
        stepped: list[torch.Tensor | None] = []  # the norms of the updates that stepped
        losses: list[torch.Tensor] = []
        for update in self.updates:
            norm, skipped = self.optimizer_step(update, micro_batches)
            if norm is not None:
                norms[update.norm_name] = norm
            if not skipped:
                stepped.append(norm)
                losses += update.loss.values
        self.first_step_done = True
        if self.ema is not None and stepped:
            self.ema.update_parameters(self.model)
        self.guard.end_step(self.step + 1, losses, _one_norm(stepped), skipped=not stepped)
        for update in self.updates:
            update.scheduler.step()
        return norms

    def optimizer_step(
        self, update: Update, micro_batches: Iterable[Any]
    ) -> tuple[torch.Tensor | None, bool]:
        """One optimizer step over the step's micro-batches, in nanoGPT's shape: forward and
        backward of each (DDP all-reduces the gradients on the last only), then unscale, clip,
        step. The loss's scaling over micro-batches and ranks is losses.StepLoss's; skipping
        non-finite steps divergence.py's.

        Returns the gradient norm before clipping when it is computed (else None), and whether
        the step was skipped. Nothing in a step waits for the device (fp16's inf/nan check and
        train.on_nonfinite=skip aside). The backward that all-reduces times this rank's wait
        for the others (stragglers.py); the phases are NVTX ranges with profile.nvtx.
        """
        losses = update.loss
        losses.start()
        self.skips.keep_buffers(self.model, update.scaler)  # a skipped step puts them back
        try:
            for micro_step, batch in enumerate(micro_batches):
                last = micro_step == self.accumulation_steps - 1
                with sync_context(update, self.updates, last):
                    with self.autocast, self.ranges.forward:
                        loss = losses.add(self._training_loss(update, batch), last)
                    reduces = last and update.ddp is not None
                    with self.ranges.backward, self.stragglers.timed_backward(loss, reduces):
                        update.scaler.scale(loss).backward()
        except RuntimeError as error:
            explain_ddp_error(error)
            raise
        with self.ranges.optimizer:
            update.scaler.unscale_(update.optimizer)  # the true gradients (fp16 scales the loss)
            losses.rescale_gradients(update.parameters)
            if not self.first_step_done:  # the launch's first step
                self._check_gradients_reduced(update)
            grad_norm = self._clip_gradients(update.parameters)
            skip = self.skips.skips(self.step + 1, grad_norm, update.name)
            if not skip:
                update.scaler.step(update.optimizer)  # with fp16, skipped on every rank on inf/nan
                update.scaler.update()
                self.skips.after_scaler_step(update.scaler)
                losses.add_to(self.window)
            clear_gradients(update.optimizer)
            if len(self.updates) > 1:
                self.model.zero_grad(set_to_none=True)  # what this loss left in the other parts
        return grad_norm, skip

    def _training_loss(self, update: Update, batch: Any) -> Any:
        """The task's loss of `batch`; at a launch's first step, watched for exchanges between
        ranks, which gradient accumulation would make another loss (distributed.py)."""
        watch = _UNWATCHED
        if not self.first_step_done:
            per_rank = self.config.train.global_batch_size // self.env.world_size
            watch = exchanges_checked(self.accumulation_steps, self.split, per_rank)
        with watch:
            if update.name is None:
                return self.task.training_loss(update.call, batch)
            return self.task.training_loss(self.parts, batch, update=update.name)

    def _read_micro_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Each micro-batch of the step on the device, read as the update trains on it; the
        wait for each is the log line's data wait. Where the task counts each batch's
        throughput units (`Task.units`), they are added to the log line's window here; else
        the log line counts `units_per_sample` per sample of its steps."""
        for _ in range(self.accumulation_steps):
            waiting = time.perf_counter()
            with self.ranges.data_wait:
                batch = move_to_device(next(batches), self.device)
            self.meter.data_wait_s += time.perf_counter() - waiting
            if self.units_of_batches:
                units = self.task.units(batch)
                self.window.add("units", self.units_per_micro_batch if units is None else units)
            yield batch

    def _check_gradients_reduced(self, update: Update) -> None:
        """At the first step of a launch: did DDP all-reduce the gradients? A task whose loss
        skips DDP's forward would train every rank alone."""
        if update.ddp is not None:
            ignored = getattr(update.ddp, "parameters_to_ignore", ())
            part = "" if update.name is None else f"{update.name}."  # the model's names
            check_gradients_reduced(update.module, self.step + 1, self.device, ignored, part)

    def _clip_gradients(self, parameters: list[torch.nn.Parameter]) -> torch.Tensor | None:
        """Clip the gradients of `parameters` to optim.grad_clip (the norm before clipping); else
        the norm only when the skip policy or the next log line needs it."""
        if self.grad_clip > 0:
            return torch.nn.utils.clip_grad_norm_(parameters, self.grad_clip)
        if self.skips.enabled or self._due(self.config.train.log_every, self.step + 1):
            grads = [param.grad for param in parameters if param.grad is not None]
            return torch.nn.utils.get_total_norm(grads)
        return None

    # --- the loop ---------------------------------------------------------------------------

    def fit(self) -> int:
        """Train until `total_steps`, evaluating, logging and checkpointing on schedule.

        Returns the process exit status: 0 when finished or stopped on request, and
        stopping.EXIT_RESUMABLE when stopped by SIGTERM (with a checkpoint at the last step).
        """
        with self.stop.installed():
            if self.stop.agreed_now():  # a signal during start-up: nothing new to save
                return self._stopped()
            if self.step >= self.total_steps:
                log.info(
                    "run already complete at step %d of %d; nothing to do",
                    self.step,
                    self.total_steps,
                )
                return 0
            if self.best.exhausted:
                log.info(
                    "run stopped early at step %d (%s, no improvement in %d evaluations); "
                    "nothing to do: raise best.patience to train on",
                    self.step,
                    self.best.describe(),
                    self.best.evaluations_since,
                )
                return 0
            self._log_start()
            first_step, started = self.step, time.perf_counter()
            is_main = self.env.is_main
            show_bar = self.config.train.progress_bar and is_main
            progress = ProgressBar(self.step, self.total_steps, show_bar)
            profiler = StepProfiler(self.config.profile, self.local_dir, self.device, is_main)
            try:
                status = self._train_loop(progress, profiler)
            except Exception:
                self.checkpointer.wait_after_failure()
                raise
            finally:
                profiler.stop()
                progress.close()
        self._log_summary(first_step, time.perf_counter() - started)
        return status

    def _train_loop(self, progress: ProgressBar, profiler: StepProfiler) -> int:
        self.model.train()
        self.meter.start()
        while self.step < self.total_steps:
            epoch, step_in_epoch = divmod(self.step, self.steps_per_epoch)
            samples_per_rank_per_step = self.micro_batch_size * self.accumulation_steps
            self.sampler.set_epoch(epoch, start_index=step_in_epoch * samples_per_rank_per_step)
            batches = iter(self.train_loader)
            for _ in range(step_in_epoch, self.steps_per_epoch):
                if self.step >= self.total_steps:
                    break
                grad_norms = self.train_step(batches)
                self.step += 1
                self.meter.steps += 1
                profiler.step()
                progress.update(self.step)
                if self._periodic(epoch, grad_norms):
                    return self._stop_early()
                if self.stop.agreed_after_step():
                    self._save_once()
                    return self._stopped()
        self.stop.close()
        self._save_once()  # the last step's checkpoint, complete
        log.info("training complete at step %d", self.step)
        if self.config.checkpoint.export:
            self.checkpointer.export()
        return 0

    def _log_start(self) -> None:
        log.info(
            "training steps %d..%d: %d ranks, global batch %d = %d ranks x %d micro-batch x "
            "%d accumulation, %d steps/epoch, device %s, precision %s%s",
            self.step + 1,
            self.total_steps,
            self.env.world_size,
            self.config.train.global_batch_size,
            self.env.world_size,
            self.micro_batch_size,
            self.accumulation_steps,
            self.steps_per_epoch,
            self.device,
            self.config.train.mixed_precision,
            ", compiled" if self.config.train.compile else "",
        )
        if self.background is not None:
            log.info(
                "checkpoint.async: checkpoints are written in the background; training pauses "
                "only to copy the state to host memory"
            )

    def _stopped(self) -> int:
        arrivals = self.stop.describe_arrivals()
        log.info(
            "stopped at step %d of %d on %s%s; launch the same command again to continue from "
            "there (exit status %d)",
            self.step,
            self.total_steps,
            self.stop.reason,
            f" (received here: {arrivals})" if arrivals else "",
            self.stop.exit_status,
        )
        return self.stop.exit_status

    def _periodic(self, epoch: int, grad_norms: dict[str, torch.Tensor]) -> bool:
        """What runs between steps on schedule. Every rank takes the same branches. Returns
        whether training stops early: best.patience evaluations without improvement."""
        config = self.config
        if self.background is not None:
            self.background.poll()
        if self.step % self.periodic_every and self.step != self.total_steps:
            return False  # nothing below is due
        if config.dist.check_replicas_every and self._due(config.dist.check_replicas_every):
            self._check_replicas()
        if self._due(config.train.log_every):
            self._log_train(epoch, grad_norms)
        new_best = False
        if self._due(config.train.eval_every):
            record = {f"eval/{k}": v for k, v in self.evaluate().items()}
            if self.ema is not None:
                averaged = self.evaluate(self.ema.module, "eval (EMA)")
                record.update({f"eval_ema/{k}": v for k, v in averaged.items()})
            self.metrics.log(self.step, record)
            new_best = self.best.update(self.step, record)
        if new_best or self._due(config.checkpoint.every_steps):
            self._save_once(scheduled=True)
        return self.best.exhausted

    def _save_once(self, scheduled: bool = False) -> None:
        """Save this step, unless that is done (a stop or a new best at a scheduled save), once
        every rank's record shows only finite values (divergence.py).

        A scheduled save is written in the background with checkpoint.async. The others (a
        stop, an early stop, the end of training) are followed by the exit: they are written at
        once, and return once this step's checkpoint is complete (one in flight included).
        """
        if self.saved_step != self.step:
            models = {"": self.model}
            if self.ema is not None:
                models["the moving average"] = self.ema.module
            self.guard.check_weights(self.step, models)
            self._raise_on_checks(gather_rows(self._checks()).cpu())
            if scheduled and self.background is not None:
                self.save_in_background()
            else:
                self.save()
            self.saved_step = self.step
        if not scheduled:
            self.wait_for_save()

    def _checks(self) -> torch.Tensor:
        """This rank's share of the checks that ride in the gathers of log lines and saves:
        the non-finite guard's record and the replicas' checksum."""
        return torch.cat([self.guard.record(), self.replicas.checksum()])

    def _raise_on_checks(self, rows: torch.Tensor) -> None:
        """Stop every rank alike on what the gathered checks show (a row per rank, `_checks`'
        entries): non-finite values first, then replicas that differ (divergence.py,
        replicas.py)."""
        fields = len(self.guard.FIELDS)
        newest = latest_checkpoint(self.run_dir)
        self.guard.raise_if_diverged(rows[:, :fields], newest.name if newest else "none yet")
        self.replicas.raise_if_differ(rows[:, fields:], self.step)

    def _check_replicas(self) -> None:
        """dist.check_replicas_every: the replicas compared in a gather of their own."""
        self.replicas.raise_if_differ(gather_rows(self.replicas.checksum()).cpu(), self.step)

    def _stop_early(self) -> int:
        """best.patience evaluations without improvement: every rank stops here, with a
        checkpoint, as a finished run."""
        self._save_once()
        self.stop.close()
        log.info(
            "stopped early at step %d of %d: %s has not improved for %d evaluations (%s)",
            self.step,
            self.total_steps,
            self.config.best.metric,
            self.best.evaluations_since,
            self.best.describe(),
        )
        if self.config.checkpoint.export:
            self.checkpointer.export()
        return 0

    def _due(self, every: int, step: int | None = None) -> bool:
        """Whether something done every `every` steps is due after `step` (default: this one)."""
        step = self.step if step is None else step
        return step % every == 0 or step == self.total_steps

    def _log_train(self, epoch: int, grad_norms: dict[str, torch.Tensor]) -> None:
        window = self.meter.window()  # synchronises the device: the stragglers' row is read
        self.meter.pause()
        # One collective per log line, gathered from every rank at the same step: the sums of
        # losses, counts and units, each rank's timings, and its wait for the others in the
        # all-reduce and its GPU's readings (stragglers.py).
        names = self.window.names()
        sums = self.window.totals(names)
        timing = [window.train_s, window.data_wait_s, float(window.peak_memory)]
        local = sums.new_tensor([*timing, *self.stragglers.row()])
        # The divergence guard's record and the replicas' checksum ride along: no collective
        # of their own.
        rows = gather_rows(torch.cat([sums, local, self._checks()])).cpu()
        timings = rows[:, len(names) : len(names) + len(timing)]
        straggling = rows[:, len(names) + len(timing) : len(names) + len(local)]
        checks = rows[:, len(names) + len(local) :]
        totals = dict(zip(names, rows[:, : len(names)].sum(dim=0).tolist(), strict=True))
        units = totals["units"] if self.units_of_batches else window.steps * self.units_per_step
        self.total_units += units
        figures = window_figures(
            timings,
            window.steps,
            self.unit,
            units,
            self.flops_per_step,
            self.peak_flops,
        )
        spread, warning = self.stragglers.report(timings, straggling, window.steps)
        figures.update(spread)
        losses = window_means(totals, [update.prefix for update in self.updates])
        rates = {f"train/{u.prefix}lr": u.scheduler.get_last_lr()[0] for u in self.updates}
        norms = {f"train/{name}": norm.item() for name, norm in grad_norms.items()}
        values = {**losses, **rates, **norms}
        line = f"step {self.step}/{self.total_steps} | epoch {epoch} | "
        line += " | ".join(f"{name[6:]} {value:.4f}" for name, value in losses.items())
        line += "".join(f" | {name[6:]} {value:.2e}" for name, value in rates.items())
        line += "".join(
            f" | {name[6:].replace('_', ' ')} {value:.3f}" for name, value in norms.items()
        )
        parts = [line, describe(figures, self.unit), *describe_ranks(figures)]
        log.info("%s", " | ".join(parts))
        if warning and self.env.is_main:
            log.warning("%s", warning)
        self.metrics.log(self.step, {**values, **figures, "epoch": epoch})
        self.window.reset()
        self._raise_on_checks(checks)
        self.meter.resume()

    def _log_summary(self, first_step: int, wall_s: float) -> None:
        """One line at the end of a launch: what was done, how fast, and where the results are."""
        if not self.env.is_main:
            return
        meter = self.meter
        rate = self.total_units / max(meter.total_train_s, 1e-9)
        best = best_evaluation(read_metrics(self.local_dir), self.config.best)
        newest = latest_checkpoint(self.run_dir)
        log.info(
            "summary: steps %d..%d of %d in %.1f s (%.0f %s/s while training); %s; "
            "checkpoints in %s (newest: %s)",
            first_step + 1,
            self.step,
            self.total_steps,
            wall_s,
            rate,
            self.unit,
            best,
            checkpoint_root(self.run_dir),
            newest.name if newest else "none",
        )

    @torch.no_grad()
    def evaluate(
        self, model: torch.nn.Module | None = None, name: str = "eval"
    ) -> dict[str, float]:
        """Metrics of `model` (default: the one trained) over the whole evaluation set, each
        sample counted once across all ranks. Its time is left out of the training throughput.

        Each rank adds up the task's `evaluation_sums` in float64; the ranks agree on the
        entries (a rank may have had no batch), sum them in one all-reduce, and the task turns
        the totals into metrics (`evaluation_metrics`).
        """
        self.meter.pause()
        model = model or self.model
        model.eval()
        local: dict[str, torch.Tensor] = {}
        for batch in self.eval_loader:
            with self.autocast, collectives_refused("evaluation_sums"):
                sums = self.task.evaluation_sums(model, move_to_device(batch, self.device))
            for key, value in sums.items():
                parts = value if isinstance(value, tuple) else (value,)
                vector = torch.stack(
                    [torch.as_tensor(part, device=self.device).double() for part in parts]
                )
                local[key] = local[key] + vector if key in local else vector
        layout: dict[str, int] = {}
        mine = {key: len(value) for key, value in local.items()}
        for shapes in gather_objects(mine, step_group()):
            layout.update({key: size for key, size in shapes.items() if key not in layout})
        flat = [
            local.get(key, torch.zeros(size, dtype=torch.float64, device=self.device))
            for key, size in layout.items()
        ]
        reduced = all_reduce_sum(torch.cat(flat)).tolist() if flat else []
        totals: dict[str, Any] = {}
        for key, size in layout.items():
            values, reduced = reduced[:size], reduced[size:]
            totals[key] = values[0] if size == 1 else tuple(values)
        metrics = self.task.evaluation_metrics(totals)
        log.info(
            "%s at step %d | %s",
            name,
            self.step,
            " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
        )
        self.model.train()
        self.meter.resume()
        return metrics

    # --- checkpoints: the Checkpointer's, at this step --------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The replicated state: identical on every rank, written once by rank 0."""
        return self.checkpointer.state_dict(self.step)

    def rank_state_dict(self) -> dict[str, Any]:
        """What differs between ranks: RNG streams and this rank's share of the logging window."""
        return self.checkpointer.rank_state_dict()

    def save(self) -> Path:
        """Write a checkpoint of this step (a collective; Checkpointer.save)."""
        return self.checkpointer.save(self.step)

    def save_in_background(self) -> None:
        """Write a checkpoint of this step in a thread (checkpoint.async; a collective)."""
        self.checkpointer.save_in_background(self.step)

    def wait_for_save(self) -> None:
        """Finish the save in the background in flight, if any (Checkpointer.wait_for_save)."""
        self.checkpointer.wait_for_save()

    def resume(self) -> bool:
        """Continue from the newest checkpoint that every rank can load, if there is one (a
        collective; Checkpointer.resume); False when training starts at step 0."""
        step = self.checkpointer.resume()
        if step is None:
            return False
        self.step = self.replicas.matched_at = step  # every rank loaded the same weights
        return True

    def start_fresh(self) -> None:
        """Begin at step 0, from init.weights when set (Checkpointer.start_fresh)."""
        self.checkpointer.start_fresh()


def best_evaluation(records: list[dict[str, Any]], best: BestConfig) -> str:
    """The summary's word on evaluation: the best value of `best.metric`, or of eval/loss
    (lowest) when it is not set; a task whose metrics hold no loss is told how to name one."""
    metric = best.metric or "eval/loss"
    sign = -1 if best.metric and best.mode == "max" else 1
    found = [(sign * record[metric], record["step"]) for record in records if metric in record]
    if found:
        value, step = min(found)
        return f"best {metric} {sign * value:.4f} at step {step}"
    if any(key.startswith("eval") for record in records for key in record):
        return f"evaluated, without {metric} (best.metric names the metric to report)"
    return "no evaluation yet"


def _one_norm(norms: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The gradient norm the non-finite guard watches: the one update's, or the sum of
    several's (finite only if each is)."""
    if len(norms) == 1:
        return norms[0]
    present = [norm for norm in norms if norm is not None]
    return torch.stack(present).sum() if present else None
