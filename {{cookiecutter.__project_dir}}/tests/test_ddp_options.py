"""DDP settings on 2 gloo ranks: gradient compression, unused parameters, buffers, compile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from {{ cookiecutter.package_name }}.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.task import Task

from .helpers import FAST, env_for, make_trainer, spawn, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

STEPS = 6


def _weights(rank: int, world_size: int, run_dir: Path, *overrides: str) -> dict:
    settings = [*FAST, f"run.dir={run_dir}", "optim.warmup_steps=2", *overrides]
    config = load_config(None, settings)
    return train_steps(make_trainer(config, env_for(rank, world_size)), STEPS)


def _each_hook(rank: int, world_size: int, run_dir: Path) -> dict:
    """Weights after the same steps with each communication hook that gloo supports."""
    hooks = ("none", "fp16", "powersgd")
    return {
        hook: _weights(rank, world_size, run_dir / hook, f"dist.comm_hook={hook}") for hook in hooks
    }


@pytest.fixture(scope="module")
def hook_weights(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    workdir = tmp_path_factory.mktemp("hooks")
    return spawn(2, _each_hook, workdir / "run", workdir=workdir)


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_replicas_stay_identical_with_a_communication_hook(hook_weights: list, hook: str) -> None:
    for name, tensor in hook_weights[0][hook].items():
        assert torch.equal(tensor, hook_weights[1][hook][name]), name


def test_fp16_compression_trains_almost_as_plain_all_reduce(hook_weights: list) -> None:
    plain, fp16 = hook_weights[0]["none"], hook_weights[0]["fp16"]
    assert any(not torch.equal(plain[name], fp16[name]) for name in plain)  # the hook ran
    for name, tensor in plain.items():
        torch.testing.assert_close(fp16[name], tensor, rtol=0, atol=1e-3, msg=name)


def test_powersgd_sends_a_low_rank_approximation_after_the_warmup(hook_weights: list) -> None:
    plain, powersgd = hook_weights[0]["none"], hook_weights[0]["powersgd"]
    differing = [name for name in plain if not torch.equal(plain[name], powersgd[name])]
    assert differing and all(powersgd[name].isfinite().all() for name in powersgd)


def _bf16_hook(rank: int, world_size: int, run_dir: Path) -> str:
    with pytest.raises(ConfigError) as error:
        _weights(rank, world_size, run_dir, "dist.comm_hook=bf16")
    return str(error.value)


def test_bf16_compression_without_nccl_is_refused_with_the_alternative(tmp_path: Path) -> None:
    message = spawn(2, _bf16_hook, tmp_path / "run", workdir=tmp_path)[0]
    assert "needs the NCCL backend" in message and "dist.comm_hook=fp16" in message


class UnusedLayerTask(Task):
    """A model with a layer that never takes part in the loss."""

    def build_model(self) -> nn.Module:
        model = super().build_model()
        model.unused = nn.Linear(4, 4)
        return model


def _unused_layer(rank: int, world_size: int, run_dir: Path, *overrides: str) -> str:
    config = load_config(None, [*FAST, f"run.dir={run_dir}", *overrides])
    trainer = make_trainer(config, env_for(rank, world_size), UnusedLayerTask(config.task, 1))
    try:
        train_steps(trainer, 2)
    except RuntimeError as error:
        return str(error)
    return "trained"


def test_a_parameter_without_gradient_gets_a_hint_naming_the_setting(tmp_path: Path) -> None:
    messages = spawn(2, _unused_layer, tmp_path / "run", workdir=tmp_path)
    assert all("dist.find_unused_parameters=true" in message for message in messages)


def test_find_unused_parameters_trains_such_a_model(tmp_path: Path) -> None:
    setting = "dist.find_unused_parameters=true"
    assert spawn(2, _unused_layer, tmp_path / "run", setting, workdir=tmp_path) == ["trained"] * 2


def _buffer_sync(rank: int, world_size: int, run_dir: Path) -> list[bool]:
    synced = []
    for value in ("true", "false"):
        settings = [*FAST, f"run.dir={run_dir / value}", f"dist.broadcast_buffers={value}"]
        trainer = make_trainer(load_config(None, settings), env_for(rank, world_size))
        synced.append(trainer.ddp.broadcast_buffers)
    return synced


def test_broadcast_buffers_reaches_ddp(tmp_path: Path) -> None:
    assert spawn(2, _buffer_sync, tmp_path / "run", workdir=tmp_path)[0] == [True, False]


def _compiled_and_eager(rank: int, world_size: int, run_dir: Path) -> dict:
    """Weights and the number of all-reduces, eager and compiled, with 2 micro-batches a step."""
    results = {}
    for compile_ in ("false", "true"):
        settings = [
            *FAST,
            f"run.dir={run_dir / compile_}",
            f"train.compile={compile_}",
            "train.global_batch_size=32",
            "train.micro_batch_size=8",
            "task.dropout=0.0",  # compiled code draws its dropout masks from another stream
        ]
        trainer = make_trainer(load_config(None, settings), env_for(rank, world_size))
        reductions = []

        # DDP checks a hook's annotations against its own types: leave this one unannotated.
        def counting_allreduce(state, bucket, reductions=reductions):
            reductions.append(bucket.index())
            return default_hooks.allreduce_hook(None, bucket)

        trainer.ddp.register_comm_hook(None, counting_allreduce)
        results[compile_] = (train_steps(trainer, STEPS), len(reductions))
    return results


@pytest.mark.timeout(600)
def test_a_compiled_model_trains_like_the_eager_one_under_ddp(tmp_path: Path) -> None:
    """Same weights, and no_sync still holds: as few all-reduces as in eager mode."""
    results = spawn(2, _compiled_and_eager, tmp_path / "run", workdir=tmp_path, timeout=540)
    eager, eager_reductions = results[0]["false"]
    compiled, compiled_reductions = results[0]["true"]
    assert compiled_reductions == eager_reductions
    assert set(compiled) == set(eager)  # checkpoints hold the plain module's names
    for name, tensor in eager.items():
        torch.testing.assert_close(compiled[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(results[1]["true"][0][name], compiled[name]), name
