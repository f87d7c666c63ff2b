"""Rank discipline: replicas stay identical, rank 0 alone writes shared files, and no collective
ever runs inside a rank-0-only branch (the classic source of hangs)."""

from __future__ import annotations

import ast
import builtins
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import {{ cookiecutter.package_name }}
from {{ cookiecutter.package_name }}.cluster.distributed import ReplicaMismatchError
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.train import main
from {{ cookiecutter.package_name }}.training.replicas import ReplicaCheck

from ..helpers import (
    FAST,
    UPDATES,
    env_for,
    inner_modules,
    make_trainer,
    micro_batch_size,
    run_torchrun,
    spawn,
    write_fault_entry,
)

PACKAGE_DIR = Path({{ cookiecutter.package_name }}.__file__).parent


class _PartingTask(Task):
    """The project's task whose replicas part at step 5, after the first step's gradient
    check, by `fault`: its loss bypasses DDP's forward, or changes a parameter in place on
    rank 1 (one rank's optimizer stepping twice is the trainer's doing: `_part`)."""

    fault = ""
    calls = 0

    def training_loss(self, model: nn.Module, batch: Any, **update: str) -> Any:
        self.calls += 1
        if self.calls == 4 * max(len(UPDATES), 1) + 1:  # step 5's first loss
            if self.fault == "bypass":
                model = inner_modules(model)
            elif self.fault == "in place" and dist.get_rank() == 1:
                with torch.no_grad():
                    next(model.parameters()).mul_(1.001)
        return super().training_loss(model, batch, **update)


#: How the replicas part at step 5, with the settings of the run.
PARTINGS = {
    "bypass": (),
    "in place": (),
    "extra step": (),
    "extra step, checked every step": ("dist.check_replicas_every=1",),
}


def _part(rank: int, world_size: int, workdir: Path) -> dict[str, dict]:
    """Each way of parting the replicas, in runs of 8 steps of one micro-batch per rank (a
    bypass of a micro-batch that accumulates would be all-reduced by the last one's)."""
    return {
        fault: _part_once(rank, world_size, workdir / str(index), fault, settings)
        for index, (fault, settings) in enumerate(PARTINGS.items())
    }


def _part_once(
    rank: int, world_size: int, run_dir: Path, fault: str, settings: tuple[str, ...]
) -> dict:
    """The error, the step where the run stopped, and the names of the model's parameters."""
    overrides = [*FAST, f"run.dir={run_dir}", micro_batch_size(16, 32), "train.max_steps=8"]
    config = load_config(None, [*overrides, *settings])
    task = _PartingTask(config.task, seed=config.run.seed)
    task.fault = fault
    trainer = make_trainer(config, env_for(rank, world_size), task)
    stepped: list[torch.optim.Optimizer] = []

    def step_twice(optimizer: torch.optim.Optimizer, *_: object) -> None:
        if rank == 1 and trainer.step == 4 and optimizer not in stepped:
            stepped.append(optimizer)
            optimizer.step()

    if fault.startswith("extra step"):
        trainer.updates[0].optimizer.register_step_post_hook(step_twice)
    try:
        trainer.fit()
        error = None
    except ReplicaMismatchError as mismatch:
        error = str(mismatch)
    names = [name for name, _ in trainer.model.named_parameters()]
    return {"error": error, "step": trainer.step, "names": names}


@pytest.fixture(scope="module")
def partings(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    workdir = tmp_path_factory.mktemp("partings")
    return spawn(2, _part, workdir, workdir=workdir, timeout=240)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["bypass", "in place", "extra step"])
def test_replicas_that_part_after_the_first_step_stop_every_rank_at_the_next_log_line(
    partings: list[dict[str, dict]], fault: str
) -> None:
    """By default: the replicas' checksums ride in the log line's gather (every 2 steps here),
    so every rank stops at step 6, naming DDP, the steps since the last match and the
    parameters, where the run would have trained each rank alone to exit 0."""
    for rank in partings:
        result = rank[fault]
        assert result["step"] == 6, result
        error = result["error"]
        assert "step 6: the model's replicas differ between ranks: rank(s) 1 hold" in error
        assert "something in steps 5 to 6 did not" in error
        assert "bypasses the DDP wrapper (`model.module(...)`" in error
        assert any(f"({name}" in error for name in result["names"]), error


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_replica_check_catches_a_diverged_rank(partings: list[dict[str, dict]]) -> None:
    """dist.check_replicas_every=1: one rank's extra optimizer step is found at that very
    step, on every rank."""
    for rank in partings:
        result = rank["extra step, checked every step"]
        assert result["step"] == 5
        assert "rank(s) 1 hold other values than rank 0" in result["error"]
        assert "something in step 5 did not" in result["error"]


def test_replicas_that_differ_end_a_launch_with_status_2_and_one_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal: the task's code must change, and a relaunch as it is would part them again."""

    def differ(self: ReplicaCheck, rows: torch.Tensor, step: int) -> None:
        raise ReplicaMismatchError(f"step {step}: the model's replicas differ between ranks")

    monkeypatch.setattr(ReplicaCheck, "raise_if_differ", differ)
    run_dir = tmp_path / "run"
    assert main([*FAST, f"run.dir={run_dir}", "train.max_steps=2"]) == 2
    log = (run_dir / "train.log").read_text()
    assert "step 2: the model's replicas differ between ranks" in log
    assert "Traceback" not in log


