"""Rank discipline: replicas stay identical, rank 0 alone writes shared files, and no collective
ever runs inside a rank-0-only branch (the classic source of hangs)."""

from __future__ import annotations

import ast
import builtins
import io
import os
from pathlib import Path

import pytest
import torch

import {{ cookiecutter.package_name }}
from {{ cookiecutter.package_name }}.cluster.distributed import ReplicaMismatchError
from {{ cookiecutter.package_name }}.config import load_config

from ..helpers import FAST, env_for, make_trainer, run_torchrun, spawn, write_fault_entry

PACKAGE_DIR = Path({{ cookiecutter.package_name }}.__file__).parent


def _corrupt_rank_one_at_step_three(rank: int, world_size: int, run_dir: Path) -> dict:
    config = load_config(None, [*FAST, f"run.dir={run_dir}", "dist.check_replicas_every=1"])
    trainer = make_trainer(config, env_for(rank, world_size))

    def corrupt(optimizer: torch.optim.Optimizer, *_: object) -> None:
        if rank == 1 and trainer.step == 2:  # the optimizer step that makes step 3
            with torch.no_grad():
                next(trainer.model.parameters()).add_(1e-3)

    trainer.updates[0].optimizer.register_step_post_hook(corrupt)
    try:
        trainer.fit()
    except ReplicaMismatchError as error:
        return {"error": str(error), "step": trainer.step}
    return {"error": None, "step": trainer.step}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_replica_check_catches_a_diverged_rank(tmp_path: Path) -> None:
    """One rank's weights nudged outside DDP: every rank stops at that step, naming the rank."""
    results = spawn(2, _corrupt_rank_one_at_step_three, tmp_path / "run", workdir=tmp_path)
    for result in results:
        assert result["step"] == 3
        assert result["error"] is not None and "rank(s) [1] differ from rank 0" in result["error"]


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
