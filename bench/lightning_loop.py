"""The rendered project's training done by PyTorch Lightning's Trainer, for comparison.

Same model (`Task.build_model()`), seeds, samples and order (the project's training loader),
AdamW, warmup-cosine schedule, clipping and accumulation as the project's Trainer; fp32, the DDP
strategy, logging, checkpointing, progress bar and model summary off. Imported by
side_by_side.py; run as a script under torchrun it times the launch instead: it writes the
wall-clock time at which the first optimizer step was done to `--first-step-file`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from ddp_project.cluster.distributed import DistEnv, detect_env
from ddp_project.config import Config, load_config
from ddp_project.contract import warmup_cosine
from ddp_project.loading.data import build_train_loader
from ddp_project.task import Task
from ddp_project.training.trainer import batch_split
from pytorch_lightning.strategies import DDPStrategy
from torch.optim.lr_scheduler import LambdaLR


class LitTask(pl.LightningModule):
    """The project's Task as a LightningModule."""

    def __init__(self, task: Task, config: Config) -> None:
        super().__init__()
        self.task, self.optim, self.total_steps = task, config.optim, config.train.max_steps
        torch.manual_seed(config.run.seed)  # the same initial weights as the project's Trainer
        self.model = task.build_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.task.training_loss(self.model, batch)

    def configure_optimizers(self) -> dict:
        optim = self.optim
        optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
        )
        schedule = partial(
            warmup_cosine,
            warmup_steps=optim.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=optim.min_lr_ratio,
        )
        scheduler = {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class AfterEachStep(pl.Callback):
    """Calls `action` once per optimizer step, after it (not after every micro-batch)."""

    def __init__(self, action: Any) -> None:
        self.action = action
        self.steps = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.steps:
            self.steps = trainer.global_step
            self.action()


def run_lightning(config: Config, env: DistEnv, after_step: Any) -> dict[str, torch.Tensor]:
    """Train `config.train.max_steps` steps with Lightning; returns the final weights."""
    train, seed = config.train, config.run.seed
    micro, accumulation = batch_split(
        train.global_batch_size, train.micro_batch_size, env.world_size
    )
    task = Task(config.task, seed=seed)
    module = LitTask(task, config)
    random.seed(seed + env.rank)  # each rank's own dropout, as in the project's Trainer
    torch.manual_seed(seed + env.rank)
    train_set, _ = task.build_datasets()
    loader, _ = build_train_loader(train_set, env, config.data, micro, seed, torch.device("cpu"))
    strategy = DDPStrategy(
        process_group_backend="gloo",
        bucket_cap_mb=config.dist.bucket_cap_mb,
        find_unused_parameters=config.dist.find_unused_parameters,
        static_graph=config.dist.static_graph,
        gradient_as_bucket_view=True,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=env.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        precision="32-true",
        max_steps=train.max_steps,
        accumulate_grad_batches=accumulation,
        gradient_clip_val=config.optim.grad_clip,
        gradient_clip_algorithm="norm",
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # the project's sampler, as in the other loops
        callbacks=[AfterEachStep(after_step)],
    )
    trainer.fit(module, train_dataloaders=loader)
    return {name: value.detach().clone() for name, value in module.model.state_dict().items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--first-step-file", type=Path, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load_config(args.config, [*args.overrides, "train.max_steps=2"])
    env = detect_env()

    def record_first_step() -> None:
        if not args.first_step_file.exists() and env.is_main:
            args.first_step_file.write_text(f"{time.time()}\n")

    run_lightning(config, env, record_first_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
