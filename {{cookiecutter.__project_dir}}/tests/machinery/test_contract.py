"""The Task contract (contract.py) holds for tasks unlike the shipped example (tests/tasks.py):
what a task may define is used, what it lacks has a default, a task written for the first
release still trains and resumes bitwise, models DDP does not take as they are (lazy modules,
a block checkpointed twice, a compiled model) train or are refused in our words, and a
collective in evaluation is refused by name, and so is one in the training loss under gradient
accumulation."""

from __future__ import annotations

import logging
import re
import shutil
import threading
import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
import torch.distributed.nn.functional as distributed_autograd
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import IterableDataset

from {{ cookiecutter.package_name }} import train
from {{ cookiecutter.package_name }}.checkpointing import weights
from {{ cookiecutter.package_name }}.checkpointing.layout import latest_checkpoint
from {{ cookiecutter.package_name }}.checkpointing.resume import ResumeError
from {{ cookiecutter.package_name }}.checkpointing.weights import (
    WeightsError,
    export_weights,
    load_initial_weights,
    load_model,
    plain_state_dict,
)
from {{ cookiecutter.package_name }}.cluster.distributed import (
    CollectiveInEvaluationError,
    CollectiveInLossError,
    GradientsNotReducedError,
    collectives_noted,
    collectives_refused,
)
from {{ cookiecutter.package_name }}.config import Config, ConfigError, load_config, to_yaml
from {{ cookiecutter.package_name }}.contract import ContractError, FactorLR, adopt, warmup_cosine
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import FAST, env_for, make_trainer, spawn, train_steps
from ..tasks import (
    CheckpointedTwiceTask,
    CompiledTask,
    FirstReleaseTask,
    LazyTask,
    SgdTokenTask,
    TokenTask,
    TwoPlayerTask,
    VocabularyTask,
)

pytestmark = [pytest.mark.own_tasks, pytest.mark.timeout(120)]


def _config(run_dir: Path, *extra: str) -> Config:
    return load_config(
        None,
        [
            *FAST,
            f"run.dir={run_dir}",
            "train.global_batch_size=16",
            "train.micro_batch_size=4",
            "train.max_steps=8",
            "train.mixed_precision=none",
            *extra,
        ],
    )


def _trainer(run_dir: Path, task_class: type = TokenTask, *extra: str) -> Trainer:
    config = _config(run_dir, *extra)
    return make_trainer(config, task=task_class(config.task, config.run.seed))


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in trainer.model.state_dict().items()}


def _assert_bitwise(left: dict, right: dict) -> None:
    assert left.keys() == right.keys()
    for name, value in left.items():
        assert torch.equal(value, right[name]), name


def _export(task_class: type, run_dir: Path) -> torch.nn.Module:
    """A model of `task_class`, exported to `run_dir` as the end of training exports it."""
    config = _config(run_dir)
    task = task_class(config.task, config.run.seed)
    model = task.build_model()
    export_weights(model, run_dir, to_yaml(config), task=task)
    return model


class _Crash(RuntimeError):
    pass


def _straight_and_resumed(tmp_path: Path, task_class: type, *extra: str) -> tuple[Trainer, Trainer]:
    """8 steps in one go, and a run that crashes after its step-4 checkpoint + a new trainer
    that resumes there and runs to the end."""
    straight = _trainer(tmp_path / "straight", task_class, *extra)
    assert straight.fit() == 0
    first = _trainer(tmp_path / "resumed", task_class, *extra)
    step = first.train_step

    def crash_after_step_5(batches: Iterator) -> object:
        if first.step == 5:
            raise _Crash
        return step(batches)

    first.train_step = crash_after_step_5
    with pytest.raises(_Crash):
        first.fit()
    numpy.random.rand(7)  # a resumed run must not depend on what the process drew meanwhile
    torch.rand(7)
    resumed = _trainer(tmp_path / "resumed", task_class, *extra)
    assert resumed.resume()
    assert resumed.step == 4
    assert resumed.fit() == 0
    return straight, resumed


def test_a_task_of_the_first_release_trains_and_resumes_bitwise(tmp_path: Path) -> None:
    """No base class, none of the members added since 0.1: defaults fill in, and its NumPy
    augmentation continues exactly where the checkpoint left it."""
    straight, resumed = _straight_and_resumed(tmp_path, FirstReleaseTask)
    _assert_bitwise(_state(straight), _state(resumed))
    assert straight.unit == "samples" and straight.flops_per_step is None


def test_a_task_of_the_first_release_exports_its_weights_and_config_alone(
    tmp_path: Path,
) -> None:
    """No `model_settings`, no `export_files`: the end of training exports what it always did."""
    assert _trainer(tmp_path, FirstReleaseTask).fit() == 0
    exported = sorted(path.name for path in (tmp_path / "export").iterdir())
    assert exported == ["config.yaml", "model.safetensors"]


def test_a_task_of_the_first_release_loads_from_its_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _export(FirstReleaseTask, tmp_path / "run")
    monkeypatch.setattr(weights, "Task", FirstReleaseTask)  # what load_model builds

    _assert_bitwise(load_model(tmp_path / "run").state_dict(), model.state_dict())