def _files_written(rank: int, world_size: int, run_dir: Path) -> list[str]:
    """Train with checkpoints while recording every file this rank opens for writing."""
    written: list[str] = []
    real_open, real_replace = builtins.open, os.replace

    def recording_open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if any(flag in mode for flag in "wax+"):
            written.append(Path(file).name)
        return real_open(file, mode, *args, **kwargs)

    def recording_replace(src: object, dst: object) -> None:
        written.append(Path(dst).name)
        real_replace(src, dst)

    builtins.open = io.open = recording_open
    os.replace = recording_replace
    try:
        config = load_config(None, [*FAST, f"run.dir={run_dir}", "train.max_steps=8"])
        make_trainer(config, env_for(rank, world_size)).fit()
    finally:
        builtins.open = io.open = real_open
        os.replace = real_replace
    return sorted(set(written))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_only_rank_zero_writes_replicated_files(tmp_path: Path) -> None:
    """Rank 1 writes its own RNG file and nothing else; rank 0 writes state, marker and metrics."""
    rank0, rank1 = spawn(2, _files_written, tmp_path / "run", workdir=tmp_path)
    assert set(rank1) <= {"rank_00001.pt", "rank_00001.pt.partial"}
    assert {"state.pt", "COMPLETE", "metrics.jsonl", "rank_00000.pt"} <= set(rank0)


#: Rank 1 warns once before training; ranks 0 and 2 have nothing to say beyond rank 0's story.
_RANK_ONE_WARNS = """
import logging

_fit = Trainer.fit


def fit(self):
    if self.env.rank == 1:
        logging.getLogger("data").warning("rank 1 reads a slow disk")
    return _fit(self)


Trainer.fit = fit
"""


@pytest.fixture(scope="module")
def three_rank_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of a 3-rank run in which rank 1 warned and rank 2 did not."""
    workdir = tmp_path_factory.mktemp("logs")
    entry = write_fault_entry(workdir, _RANK_ONE_WARNS)
    run_dir = workdir / "run"
    overrides = [*FAST, f"run.dir={run_dir}", "train.global_batch_size=24", "train.max_steps=4"]
    result = run_torchrun(3, overrides, entry=entry)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_each_log_file_has_one_writer(three_rank_logs: Path) -> None:
    """train.log is rank 0's; a rank that warned has its own file, a quiet rank none."""
    assert sorted(path.name for path in three_rank_logs.glob("*.log")) == [
        "train.log",
        "train.rank1.log",
    ]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_log_holds_rank_zero_lines_only(three_rank_logs: Path) -> None:
    lines = (three_rank_logs / "train.log").read_text().splitlines()
    assert any("training complete" in line for line in lines)
    assert all("[rank 0]" in line for line in lines)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_warning_goes_to_the_rank_s_own_file(three_rank_logs: Path) -> None:
    lines = (three_rank_logs / "train.rank1.log").read_text().splitlines()
    assert len(lines) == 1
    assert "[rank 1] WARNING data: rank 1 reads a slow disk" in lines[0]


#: torch.distributed calls that every rank must make together.
COLLECTIVES = {
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
}


def _calls(node: ast.AST) -> set[str]:
    """What `node` calls: `f()` and `self.f()` as "f", `module.f()` as "module.f"."""
    names = set()
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        if isinstance(func, ast.Name):
            names.add(func.id)
        elif isinstance(func, ast.Attribute):
            is_method = isinstance(func.value, ast.Name) and func.value.id == "self"
            names.add(func.attr if is_method else ast.unparse(func))
    return names


def _is_rank_zero_test(test: ast.expr) -> bool:
    source = ast.unparse(test)
    return "is_main" in source or "rank == 0" in source


def collectives_in_rank_zero_branches(sources: list[str]) -> list[str]:
    """Calls that communicate, directly or through the package's own functions, found inside
    `if <rank 0>:` bodies."""
    trees = [ast.parse(source) for source in sources]
    functions = {
        node.name: _calls(node)
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    communicating: set[str] = set()

    def communicates(name: str) -> bool:
        return name in communicating or ("." in name and name.rsplit(".", 1)[1] in COLLECTIVES)

    changed = True
    while changed:  # a function communicates if it calls something that does
        changed = False
        for name, calls in functions.items():
            if name not in communicating and any(communicates(call) for call in calls):
                communicating.add(name)
                changed = True
    found = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _is_rank_zero_test(node.test):
                for statement in node.body:
                    bad = sorted(call for call in _calls(statement) if communicates(call))
                    found += [f"line {node.lineno}: {call}" for call in bad]
    return found


def test_no_collective_inside_a_rank_zero_branch() -> None:
    sources = [path.read_text() for path in sorted(PACKAGE_DIR.rglob("*.py"))]
    assert collectives_in_rank_zero_branches(sources) == []


def test_the_scan_finds_an_indirect_collective() -> None:
    """The scan itself works: a barrier reached through a helper inside `if is_main` is found."""
    source = (
        "def helper():\n    dist.barrier()\n\n"
        "def save(env):\n    if env.is_main:\n        helper()\n"
    )
    assert collectives_in_rank_zero_branches([source]) == ["line 5: helper"]
