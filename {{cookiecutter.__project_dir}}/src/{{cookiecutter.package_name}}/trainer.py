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
from .checkpoint import load_newest_intact, save_checkpoint
from .config import Config, ConfigError
from .data import build_eval_loader, build_train_loader
from .distributed import DistEnv, all_reduce_sum, check_replicas
from .metrics import MetricsLogger
from .resume import (
    OPTIMIZER_SETTINGS,
    announce_world_size_change,
    apply_optimizer_settings,
    changed_settings,
    check_changes,
)
from .stopping import StopRequests
from .task import Task

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


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

        # The same seed on every rank gives the same initial weights (DDP also broadcasts rank 0's).
        torch.manual_seed(config.run.seed)
        self.model = task.build_model().to(device)
        self.ddp_model = self._wrap(self.model)
        # From here on each rank draws its own random numbers (dropout, augmentation).
        self._seed_rank_streams()

        train_set, eval_set = task.build_datasets()
        self.train_loader, self.sampler = build_train_loader(
            train_set, env, config.data, self.micro_batch_size, config.run.seed, device
        )
        self.eval_loader = build_eval_loader(
            eval_set, env, config.data, train.micro_batch_size, config.run.seed, device
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

        # Train-loss sums since the last log line; kept in the checkpoint so resumed logs match.
        self.window_loss = torch.zeros((), dtype=torch.float64, device=device)
        self.window_steps = 0
        self.window_start = time.perf_counter()

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.env.world_size == 1:
            return model
        dist_config = self.config.dist
        return DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=dist_config.bucket_cap_mb,
            find_unused_parameters=dist_config.find_unused_parameters,
            static_graph=dist_config.static_graph,
            gradient_as_bucket_view=True,
        )

    # --- the step ---------------------------------------------------------------------------

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(
            self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        )

    def _sync_context(self, last_micro_step: bool) -> AbstractContextManager:
        # no_sync must cover forward AND backward: DDP prepares its gradient reduction in forward.
        if last_micro_step or not isinstance(self.ddp_model, DistributedDataParallel):
            return nullcontext()
        return self.ddp_model.no_sync()

    def train_step(self, batches: Iterator[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `accumulation_steps` micro-batches: (mean loss, grad norm)."""
        self.ddp_model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for micro_step in range(self.accumulation_steps):
            batch = move_to_device(next(batches), self.device)
            with self._sync_context(last_micro_step=micro_step == self.accumulation_steps - 1):
                with self.autocast():
                    loss = self.task.training_loss(self.ddp_model, batch)
                self.scaler.scale(loss / self.accumulation_steps).backward()
            loss_sum += loss.detach()
        # Clip the true gradients: unscale first (a no-op unless fp16 loss scaling is on).
        self.scaler.unscale_(self.optimizer)
        grad_clip = self.config.optim.grad_clip
        if grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        else:
            grad_norm = torch.zeros((), device=self.device)
        # With fp16, a step whose gradients hold inf/nan is skipped on every rank alike: the
        # gradients were all-reduced, so every rank sees the same non-finite values.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_sum / self.accumulation_steps, grad_norm

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
            self.window_start = time.perf_counter()
            while self.step < self.total_steps:
                epoch, step_in_epoch = divmod(self.step, self.steps_per_epoch)
                samples_per_rank_per_step = self.micro_batch_size * self.accumulation_steps
                self.sampler.set_epoch(epoch, start_index=step_in_epoch * samples_per_rank_per_step)
                batches = iter(self.train_loader)
                for _ in range(step_in_epoch, self.steps_per_epoch):
                    if self.step >= self.total_steps:
                        break
                    loss, grad_norm = self.train_step(batches)
                    self.step += 1
                    self.window_loss += loss
                    self.window_steps += 1
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
            "%d accumulation, %d steps/epoch, device %s, precision %s",
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

    def _periodic(self, epoch: int, grad_norm: torch.Tensor) -> None:
        """What runs between steps on schedule. Every rank takes the same branches."""
        config = self.config
        if config.dist.check_replicas_every and self._due(config.dist.check_replicas_every):
            check_replicas(self.model, self.step)
        if self._due(config.train.log_every):
            self._log_train(epoch, grad_norm, time.perf_counter() - self.window_start)
            self.window_start = time.perf_counter()
        if self._due(config.train.eval_every):
            self.metrics.log(self.step, {f"eval/{k}": v for k, v in self.evaluate().items()})
        if self._due(config.checkpoint.every_steps):
            self.save()

    def _due(self, every: int) -> bool:
        return self.step % every == 0 or self.step == self.total_steps

    def _log_train(self, epoch: int, grad_norm: torch.Tensor, elapsed: float) -> None:
        # Every rank reaches this at the same step, so the all-reduce is safe here.
        window = torch.stack(
            [self.window_loss, torch.tensor(float(self.window_steps), device=self.device).double()]
        )
        all_reduce_sum(window)
        loss = (window[0] / window[1]).item()
        samples = self.window_steps * self.config.train.global_batch_size
        values = {
            "train/loss": loss,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/grad_norm": grad_norm.item(),
            "train/samples_per_s": samples / elapsed,
            "train/step_time_s": elapsed / self.window_steps,
            "epoch": epoch,
        }
        log.info(
            "step %d/%d | epoch %d | loss %.4f | lr %.2e | %.0f samples/s",
            self.step,
            self.total_steps,
            epoch,
            loss,
            values["train/lr"],
            values["train/samples_per_s"],
        )
        self.metrics.log(self.step, values)
        self.window_loss.zero_()
        self.window_steps = 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Metrics over the whole evaluation set, each sample counted once across all ranks."""
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

    def rank_state_dict(self) -> dict[str, Any]:
        """What differs between ranks: RNG streams and this rank's share of the logging window."""
        return {
            "rank": self.env.rank,
            "rng": capture_rng(self.device),
            "window_loss": self.window_loss,
            "window_steps": self.window_steps,
        }

    def save(self) -> Path:
        path = save_checkpoint(
            self.run_dir,
            self.step,
            self.state_dict(),
            self.rank_state_dict(),
            self.env,
            keep_last=self.config.checkpoint.keep_last,
        )
        log.info("saved checkpoint %s", path)
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
            self.window_loss = loaded.rank_state["window_loss"].to(self.device)
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