def test_a_task_missing_a_required_method_is_refused_by_name() -> None:
    class NoLoss:
        def build_model(self) -> None: ...
        def build_datasets(self) -> None: ...
        def evaluation_sums(self) -> None: ...

    with pytest.raises(ContractError, match="NoLoss does not define training_loss"):
        adopt(NoLoss())


class _Stream(IterableDataset):
    """A data set read as a stream, as Hugging Face's streaming data sets are."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from torch.zeros(4, 2)


class StreamingTokenTask(TokenTask):
    def build_datasets(self) -> tuple:
        return _Stream(), super().build_datasets()[1]


def test_a_streamed_data_set_is_refused_with_what_to_do_instead(tmp_path: Path) -> None:
    with pytest.raises(
        ContractError, match=r"a training set that cannot be indexed \(_Stream"
    ) as error:
        _trainer(tmp_path, StreamingTokenTask)
    assert "load_dataset without streaming=True" in str(error.value)


def _refused_launch(task_class: type, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The log of a launch of `task_class`, which ends with exit status 2 and no traceback."""
    monkeypatch.setattr(train, "Task", task_class)
    assert train.main([*FAST, f"run.dir={run_dir}", "train.max_steps=4"]) == 2
    log = (run_dir / "train.log").read_text()
    assert "Traceback" not in log
    return log


def test_a_launch_with_a_streamed_data_set_exits_2_with_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal, as a bad setting is: the task's code must change."""
    log = _refused_launch(StreamingTokenTask, tmp_path / "run", monkeypatch)
    assert "a training set that cannot be indexed (_Stream" in log


def test_lazy_modules_take_their_shapes_from_the_first_micro_batch_and_resume_bitwise(
    tmp_path: Path,
) -> None:
    """nn.LazyLinear and nn.LazyBatchNorm1d: shaped before DDP and the optimizer see them, by
    a pass that changes no statistics; a resume shapes them again and loads the checkpoint."""
    straight, resumed = _straight_and_resumed(tmp_path, LazyTask)
    _assert_bitwise(_state(straight), _state(resumed))
    assert tuple(resumed.model[0].weight.shape) == (16, 4)
    assert int(resumed.model[1].num_batches_tracked) == 8 * 4  # 8 steps of 4 micro-batches


def test_a_lazy_model_loads_from_its_export_and_as_initial_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_model builds the model without data: the exported weights give it its shapes."""
    trained = _trainer(tmp_path / "run", LazyTask, "train.max_steps=2")
    assert trained.fit() == 0
    monkeypatch.setattr(weights, "Task", LazyTask)  # what load_model builds
    _assert_bitwise(load_model(tmp_path / "run").state_dict(), _state(trained))
    tuned = _trainer(tmp_path / "tuned", LazyTask, f"init.weights={tmp_path / 'run'}")
    tuned.start_fresh()
    _assert_bitwise(_state(tuned), _state(trained))


def test_a_model_compiled_in_build_model_saves_exports_and_loads_under_its_plain_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.compile's wrapper adds `_orig_mod.` to the names: checkpoints and the export leave
    it out (a compiled block's too), a compiled model resumes bitwise, and weights move between
    compiled and plain models both ways, also from a file saved with the prefix."""
    straight, resumed = _straight_and_resumed(tmp_path, CompiledTask)
    _assert_bitwise(_state(straight), _state(resumed))
    run_dir = tmp_path / "resumed"
    plain = FirstReleaseTask(None, seed=0).build_model()
    names = list(plain.state_dict())
    saved = torch.load(latest_checkpoint(run_dir) / "state.pt", weights_only=True)
    assert list(saved["model"]) == names
    assert sorted(safetensors.torch.load_file(run_dir / "export" / "model.safetensors")) == sorted(
        names
    )
    monkeypatch.setattr(weights, "Task", CompiledTask)  # what load_model builds
    _assert_bitwise(load_model(run_dir).state_dict(), _state(resumed))
    load_initial_weights(plain, run_dir)
    _assert_bitwise(plain.state_dict(), plain_state_dict(resumed.model))
    torch.save(resumed.model.state_dict(), tmp_path / "compiled.pt")  # `_orig_mod.` names
    load_initial_weights(plain, tmp_path / "compiled.pt")
    compiled = CompiledTask(None, seed=0).build_model()
    load_initial_weights(compiled, run_dir / "export" / "model.safetensors")
    _assert_bitwise(compiled.state_dict(), _state(resumed))
    block_compiled = torch.nn.Sequential(torch.compile(torch.nn.Linear(4, 2), backend="eager"))
    exported = export_weights(block_compiled, tmp_path / "block", "")
    assert sorted(safetensors.torch.load_file(exported)) == ["0.bias", "0.weight"]


class BypassingTwoPlayerTask(TwoPlayerTask):
    """Calls the modules inside the parts' DDP wrappers: no gradient is all-reduced."""

    def training_loss(self, model: Any, batch: Any, update: str | None = None) -> torch.Tensor:
        inner = SimpleNamespace(critic=model.critic.module, generator=model.generator.module)
        return super().training_loss(inner, batch, update)


