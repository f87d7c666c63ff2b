"""Mixed precision: loss scaling, clipping on true gradients, and skipped steps on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.training import rng

from ..helpers import FAST, UPDATES, env_for, make_trainer, spawn

#: Steps the fp16 test takes again at most: the scale falls from 65536 to 1.
MAX_SCALE_HALVINGS = 17


def _first_step_grad_norm(run_dir: Path, precision: str) -> float:
    """The gradient norm of the first step (of its first update, in a task with updates).

    Under fp16 a step whose scaled gradients overflow is skipped by the loss scaler, which
    halves its scale (GradScaler starts at 65536: a loss with large gradients overflows it);
    the weights are then unchanged, and the step is taken again on the same micro-batches with
    the same random draws, until one is not skipped."""
    config = load_config(
        None,
        [*FAST, f"run.dir={run_dir}", f"train.mixed_precision={precision}", "optim.grad_clip=1e9"],
    )
    trainer = make_trainer(config)
    streams = rng.capture(trainer.device)
    for _ in range(MAX_SCALE_HALVINGS):
        rng.restore(streams, trainer.device)
        trainer.sampler.set_epoch(0)
        norm = next(iter(trainer.train_step(iter(trainer.train_loader)).values()))
        if norm.isfinite():
            return norm.item()
    pytest.fail(f"the loss scaler skipped {MAX_SCALE_HALVINGS} steps in a row")


def test_fp16_clips_the_unscaled_gradients(tmp_path: Path) -> None:
    """The norm that clipping sees under fp16 is the true one, not the one times the loss scale."""
    fp16 = _first_step_grad_norm(tmp_path / "fp16", "fp16")
    fp32 = _first_step_grad_norm(tmp_path / "fp32", "none")
    assert fp16 == pytest.approx(fp32, rel=0.05)


class InfOnRankOne(Task):
    """Rank 1's loss becomes inf at its `poisoned_call`th call."""

    def __init__(self, *args: object, rank: int, poisoned_call: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank
        self.poisoned_call = poisoned_call
        self.calls = 0

    def training_loss(self, model: torch.nn.Module, batch: object, **update: str) -> object:
        self.calls += 1
        loss = super().training_loss(model, batch, **update)
        if self.rank == 1 and self.calls == self.poisoned_call:
            return times_inf(loss)
        return loss


def times_inf(loss: object) -> object:
    """The loss times inf, in whichever form the task returns it (a mean, a pair, a dict)."""
    if isinstance(loss, tuple):
        return (loss[0] * float("inf"), *loss[1:])
    if isinstance(loss, dict):
        return {**loss, "loss": loss["loss"] * float("inf")}
    return loss * float("inf")


def _step_with_inf_on_rank_one(rank: int, world_size: int, run_dir: Path) -> dict:
    config = load_config(None, [*FAST, f"run.dir={run_dir}", "train.mixed_precision=fp16"])
    task = InfOnRankOne(config.task, seed=config.run.seed, rank=rank, poisoned_call=0)
    trainer = make_trainer(config, env_for(rank, world_size), task)
    # The first micro-batch of the second step (of its first update, in a task with updates).
    task.poisoned_call = max(1, len(UPDATES)) * trainer.accumulation_steps + 1
    update = trainer.updates[0]
    optimizer_steps: list[int] = []
    update.optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(trainer.step))
    trainer.sampler.set_epoch(0)
    batches = iter(trainer.train_loader)
    trainer.train_step(batches)
    before = {name: tensor.clone() for name, tensor in update.module.state_dict().items()}
    scale_before = update.scaler.get_scale()
    trainer.train_step(batches)
    return {
        "before": before,
        "after": update.module.state_dict(),
        "parameters": dict(update.module.named_parameters()),
        "scales": (scale_before, update.scaler.get_scale()),
        "optimizer_steps": len(optimizer_steps),
    }


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_inf_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    """All ranks skip the step, halve the scale, and keep identical weights; each keeps its
    buffers as they were (BatchNorm's statistics are each rank's own)."""
    results = spawn(2, _step_with_inf_on_rank_one, tmp_path / "run", workdir=tmp_path)
    for result in results:
        for name, tensor in result["before"].items():
            assert torch.equal(tensor, result["after"][name]), name
        scale_before, scale_after = result["scales"]
        assert scale_after == scale_before / 2
        assert result["optimizer_steps"] == 1
    for name, tensor in results[0]["parameters"].items():
        assert torch.equal(tensor, results[1]["parameters"][name]), name
