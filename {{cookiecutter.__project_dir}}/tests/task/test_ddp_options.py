"""DDP settings on 2 gloo ranks: gradient compression, unused parameters, buffers, compile."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from {{ cookiecutter.package_name }}.checkpointing.layout import complete_checkpoints
from {{ cookiecutter.package_name }}.cluster.distributed import ReplicaMismatchError
from {{ cookiecutter.package_name }}.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.task import Task

from ..helpers import (
    FAST,
    UPDATES,
    Float64Task,
    accumulates,
    env_for,
    first_part,
    flat_grads,
    inner_modules,
    make_trainer,
    run_torchrun,
    spawn,
    train_steps,
    write_fault_entry,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

STEPS = 6


def _training(
    rank: int,
    world_size: int,
    run_dir: Path,
    *overrides: str,
    hook: object = None,
    task_class: type[Task] = Task,
) -> dict:
    """The all-reduced gradients of the first step, and the weights after STEPS steps, all of
    them and the parameters alone: what DDP keeps identical on every rank (a BatchNorm's
    running statistics are each rank's own).

    Runs are compared on the first step's gradients, where both start from the same weights:
    after a few AdamW steps, rounding in gradients near zero grows to the size of the lr.
    `hook` replaces DDP's all-reduce (to count them).
    """
    config = load_config(None, [*FAST, f"run.dir={run_dir}", "optim.warmup_steps=2", *overrides])
    task = task_class(config.task, seed=config.run.seed)
    trainer = make_trainer(config, env_for(rank, world_size), task)
    grads: list[torch.Tensor] = []
    for update in trainer.updates:
        if hook is not None:
            update.ddp.register_comm_hook(None, hook)
        update.optimizer.register_step_pre_hook(
            lambda *_, part=update.module: grads.append(flat_grads(part))
        )
    weights = train_steps(trainer, STEPS)
    parameters = {name: weights[name] for name, _ in trainer.model.named_parameters()}
    first_grads = torch.cat(grads[: len(trainer.updates)])
    return {"first_grads": first_grads, "weights": weights, "parameters": parameters}


class UnusedLayerTask(Task):
    """A model with a parameter that never takes part in the loss (a parameter, not a layer: a
    layer added to an nn.Sequential would run in its forward)."""

    def build_model(self) -> nn.Module:
        model = super().build_model()
        first_part(model).register_parameter("unused", nn.Parameter(torch.zeros(4, 4)))
        return model


class BypassingTask(Task):
    """A loss that calls the inner module, as `getattr(model, "module", model)` does: no
    gradient is all-reduced."""

    def training_loss(self, model: nn.Module, batch: Any, **update: str) -> Any:
        return super().training_loss(inner_modules(model), batch, **update)


def _unused_layer(rank: int, world_size: int, run_dir: Path, *overrides: str) -> str:
    config = load_config(None, [*FAST, f"run.dir={run_dir}", *overrides])
    trainer = make_trainer(config, env_for(rank, world_size), UnusedLayerTask(config.task, seed=1))
    try:
        train_steps(trainer, 2)
    except RuntimeError as error:
        return str(error)
    return "trained"


def _each_setting(rank: int, world_size: int, run_dir: Path) -> dict:
    """Every DDP setting below in one process group (starting one costs seconds)."""
    hooks = ("none", "fp16", "powersgd")
    runs: dict = {
        hook: _training(rank, world_size, run_dir / hook, f"dist.comm_hook={hook}")
        for hook in hooks
    }
    # One micro-batch per rank and step (32 over 2 ranks): DDP's static graph needs it.
    for graph, static in (("static", "true"), ("dynamic", "false")):
        settings = (f"dist.static_graph={static}", "train.micro_batch_size=16")
        runs[f"{graph}_graph"] = _training(rank, world_size, run_dir / graph, *settings)
    with pytest.raises(ConfigError) as bf16_error:
        _training(rank, world_size, run_dir / "bf16", "dist.comm_hook=bf16")
    runs["bf16"] = str(bf16_error.value)
    runs["buffer_sync"] = []
    for value in ("true", "false"):
        settings = [*FAST, f"run.dir={run_dir / value}", f"dist.broadcast_buffers={value}"]
        trainer = make_trainer(load_config(None, settings), env_for(rank, world_size))
        runs["buffer_sync"].append(trainer.updates[0].ddp.broadcast_buffers)
    try:
        _training(rank, world_size, run_dir / "bypass", task_class=BypassingTask)
        runs["bypass"] = "trained"
    except ReplicaMismatchError as error:
        runs["bypass"] = str(error)
    setting = "dist.find_unused_parameters=true"
    runs["unused_allowed"] = _unused_layer(rank, world_size, run_dir / "allowed", setting)
    # Last, so that nothing else runs after DDP's failed gradient reduction.
    runs["unused"] = _unused_layer(rank, world_size, run_dir / "unused")
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    workdir = tmp_path_factory.mktemp("settings")
    return spawn(2, _each_setting, workdir / "run", workdir=workdir)


def _assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Equal up to `rtol` of the largest gradient: near-zero entries carry only rounding."""
    atol = rtol * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_replicas_stay_identical_with_a_communication_hook(runs: list, hook: str) -> None:
    for name, tensor in runs[0][hook]["parameters"].items():
        assert torch.equal(tensor, runs[1][hook]["parameters"][name]), name


def test_fp16_compression_sends_the_gradients_to_fp16_precision(runs: list) -> None:
    plain, fp16 = runs[0]["none"]["first_grads"], runs[0]["fp16"]["first_grads"]
    assert not torch.equal(plain, fp16)  # the hook ran
    _assert_close_to_scale(fp16, plain, rtol=2e-3)  # fp16 keeps 11 significant bits


def test_powersgd_sends_a_low_rank_approximation_after_the_warmup(runs: list) -> None:
    plain, powersgd = runs[0]["none"]["weights"], runs[0]["powersgd"]["weights"]
    differing = [name for name in plain if not torch.equal(plain[name], powersgd[name])]
    assert differing and all(powersgd[name].isfinite().all() for name in powersgd)


def test_a_static_graph_with_one_micro_batch_per_step_keeps_the_replicas_alike(runs: list) -> None:
    """With gradient accumulation it is refused (test_config.py); without, the gradients are
    all-reduced at every step as they are without it."""
    static = [rank["static_graph"] for rank in runs]
    for name, tensor in static[0]["parameters"].items():
        assert torch.equal(tensor, static[1]["parameters"][name]), name
    dynamic = runs[0]["dynamic_graph"]["first_grads"]
    _assert_close_to_scale(static[0]["first_grads"], dynamic, rtol=1e-6)


def test_bf16_compression_without_nccl_is_refused_with_the_alternative(runs: list) -> None:
    message = runs[0]["bf16"]
    assert "needs the NCCL backend" in message and "dist.comm_hook=fp16" in message


def test_a_loss_that_skips_ddp_s_forward_stops_every_rank_at_the_first_step(runs: list) -> None:
    """Each rank would train on its own gradients to the end of the run."""
    for rank in runs:
        assert "step 1: the gradients of" in rank["bypass"], rank["bypass"]
        assert "DDP did not all-reduce them" in rank["bypass"]
        assert "getattr(model, 'module', model)" in rank["bypass"]


#: A fault entry (helpers.write_fault_entry): the task's loss calls the inner module.
THROUGH_THE_INNER_MODULE = f"""
from types import SimpleNamespace
from typing import Any

from {{ cookiecutter.package_name }}.task import Task

UPDATES = {UPDATES!r}
{inspect.getsource(inner_modules)}
training_loss = Task.training_loss


def through_the_inner_module(self, model, batch, **update):
    return training_loss(self, inner_modules(model), batch, **update)


Task.training_loss = through_the_inner_module
"""


@pytest.mark.faults
def test_a_launch_whose_loss_skips_ddp_s_forward_exits_2_naming_the_cause(tmp_path: Path) -> None:
    """Under torchrun, as users launch: status 2 (change the code, not the launch), the cause
    in the log, no checkpoint."""
    entry = write_fault_entry(tmp_path, THROUGH_THE_INNER_MODULE)
    run_dir = tmp_path / "run"
    result = run_torchrun(2, [*FAST, f"run.dir={run_dir}", "train.max_steps=4"], entry=entry)
    assert re.search(r"exitcode\s*:\s*2\b", result.stderr), result.stderr[-4000:]
    assert "DDP did not all-reduce them" in result.stderr
    assert "GradientsNotReducedError" not in result.stderr  # a message, not a traceback
    assert not complete_checkpoints(run_dir)


def test_a_parameter_without_gradient_gets_a_hint_naming_the_setting(runs: list) -> None:
    assert all("dist.find_unused_parameters=true" in rank["unused"] for rank in runs)


def test_find_unused_parameters_trains_such_a_model(runs: list) -> None:
    assert [rank["unused_allowed"] for rank in runs] == ["trained"] * 2


def test_broadcast_buffers_reaches_ddp(runs: list) -> None:
    assert runs[0]["buffer_sync"] == [True, False]


def _compiled_and_eager(rank: int, world_size: int, run_dir: Path) -> dict:
    """First-step gradients and the number of all-reduces, eager and compiled, with 2
    micro-batches a step."""
    results = {}
    for compile_ in ("false", "true"):
        settings = [
            f"train.compile={compile_}",
            "train.global_batch_size=32",
            "train.micro_batch_size=8",
        ]
        reductions = []

        # DDP checks a hook's annotations against its own types: leave this one unannotated.
        def counting_allreduce(state, bucket, reductions=reductions):
            reductions.append(bucket.index())
            return default_hooks.allreduce_hook(None, bucket)

        # Eval mode (no dropout): compiled code draws its dropout masks from another stream.
        outcome = _training(
            rank,
            world_size,
            run_dir / compile_,
            *settings,
            hook=counting_allreduce,
            task_class=Float64Task,
        )
        results[compile_] = (outcome, len(reductions))
    return results


@accumulates
@pytest.mark.timeout(600)
def test_a_compiled_model_trains_like_the_eager_one_under_ddp(tmp_path: Path) -> None:
    """The same gradients, and no_sync still holds: as few all-reduces as in eager mode."""
    results = spawn(2, _compiled_and_eager, tmp_path / "run", workdir=tmp_path, timeout=540)
    eager, eager_reductions = results[0]["false"]
    compiled, compiled_reductions = results[0]["true"]
    assert compiled_reductions == eager_reductions
    assert set(compiled["weights"]) == set(eager["weights"])  # the plain module's names
    _assert_close_to_scale(compiled["first_grads"], eager["first_grads"], rtol=1e-4)
    for name, tensor in compiled["parameters"].items():
        assert torch.equal(results[1]["true"][0]["parameters"][name], tensor), name