def _ddp_with_model_forms(rank: int, world_size: int, run_dir: Path) -> dict[str, Any]:
    """Each model form on 2 ranks, in one process group: a lazy model's state as built and its
    parameters after 2 steps; a block checkpointed twice with dist.static_graph (one
    micro-batch per rank) and without reentrant checkpointing, after 2 steps; and the
    refusals, as text: a task with updates whose loss skips DDP, and reentrant checkpointing
    with gradient accumulation (last: nothing runs after DDP's failed backward)."""

    def trainer(name: str, task_class: type, *extra: str) -> Trainer:
        config = _config(run_dir / name, *extra)
        task = task_class(config.task, config.run.seed)
        return make_trainer(config, env_for(rank, world_size), task)

    lazy = trainer("lazy", LazyTask)
    outcomes: dict[str, Any] = {"lazy_built": _state(lazy)}
    train_steps(lazy, 2)
    # Not the buffers: each rank's BatchNorm keeps its own running statistics.
    outcomes["lazy"] = {name: param.detach() for name, param in lazy.model.named_parameters()}
    one_micro_batch = "train.micro_batch_size=8"  # 16 over 2 ranks
    static = trainer("static", CheckpointedTwiceTask, "dist.static_graph=true", one_micro_batch)
    outcomes["static_graph"] = train_steps(static, 2)

    class NotReentrant(CheckpointedTwiceTask):
        reentrant = False

    outcomes["not_reentrant"] = train_steps(trainer("plain", NotReentrant), 2)
    for name, task_class in (("bypass", BypassingTwoPlayerTask), ("twice", CheckpointedTwiceTask)):
        with pytest.raises(GradientsNotReducedError) as error:
            train_steps(trainer(name, task_class), 1)
        outcomes[name] = str(error.value)
    return outcomes


