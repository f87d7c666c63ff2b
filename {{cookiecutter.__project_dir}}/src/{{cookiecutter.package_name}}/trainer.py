"""The training loop: accumulation under `no_sync`, mixed precision, clipping, scheduling,
exact evaluation, checkpoints and resume.

The task (task.py) supplies data, model, loss and metrics; this module owns how a step runs.
One optimizer step consumes `accumulation_steps` micro-batches on every rank; gradients are
all-reduced once, on the last of them.
"""

from __future__ import annotations

import logging
import math
import platform
import random
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from . import __version__
from .checkpoint import checkpoint_root, latest_checkpoint, load_newest_intact, save_checkpoint
from .config import Config, ConfigError
from .data import build_eval_loader, build_train_loader
from .distributed import DistEnv, all_reduce_sum, check_replicas, gather_rows, wrap_ddp
from .logs import ProgressBar
from .metrics import MetricsLogger, read_metrics
from .profiling import StepProfiler
from .resume import (
    OPTIMIZER_SETTINGS,
    announce_world_size_change,
    apply_optimizer_settings,
    changed_settings,
    check_changes,
)
from .stopping import StopRequests
from .task import Task
from .throughput import StepMeter, describe, peak_flops, window_figures

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}
UNUSED_PARAMETERS_HINT = (
    "some parameters got no gradient in a step, so DDP never finished reducing gradients. Set "
    "dist.find_unused_parameters=true (costs a graph traversal per step), or make every "
    "parameter take part in the loss. DDP's own message follows."
)


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


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a batch (tensor, tuple, list or dict of them) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    return batch


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This rank's random number generator states (Python, torch CPU, and CUDA when used)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class Trainer:
    """Runs the optimization for one task on one rank; every rank runs the same Trainer."""

    def __init__(
        self,
        config: Config,
        task: Task,
        env: DistEnv,
        device: torch.device,
        run_dir: Path,
        metrics: MetricsLogger,
        stop: StopRequests | None = None,
    ) -> None:
        self.config = config
        self.task = task
        self.env = env
        self.device = device
        self.run_dir = run_dir
        self.metrics = metrics
        train = config.train
        self.micro_batch_size, self.accumulation_steps = batch_split(
            train.global_batch_size, train.micro_batch_size, env.world_size
        )
        checkpoint = config.checkpoint
        self.stop = stop or StopRequests(checkpoint.stop_on_signals, checkpoint.stop_check_s)
        self.step = 0

        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = train.tf32
            torch.backends.cudnn.allow_tf32 = train.tf32
        # The same seed on every rank gives the same initial weights (DDP also broadcasts rank 0's).
        torch.manual_seed(config.run.seed)
        self.model = task.build_model().to(device)
        self.ddp: DistributedDataParallel | None = None
        if env.world_size > 1:
            # PowerSGD compresses only after the lr warmup, as its paper advises.
            self.ddp = wrap_ddp(self.model, device, config.dist, config.optim.warmup_steps)
        # What the step calls: the DDP wrapper (or the bare model on one rank), maybe compiled.
        self.ddp_model: torch.nn.Module = self.ddp or self.model
        if train.compile:
            self.ddp_model = torch.compile(self.ddp_model)
        # From here on each rank draws its own random numbers (dropout, augmentation).
        self._seed_rank_streams()

        train_set, eval_set = task.build_datasets()
        self.train_loader, self.sampler = build_train_loader(
            train_set, env, config.data, self.micro_batch_size, config.run.seed, device
        )
        self.eval_loader = build_eval_loader(
            eval_set, env, config.data, train.eval_batch_size, config.run.seed, device
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

        optim = config.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            fused=device.type == "cuda",
        )
        self.scheduler = LambdaLR(
            self.optimizer,
            partial(
                warmup_cosine,
                warmup_steps=optim.warmup_steps,
                total_steps=self.total_steps,
                min_lr_ratio=optim.min_lr_ratio,
            ),
        )
        self.autocast_dtype = AUTOCAST_DTYPES[train.mixed_precision]
        # Loss scaling only for fp16: bf16 has fp32's exponent range and needs none.
        self.scaler = torch.amp.GradScaler(device.type, enabled=train.mixed_precision == "fp16")

        # The micro-batch losses since the last log line stay on the device (reading them would
        # wait for the device): listed in the step, summed in float64 only when read. Kept in
        # the checkpoint so that resumed logs match.
        self._window_losses: list[torch.Tensor] = []
        self._window_loss = torch.zeros((), dtype=torch.float64, device=device)
        self.window_steps = 0

        self.meter = StepMeter(device)
        self.unit = task.throughput_unit
        self.units_per_step = train.global_batch_size * task.units_per_sample
        self.flops_per_step = train.global_batch_size * task.flops_per_sample(self.model)
        precision = train.mixed_precision
        if precision == "none":
            precision = "tf32" if train.tf32 and device.type == "cuda" else "fp32"
        self.peak_flops = peak_flops(device, precision, train.peak_tflops)

    # --- the step ---------------------------------------------------------------------------

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(
            self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        )

    def _sync_context(self, last_micro_step: bool) -> AbstractContextManager:
        # no_sync must cover forward AND backward: DDP prepares its gradient reduction in forward.
        if last_micro_step or self.ddp is None:
            return nullcontext()
        return self.ddp.no_sync()

    def train_step(self, batches: Iterator[Any]) -> torch.Tensor | None:
        """One optimizer step over `accumulation_steps` micro-batches.

        Returns the gradient norm before clipping when it is computed anyway (clipping on) or
        will be logged after this step, else None. The losses are kept on the device for the next
        log line: nothing in a step waits for the device (fp16's inf/nan check aside).
        """
        try:
            for micro_step in range(self.accumulation_steps):
                waiting = time.perf_counter()
                batch = move_to_device(next(batches), self.device)
                self.meter.data_wait_s += time.perf_counter() - waiting
                with self._sync_context(last_micro_step=micro_step == self.accumulation_steps - 1):
                    with self.autocast():
                        loss = self.task.training_loss(self.ddp_model, batch)
                    self.scaler.scale(loss / self.accumulation_steps).backward()
                self._window_losses.append(loss.detach())
        except RuntimeError as error:
            if "find_unused_parameters" in str(error):
                raise RuntimeError(UNUSED_PARAMETERS_HINT) from error
            raise
        # Clip the true gradients: unscale first (a no-op unless fp16 loss scaling is on).
        self.scaler.unscale_(self.optimizer)
        grad_clip = self.config.optim.grad_clip
        grad_norm = None
        if grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        elif self._due(self.config.train.log_every, self.step + 1):
            grads = [param.grad for param in self.model.parameters() if param.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
        # With fp16, a step whose gradients hold inf/nan is skipped on every rank alike: the
        # gradients were all-reduced, so every rank sees the same non-finite values.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm

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
            self._log_start()
            first_step, started = self.step, time.perf_counter()
            is_main = self.env.is_main
            show_bar = self.config.train.progress_bar and is_main
            progress = ProgressBar(self.step, self.total_steps, show_bar)
            profiler = StepProfiler(self.config.profile, self.run_dir, self.device, is_main)
            try:
                status = self._train_loop(progress, profiler)
            finally:
                profiler.stop()
                progress.close()
        self._log_summary(first_step, time.perf_counter() - started)
        return status

    def _train_loop(self, progress: ProgressBar, profiler: StepProfiler) -> int:
        self.ddp_model.train()
        self.meter.start()
        while self.step < self.total_steps:
            epoch, step_in_epoch = divmod(self.step, self.steps_per_epoch)
            samples_per_rank_per_step = self.micro_batch_size * self.accumulation_steps
            self.sampler.set_epoch(epoch, start_index=step_in_epoch * samples_per_rank_per_step)
            batches = iter(self.train_loader)
            for _ in range(step_in_epoch, self.steps_per_epoch):
                if self.step >= self.total_steps:
                    break
                grad_norm = self.train_step(batches)
                self.step += 1
                self.window_steps += 1
                self.meter.steps += 1
                profiler.step()
                progress.update(self.step)
                self._periodic(epoch, grad_norm)
                if self.stop.agreed_after_step():
                    if not self._due(self.config.checkpoint.every_steps):  # else just saved
                        self.save()
                    return self._stopped()
        self.stop.close()
        log.info("training complete at step %d", self.step)
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

    def _stopped(self) -> int:
        log.info(
            "stopped at step %d of %d on %s; launch the same command again to continue from "
            "there (exit status %d)",
            self.step,
            self.total_steps,
            self.stop.reason,
            self.stop.exit_status,
        )
        return self.stop.exit_status

    def _periodic(self, epoch: int, grad_norm: torch.Tensor | None) -> None:
        """What runs between steps on schedule. Every rank takes the same branches."""
        config = self.config
        if config.dist.check_replicas_every and self._due(config.dist.check_replicas_every):
            check_replicas(self.model, self.step)
        if self._due(config.train.log_every):
            self._log_train(epoch, grad_norm)
        if self._due(config.train.eval_every):
            self.metrics.log(self.step, {f"eval/{k}": v for k, v in self.evaluate().items()})
        if self._due(config.checkpoint.every_steps):
            self.save()

    def _due(self, every: int, step: int | None = None) -> bool:
        """Whether something done every `every` steps is due after `step` (default: this one)."""
        step = self.step if step is None else step
        return step % every == 0 or step == self.total_steps

    def _log_train(self, epoch: int, grad_norm: torch.Tensor | None) -> None:
        window = self.meter.window()
        self.meter.pause()
        # One collective per log line, gathered from every rank at the same step: the loss sums
        # and each rank's timings (the spread shows stragglers).
        local = [window.train_s, window.data_wait_s, float(window.peak_memory)]
        window_loss = self.window_loss()
        values = torch.cat([window_loss.reshape(1), window_loss.new_tensor(local)])
        rows = gather_rows(values).cpu()
        micro_batches = rows.shape[0] * self.window_steps * self.accumulation_steps
        loss = float(rows[:, 0].sum()) / micro_batches
        figures = window_figures(
            rows[:, 1:],
            window.steps,
            self.unit,
            self.units_per_step,
            self.flops_per_step,
            self.peak_flops,
        )
        values = {"train/loss": loss, "train/lr": self.scheduler.get_last_lr()[0]}
        line = f"step {self.step}/{self.total_steps} | epoch {epoch} | loss {loss:.4f} | "
        line += f"lr {values['train/lr']:.2e}"
        if grad_norm is not None:
            values["train/grad_norm"] = grad_norm.item()
            line += f" | grad norm {values['train/grad_norm']:.3f}"
        log.info("%s | %s", line, describe(figures, self.unit))
        self.metrics.log(self.step, {**values, **figures, "epoch": epoch})
        self._window_loss.zero_()
        self.window_steps = 0
        self.meter.resume()

    def _log_summary(self, first_step: int, wall_s: float) -> None:
        """One line at the end of a launch: what was done, how fast, and where the results are."""
        if not self.env.is_main:
            return
        meter = self.meter
        rate = meter.total_steps * self.units_per_step / max(meter.total_train_s, 1e-9)
        evals = [
            (r["eval/loss"], r["step"]) for r in read_metrics(self.run_dir) if "eval/loss" in r
        ]
        best = "no evaluation yet"
        if evals:
            loss, step = min(evals)
            best = f"best eval loss {loss:.4f} at step {step}"
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
    def evaluate(self) -> dict[str, float]:
        """Metrics over the whole evaluation set, each sample counted once across all ranks.

        Its time is left out of the training throughput.
        """
        self.meter.pause()
        self.model.eval()
        names = (*self.task.metric_names, "count")
        totals = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        for batch in self.eval_loader:
            with self.autocast():
                sums = self.task.evaluation_sums(self.model, move_to_device(batch, self.device))
            totals += torch.stack([sums[name].double() for name in names])
        all_reduce_sum(totals)
        count = totals[-1].item()
        metrics = {
            name: (totals[i] / count).item() for i, name in enumerate(self.task.metric_names)
        }
        log.info(
            "eval at step %d | %s",
            self.step,
            " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
        )
        self.ddp_model.train()
        self.meter.resume()
        return metrics

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The replicated state: identical on every rank, written once by rank 0."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "epoch": self.step // self.steps_per_epoch,
            "step_in_epoch": self.step % self.steps_per_epoch,
            "sampler": {
                "seed": self.sampler.seed,
                "epoch": self.sampler.epoch,
                "start_index": self.sampler.start_index,
            },
            "world_size": self.env.world_size,
            "global_batch_size": self.config.train.global_batch_size,
            "config": self.config.to_dict(),
            "versions": {
                "package": __version__,
                "torch": str(torch.__version__),
                "python": platform.python_version(),
            },
        }

    def window_loss(self) -> torch.Tensor:
        """This rank's sum of the micro-batch losses since the last log line (float64)."""
        if self._window_losses:
            self._window_loss += torch.stack(self._window_losses).double().sum()
            self._window_losses.clear()
        return self._window_loss

    def rank_state_dict(self) -> dict[str, Any]:
        """What differs between ranks: RNG streams and this rank's share of the logging window."""
        return {
            "rank": self.env.rank,
            "rng": capture_rng(self.device),
            "window_loss": self.window_loss(),
            "window_steps": self.window_steps,
        }

    def save(self) -> Path:
        """Write a checkpoint of this step (a collective); its time is left out of throughput."""
        self.meter.pause()
        path = save_checkpoint(
            self.run_dir,
            self.step,
            self.state_dict(),
            self.rank_state_dict(),
            self.env,
            keep_last=self.config.checkpoint.keep_last,
        )
        self.metrics.flush()  # the records up to this step may now reach the tracker
        log.info("saved checkpoint %s", path)
        self.meter.resume()
        return path

    def resume(self) -> bool:
        """Continue from the newest checkpoint that every rank can load, if there is one.

        A collective. Settings changed since the checkpoint are refused or applied (resume.py);
        on another number of ranks, the per-rank random streams are derived afresh.
        """
        loaded = load_newest_intact(self.run_dir, self.env)
        if loaded is None:
            self.metrics.truncate_after(0)  # a run that died before its first checkpoint
            return False
        state, announce = loaded.state, self.env.is_main
        changes = changed_settings(state["config"], self.config.to_dict())
        check_changes(changes, loaded.path, announce)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # empty when saved without fp16 loss scaling
            self.scaler.load_state_dict(state["scaler"])
        if changes.keys() & OPTIMIZER_SETTINGS:
            apply_optimizer_settings(self.optimizer, self.scheduler, self.config.optim)
        self.step = state["step"]
        if loaded.rank_state is not None:
            restore_rng(loaded.rank_state["rng"], self.device)
            self._window_loss = loaded.rank_state["window_loss"].to(self.device)
            self.window_steps = loaded.rank_state["window_steps"]
        else:
            announce_world_size_change(loaded.world_size, self.env.world_size, announce)
            self._seed_rank_streams()
        self.metrics.truncate_after(self.step)
        log.info("resumed from %s at step %d", loaded.path, self.step)
        return True

    def _seed_rank_streams(self) -> None:
        """This rank's own random streams (dropout, augmentation), from the seed, rank and step."""
        seed = self.config.run.seed + self.env.rank + self.step * 1_000_003
        random.seed(seed)
        torch.manual_seed(seed)