@pytest.fixture(scope="module")
def model_forms(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("model-forms")
    return spawn(2, _ddp_with_model_forms, workdir / "run", workdir=workdir, timeout=90)


@pytest.mark.distributed
def test_lazy_modules_are_shaped_alike_on_every_rank_before_ddp_wraps_them(
    model_forms: list[dict[str, Any]], tmp_path: Path
) -> None:
    """From the same samples and the random streams as build_model left them: on any rank and
    world size, the weights a dummy forward at the end of build_model would have drawn."""
    alone = _state(_trainer(tmp_path, LazyTask))
    for rank in model_forms:
        _assert_bitwise(rank["lazy_built"], alone)
    _assert_bitwise(model_forms[0]["lazy"], model_forms[1]["lazy"])


@pytest.mark.distributed
def test_a_block_checkpointed_twice_trains_with_a_static_graph_or_without_reentrance(
    model_forms: list[dict[str, Any]],
) -> None:
    for rank in model_forms:
        for name, tensor in rank["static_graph"].items():
            torch.testing.assert_close(tensor, rank["not_reentrant"][name], rtol=0, atol=1e-6)
    _assert_bitwise(model_forms[0]["static_graph"], model_forms[1]["static_graph"])


@pytest.mark.distributed
def test_reentrant_checkpointing_of_a_block_used_twice_is_refused_with_the_two_fixes(
    model_forms: list[dict[str, Any]],
) -> None:
    """DDP's own words ("Expected to mark a variable ready only once", "try to use
    _set_static_graph()") name neither setting nor the checkpoint's argument."""
    for rank in model_forms:
        assert re.search(r"block\.(weight|bias) got gradients twice in one", rank["twice"])
        assert "use_reentrant=False" in rank["twice"]
        assert "dist.static_graph=true" in rank["twice"]


@pytest.mark.distributed
def test_a_part_s_parameters_are_named_with_the_part(model_forms: list[dict[str, Any]]) -> None:
    """A task with updates: `critic.0.weight`, as the model names it, not `0.weight`."""
    for rank in model_forms:
        assert "DDP did not all-reduce them" in rank["bypass"]
        assert "(critic.0.weight, critic.0.bias" in rank["bypass"]


def test_two_fresh_launches_draw_the_same_numpy_augmentation(tmp_path: Path) -> None:
    """run.seed seeds NumPy's global generator too, per rank, in the training process."""
    runs = []
    for name in ("first", "second"):
        numpy.random.seed(None)  # whatever state an earlier import or test left
        trainer = _trainer(tmp_path / name, FirstReleaseTask)
        runs.append(train_steps(trainer, 3))
    _assert_bitwise(*runs)


def test_padded_dict_batches_collate_and_train_and_resume_bitwise(tmp_path: Path) -> None:
    """Dict batches padded by the task's collate, a (sum, count) loss, parameter groups, tied
    weights, and the task's own state: all bitwise after a resume."""
    straight, resumed = _straight_and_resumed(tmp_path, TokenTask)
    _assert_bitwise(_state(straight), _state(resumed))
    assert resumed.task.batches_seen == straight.task.batches_seen == 8 * 4
    optimizer, again = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    for index, state in optimizer["state"].items():
        for key, value in state.items():
            assert torch.equal(value, again["state"][index][key]), (index, key)


def test_the_log_reports_the_token_mean_loss_its_components_and_real_tokens(
    tmp_path: Path,
) -> None:
    seen: list[dict] = []

    class Recorded(TokenTask):
        def training_loss(self, model: torch.nn.Module, batch: dict) -> dict:
            result = super().training_loss(model, batch)
            seen.append({key: float(value.detach()) for key, value in result.items()})
            return result

    trainer = _trainer(tmp_path, Recorded, "train.log_every=8")
    trainer.fit()
    record = next(r for r in read_metrics(tmp_path) if "train/loss" in r)
    tokens = sum(item["count"] for item in seen)
    assert len(seen) == 8 * 4
    assert record["train/loss"] == pytest.approx(sum(item["loss"] for item in seen) / tokens)
    assert record["train/z_loss"] == pytest.approx(sum(item["z_loss"] for item in seen) / tokens)
    assert trainer.total_units == tokens  # real tokens, not padded positions


def test_metrics_with_their_own_counts_and_derived_metrics_are_reported(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, TokenTask)
    metrics = trainer.evaluate()
    assert set(metrics) == {"loss", "accuracy", "f1"}
    sums = {"loss": 0.0, "correct": 0.0, "tokens": 0.0, "tp": 0.0, "fp": 0.0, "fn": 0.0}
    for batch in trainer.eval_loader:
        with torch.no_grad():
            entries = trainer.task.evaluation_sums(trainer.model, batch)
        sums["loss"] += float(entries["loss"][0])
        sums["tokens"] += float(entries["loss"][1])
        sums["correct"] += float(entries["accuracy"][0])
        sums["tp"] += float(entries["true_positives"])
        sums["fp"] += float(entries["false_positives"])
        sums["fn"] += float(entries["false_negatives"])
    assert metrics["loss"] == pytest.approx(sums["loss"] / sums["tokens"], rel=1e-12)
    assert metrics["accuracy"] == pytest.approx(sums["correct"] / sums["tokens"], rel=1e-12)
    f1 = 2 * sums["tp"] / max(2 * sums["tp"] + sums["fp"] + sums["fn"], 1)
    assert metrics["f1"] == pytest.approx(f1, rel=1e-12)


def test_a_group_keeps_its_own_weight_decay_when_optim_weight_decay_changes_on_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = _trainer(tmp_path, TokenTask, "train.max_steps=4", "optim.weight_decay=0.1")
    first.fit()
    with caplog.at_level(logging.INFO):
        resumed = _trainer(tmp_path, TokenTask, "optim.weight_decay=0.05")
        resumed.resume()
    decays = {group["name"]: group["weight_decay"] for group in resumed.optimizer.param_groups}
    assert decays == {"matrices": 0.05, "embeddings_biases_norms": 0.0}
    assert "optimizer group matrices (1 tensors): weight_decay 0.1 -> 0.05" in caplog.text
    assert "embeddings_biases_norms" not in caplog.text


def test_a_longer_run_keeps_every_groups_own_settings(tmp_path: Path) -> None:
    """What `make demo` does (train.max_steps 4 -> 8): no group's options are rewritten."""
    _trainer(tmp_path, TokenTask, "train.max_steps=4").fit()
    resumed = _trainer(tmp_path, TokenTask, "train.max_steps=8")
    resumed.resume()
    decays = [group["weight_decay"] for group in resumed.optimizer.param_groups]
    assert decays == [0.01, 0.0]


def test_other_parameter_groups_than_the_checkpoints_are_refused_with_the_fix(
    tmp_path: Path,
) -> None:
    _trainer(tmp_path, TokenTask, "train.max_steps=4").fit()

    class OneGroup(TokenTask):
        def param_groups(self, model: torch.nn.Module) -> list[dict]:
            return [{"params": list(model.parameters())}]

    with pytest.raises(ResumeError, match=r"parameter groups of \[1, 4\] tensors.*\[5\]"):
        _trainer(tmp_path, OneGroup).resume()


def test_a_task_s_own_optimizer_and_schedule_train_and_resume_bitwise(tmp_path: Path) -> None:
    """SGD's momentum buffers and the cosine schedule's state go in the checkpoint."""
    straight, resumed = _straight_and_resumed(tmp_path, SgdTokenTask)
    _assert_bitwise(_state(straight), _state(resumed))
    assert isinstance(resumed.optimizer, torch.optim.SGD)
    momenta = [group["momentum"] for group in resumed.optimizer.param_groups]
    assert momenta == [0.9, 0.5]
    buffers = [state["momentum_buffer"] for state in resumed.optimizer.state.values()]
    straight_buffers = [state["momentum_buffer"] for state in straight.optimizer.state.values()]
    assert all(map(torch.equal, buffers, straight_buffers))
    assert resumed.scheduler.state_dict() == straight.scheduler.state_dict()


def test_a_resume_applies_only_the_options_the_optimizer_has(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """optim.betas and optim.weight_decay are AdamW's: an SGD task's groups never get them."""
    _trainer(tmp_path, SgdTokenTask).fit()
    with caplog.at_level(logging.INFO):
        resumed = _trainer(
            tmp_path, SgdTokenTask, "optim.betas=[0.8,0.9]", "optim.weight_decay=0.2"
        )
        resumed.resume()
    assert all("betas" not in group for group in resumed.optimizer.param_groups)
    assert [group["weight_decay"] for group in resumed.optimizer.param_groups] == [0, 0.0]
    assert "tensors):" not in caplog.text  # no optimizer group changed
    assert "0.01 to 0.2: applied (given to the task's build_optimizer" in caplog.text


def test_a_changed_shape_of_the_task_s_own_schedule_is_refused_at_resume(tmp_path: Path) -> None:
    """CosineAnnealingLR keeps T_max in its state: a longer run would silently keep the old
    cosine, so the resume names the change instead."""
    _trainer(tmp_path, SgdTokenTask, "train.max_steps=4").fit()
    with pytest.raises(ResumeError, match=r"CosineAnnealingLR.*T_max 4 -> 12"):
        _trainer(tmp_path, SgdTokenTask, "train.max_steps=12").resume()


def test_a_schedule_of_schedules_resumes_bitwise(tmp_path: Path) -> None:
    """A linear warmup, then the cosine (SequentialLR): the schedules it holds keep their
    progress in its state, which is no change of shape."""

    class WarmupThenCosine(SgdTokenTask):
        def build_scheduler(
            self, optimizer: torch.optim.Optimizer, total_steps: int, optim: Any
        ) -> torch.optim.lr_scheduler.LRScheduler:
            lr = torch.optim.lr_scheduler
            warmup = lr.LinearLR(optimizer, start_factor=0.1, total_iters=3)
            cosine = lr.CosineAnnealingLR(optimizer, T_max=total_steps - 3)
            return lr.SequentialLR(optimizer, [warmup, cosine], milestones=[3])

    straight, resumed = _straight_and_resumed(tmp_path, WarmupThenCosine)
    _assert_bitwise(_state(straight), _state(resumed))


def _two_groups(lr: float | torch.Tensor = 0.003) -> torch.optim.Optimizer:
    weight, bias = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.SGD([{"params": [weight]}, {"params": [bias], "lr": 0.7}], lr=lr)


def test_factor_lr_sets_lambda_lr_s_rates_bitwise_and_keeps_its_state() -> None:
    """The default schedule's class steps past its warmup and its end as torch's LambdaLR
    does; a LambdaLR's state loads into it and continues alike."""
    factor = partial(warmup_cosine, warmup_steps=3, total_steps=20, min_lr_ratio=0.1)
    torch_optimizer, our_optimizer = _two_groups(), _two_groups()
    torch_schedule = torch.optim.lr_scheduler.LambdaLR(torch_optimizer, factor)
    ours = FactorLR(our_optimizer, factor)
    for step in range(25):
        assert [g["lr"] for g in our_optimizer.param_groups] == [
            g["lr"] for g in torch_optimizer.param_groups
        ], f"step {step}"
        assert ours.get_last_lr() == torch_schedule.get_last_lr()
        assert ours.state_dict() == torch_schedule.state_dict()
        if step == 10:  # a checkpoint of torch's schedule, loaded into ours
            ours = FactorLR(_two_groups(), factor)
            ours.optimizer.load_state_dict(torch_optimizer.state_dict())
            ours.load_state_dict(torch_schedule.state_dict())
            our_optimizer = ours.optimizer
        torch_optimizer.step(), our_optimizer.step()
        torch_schedule.step(), ours.step()


def test_factor_lr_keeps_a_tensor_learning_rate_in_place() -> None:
    """A tensor lr (captured in a CUDA graph) is filled, never replaced, as torch does."""
    factor = partial(warmup_cosine, warmup_steps=2, total_steps=6, min_lr_ratio=0.0)
    optimizer = _two_groups(lr=torch.tensor(0.003))
    rate = optimizer.param_groups[0]["lr"]
    reference = torch.optim.lr_scheduler.LambdaLR(_two_groups(lr=torch.tensor(0.003)), factor)
    schedule = FactorLR(optimizer, factor)
    for _ in range(4):
        optimizer.step(), reference.optimizer.step()
        schedule.step(), reference.step()
    assert optimizer.param_groups[0]["lr"] is rate
    assert torch.equal(rate, reference.optimizer.param_groups[0]["lr"])
    assert schedule.get_last_lr()[0] is not rate
    assert torch.equal(schedule.get_last_lr()[0], reference.get_last_lr()[0])


def test_a_group_option_the_optimizer_does_not_take_is_refused_by_name(tmp_path: Path) -> None:
    class AdamWithMomentum(TokenTask):
        def param_groups(self, model: torch.nn.Module) -> list[dict]:
            groups = super().param_groups(model)
            groups[0]["momentum"] = 0.9
            return groups

    with pytest.raises(ConfigError, match=r"sets momentum in matrices, which AdamW does not take"):
        _trainer(tmp_path, AdamWithMomentum)


def test_a_schedule_that_needs_a_metric_at_each_step_is_refused_by_name(tmp_path: Path) -> None:
    class Plateau(TokenTask):
        def build_scheduler(
            self, optimizer: torch.optim.Optimizer, total_steps: int, optim: object
        ) -> object:
            return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)

    with pytest.raises(ConfigError, match="build_scheduler returned ReduceLROnPlateau"):
        _trainer(tmp_path, Plateau)


def test_an_optimizer_over_other_groups_than_param_groups_is_refused(tmp_path: Path) -> None:
    class Regrouped(TokenTask):
        def build_optimizer(self, param_groups: list[dict], optim: Any) -> torch.optim.Optimizer:
            params = [param for group in param_groups for param in group["params"]]
            return torch.optim.SGD(params, lr=optim.lr)

    with pytest.raises(ConfigError, match="over other parameter groups than param_groups made"):
        _trainer(tmp_path, Regrouped)


def test_a_trainable_parameter_left_out_of_every_group_is_named(tmp_path: Path) -> None:
    class Forgetful(TokenTask):
        def param_groups(self, model: torch.nn.Module) -> list[dict]:
            return [{"params": [model.hidden.weight]}]

    with pytest.raises(ConfigError, match=r"leaves out 4 trainable parameter.*hidden.bias"):
        _trainer(tmp_path, Forgetful)


def test_mixing_mean_and_summed_losses_in_one_run_is_refused(tmp_path: Path) -> None:
    class Fickle(TokenTask):
        def training_loss(self, model: torch.nn.Module, batch: dict) -> object:
            result = super().training_loss(model, batch)
            return result if self.batches_seen % 2 else result["loss"] / result["count"]

    with pytest.raises(TypeError, match="a count for some micro-batches and not for others"):
        train_steps(_trainer(tmp_path, Fickle), 1)


@pytest.fixture
def vocabulary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A vocabulary file of three tokens in a data directory, read by VocabularyTask."""
    path = tmp_path / "data" / "vocabulary.txt"
    path.parent.mkdir()
    path.write_text("a\nb\nc\n")
    monkeypatch.setattr(VocabularyTask, "path", path)
    return path


def test_a_model_sized_by_its_data_loads_from_the_export_without_the_data(
    tmp_path: Path, vocabulary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size the task read from its data comes back to it from the export
    (`model_settings`, `load_model_settings`): building the model reads no data."""
    model = _export(VocabularyTask, tmp_path / "run")
    shutil.rmtree(vocabulary.parent)
    monkeypatch.setattr(weights, "Task", VocabularyTask)  # what load_model builds

    _assert_bitwise(load_model(tmp_path / "run").state_dict(), model.state_dict())


def test_the_files_a_task_names_are_exported_beside_the_weights(
    tmp_path: Path, vocabulary: Path
) -> None:
    _export(VocabularyTask, tmp_path / "run")
    assert (tmp_path / "run" / "export" / "vocabulary.txt").read_text() == "a\nb\nc\n"


def test_an_export_file_named_by_a_path_is_refused_by_name(
    tmp_path: Path, vocabulary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(VocabularyTask, "export_files", lambda self: {"../v.txt": self.path})
    with pytest.raises(WeightsError, match=r"names '\.\./v\.txt': give each file a plain"):
        _export(VocabularyTask, tmp_path / "run")


def test_alternating_updates_train_and_resume_bitwise_with_each_optimizer_s_state(
    tmp_path: Path,
) -> None:
    straight, resumed = _straight_and_resumed(tmp_path, TwoPlayerTask)
    _assert_bitwise(_state(straight), _state(resumed))
    optimizers = {update.name: update.optimizer for update in resumed.updates}
    assert isinstance(optimizers["critic"], torch.optim.SGD)
    assert isinstance(optimizers["generator"], torch.optim.Adam)
    for before, after in zip(straight.updates, resumed.updates, strict=True):
        for index, state in before.optimizer.state_dict()["state"].items():
            _assert_bitwise(state, after.optimizer.state_dict()["state"][index])
        assert before.scheduler.state_dict() == after.scheduler.state_dict()


def test_each_update_s_loss_lr_and_gradient_norm_are_logged(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, TwoPlayerTask, "optim.grad_clip=1.0")
    trainer.fit()
    logged = [record for record in read_metrics(tmp_path) if "step" in record]
    keys = set().union(*logged)
    for update in ("critic", "generator"):
        assert {f"train/{update}/{name}" for name in ("loss", "lr", "grad_norm")} <= keys
    assert "train/loss" not in keys and "eval/fooled" in keys


def test_the_optimizer_of_a_task_with_updates_is_asked_for_by_update(tmp_path: Path) -> None:
    with pytest.raises(AttributeError, match=r"several updates .* trainer\.updates"):
        _trainer(tmp_path, TwoPlayerTask).optimizer  # noqa: B018


def test_an_update_that_names_no_part_of_the_model_is_refused(tmp_path: Path) -> None:
    class Misnamed(TwoPlayerTask):
        updates = ("discriminator", "generator")

    with pytest.raises(ConfigError, match=r"'discriminator', which is not a submodule"):
        _trainer(tmp_path, Misnamed)


def test_a_parameter_that_no_update_trains_is_named(tmp_path: Path) -> None:
    class CriticOnly(TwoPlayerTask):
        updates = ("critic",)

    with pytest.raises(ConfigError, match=r"in none: generator\.0\.weight"):
        _trainer(tmp_path, CriticOnly)


def test_a_checkpoint_of_other_updates_is_refused_at_resume(tmp_path: Path) -> None:
    class Together(TwoPlayerTask):
        """Both players on the sum of their losses, with one optimizer."""

        updates = ()

        def training_loss(self, model: Any, batch: Any, update: str | None = None) -> Any:
            return sum(
                TwoPlayerTask.training_loss(self, model, batch, u) for u in ("critic", "generator")
            )

    _trainer(tmp_path, Together, "train.max_steps=2").fit()
    expected = r"one optimizer for the whole model, and the task now trains updates critic, gen"
    with pytest.raises(ResumeError, match=expected):
        _trainer(tmp_path, TwoPlayerTask, "train.max_steps=2").resume()


class GatheringTokenTask(TokenTask):
    """Gathers every rank's embeddings in evaluation, as a retrieval metric over the whole
    evaluation set would, through the functional collectives (autograd included)."""

    def evaluation_sums(self, model: torch.nn.Module, batch: dict) -> dict:
        embeddings = self.embed(model, batch)
        everyone = self.gather(embeddings)
        sums = super().evaluation_sums(model, batch)
        return {**sums, "norm": (everyone.norm(dim=-1).sum(), len(everyone))}

    def embed(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return model.embedding(batch["input_ids"]).mean(dim=1)

    def gather(self, embeddings: torch.Tensor) -> torch.Tensor:
        return functional_collectives.all_gather_single(embeddings, 0, dist.group.WORLD)


class OlderGatheringTokenTask(GatheringTokenTask):
    """The same through torch.distributed.nn.functional, whose calls end in torch.distributed's
    own."""

    def gather(self, embeddings: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of the above
            return torch.cat(distributed_autograd.all_gather(embeddings))


def _evaluate_with_gathers(rank: int, world_size: int, run_dir: Path) -> list[str]:
    messages = []
    for task_class in (GatheringTokenTask, OlderGatheringTokenTask):
        config = _config(run_dir / task_class.__name__)
        task = task_class(config.task, config.run.seed)
        trainer = make_trainer(config, env_for(rank, world_size), task)
        with pytest.raises(CollectiveInEvaluationError) as error:
            trainer.evaluate()
        messages.append(str(error.value))
    return messages


@pytest.mark.distributed
def test_a_collective_in_evaluation_sums_is_refused_alike_on_every_rank(tmp_path: Path) -> None:
    """Each rank evaluates its own share of the 37 samples (19 and 18): a gather there would
    pair tensors of different sizes (gloo aborts the process) or wait for a rank that has
    finished. Every rank refuses it at its first call, before any data is exchanged, with the
    same message."""
    ranks = spawn(2, _evaluate_with_gathers, tmp_path / "run", workdir=tmp_path, timeout=90)
    assert ranks[0] == ranks[1]
    functional, older = ranks[0]
    called = "the task's evaluation_sums called torch.distributed"
    assert f"{called}._functional_collectives.all_gather_single," in functional
    assert f"{called}.all_gather," in older
    assert "the ranks' batches can differ in size or in number" in functional
    assert "Return sums over the batch instead" in functional


def test_only_the_evaluating_thread_is_refused_and_torch_s_functions_come_back() -> None:
    """A checkpoint written in the background meanwhile exchanges data on its own group."""
    original = dist.all_reduce
    raised_elsewhere: list[type] = []

    def all_reduce_elsewhere() -> None:
        try:
            dist.all_reduce(torch.zeros(1))
        except Exception as error:  # torch's own: no process group in this test
            raised_elsewhere.append(type(error))

    with collectives_refused("evaluation_sums"):
        thread = threading.Thread(target=all_reduce_elsewhere)
        thread.start()
        thread.join()
        with pytest.raises(CollectiveInEvaluationError):
            dist.all_reduce(torch.zeros(1))
    assert raised_elsewhere == [ValueError]
    assert dist.all_reduce is original


class AllReducingTokenTask(TokenTask):
    """All-reduces its own sums in evaluation, which the trainer does once, after the last
    batch."""

    def evaluation_sums(self, model: torch.nn.Module, batch: dict) -> dict:
        sums = super().evaluation_sums(model, batch)
        dist.all_reduce(sums["true_positives"])
        return sums


def test_a_launch_whose_evaluation_all_reduces_exits_2_naming_the_collective(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused on one rank too, where no process group exists: the same code would hang or
    abort on several. Status 2, as for a setting: the task's code must change."""
    log = _refused_launch(AllReducingTokenTask, tmp_path / "run", monkeypatch)
    assert "evaluation_sums called torch.distributed.all_reduce" in log
    assert "Traceback" not in log


def _all_reduce(count: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(count)
    return count


def _all_gather_single(count: torch.Tensor) -> torch.Tensor:
    counts = count.new_empty(dist.get_world_size())
    dist.all_gather_single(counts, count.reshape(1))
    return counts.sum()


def _older_all_reduce(count: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of the one below
        return distributed_autograd.all_reduce(count)


def _functional_all_reduce(count: torch.Tensor) -> torch.Tensor:
    return functional_collectives.all_reduce(count, "sum", dist.group.WORLD)


def _functional_broadcast(count: torch.Tensor) -> torch.Tensor:
    """Rank 0's count for every rank's: another way to be wrong, but an exchange all the same."""
    return functional_collectives.broadcast(count, 0, dist.group.WORLD) * dist.get_world_size()


#: How a loss may sum its count over the ranks, by the function it calls.
SUMMED_COUNTS = {
    "torch.distributed.all_reduce": _all_reduce,
    "torch.distributed.all_gather_single": _all_gather_single,
    "torch.distributed.nn.functional.all_reduce": _older_all_reduce,
    "torch.distributed._functional_collectives.all_reduce": _functional_all_reduce,
    "torch.distributed._functional_collectives.broadcast": _functional_broadcast,
}


class GlobalCountTokenTask(TokenTask):
    """A mean over the real tokens of every rank's micro-batch, its count summed over the
    ranks inside the loss (by `summed`, without a gradient), as one process would count the
    whole batch's: exact with one micro-batch per rank and step, another loss under
    accumulation."""

    summed = "torch.distributed.all_reduce"

    def training_loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        result = super().training_loss(model, batch)
        with torch.no_grad():
            count = SUMMED_COUNTS[self.summed](result["count"].double())
        return result["loss"] * dist.get_world_size() / count


def _train_with_summed_counts(rank: int, world_size: int, run_dir: Path) -> dict[str, str]:
    """Each way of summing the count under accumulation (16 = 2 ranks x 4 x 2), then the
    first of them with one micro-batch per rank and step (2 x 8 x 1)."""
    runs = [(summed, summed, 4) for summed in SUMMED_COUNTS]
    runs.append(("one micro-batch", "torch.distributed.all_reduce", 8))
    outcomes = {}
    for index, (name, summed, micro_batch) in enumerate(runs):
        config = _config(run_dir / str(index), f"train.micro_batch_size={micro_batch}")
        task = GlobalCountTokenTask(config.task, config.run.seed)
        task.summed = summed
        trainer = make_trainer(config, env_for(rank, world_size), task)
        try:
            train_steps(trainer, 2)
            outcomes[name] = "trained"
        except CollectiveInLossError as error:
            outcomes[name] = str(error)
    return outcomes


@pytest.fixture(scope="module")
def summed_counts(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    workdir = tmp_path_factory.mktemp("summed_counts")
    return spawn(2, _train_with_summed_counts, workdir / "run", workdir=workdir, timeout=90)


@pytest.mark.distributed
@pytest.mark.parametrize("summed", list(SUMMED_COUNTS))
def test_a_loss_that_exchanges_data_under_accumulation_is_refused_at_the_first_step(
    summed_counts: list[dict[str, str]], summed: str
) -> None:
    """It would train another loss than the whole batch's (1.7e-3 away from one process after
    a few steps), silently. Every rank refuses alike, naming the call, where the task made it,
    the split and the micro-batch size that makes the exchange exact."""
    assert summed_counts[0][summed] == summed_counts[1][summed]
    message = summed_counts[0][summed]
    # torch.distributed.nn.functional's functions call torch.distributed's.
    called = summed.replace(".nn.functional", "")
    assert f"the task's training_loss called {called} (test_contract.py line " in message
    assert "with train.micro_batch_size=4 takes 2 micro-batches per rank and step" in message
    assert "Set train.micro_batch_size=8 (train.global_batch_size / ranks" in message
    assert "Task.whole_batch_loss = True" in message


@pytest.mark.distributed
def test_a_loss_that_exchanges_data_trains_with_one_micro_batch_per_rank(
    summed_counts: list[dict[str, str]],
) -> None:
    assert [rank["one micro-batch"] for rank in summed_counts] == ["trained", "trained"]


def test_collectives_that_torch_s_own_modules_make_are_not_the_task_s() -> None:
    """SyncBatchNorm gathers its statistics in its forward (on GPUs), DDP all-reduces in its
    own when it joins ranks: neither is an exchange of the task's. DDP's join check stands for
    them here, a collective called from torch.nn (no process group: torch raises after the
    call is seen)."""
    ddp = SimpleNamespace(require_backward_grad_sync=True, device="cpu", process_group=None)
    with collectives_noted() as noted:
        with pytest.raises(ValueError):
            DistributedDataParallel._check_global_requires_backward_grad_sync(ddp, False)
        with pytest.raises(ValueError):
            dist.all_reduce(torch.zeros(1))
    assert [name for name, _ in noted] == ["torch.distributed.all_reduce"]
    assert noted[0][1].startswith("test_contract.py line ")
