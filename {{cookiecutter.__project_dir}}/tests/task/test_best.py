"""best.*: the best checkpoint by an evaluation metric is kept out of pruning and named in
best.json, and early stopping stops every rank at the same step with a checkpoint, through a
resume as in an unbroken run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.best import BEST_FILE
from {{ cookiecutter.package_name }}.checkpointing.layout import complete_checkpoints
from {{ cookiecutter.package_name }}.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import FAST, env_for, make_trainer, spawn

#: The evaluation's score at each step it runs (every 2 steps): best at 4, then three
#: evaluations without improvement.
SCORES = {2: 5.0, 4: 3.0, 6: 4.0, 8: 3.5, 10: 6.0, 12: 1.0}


class _ScoredTrainer(Trainer):
    """Evaluates to a scripted score: the verdicts below do not depend on how the task trains."""

    def evaluate(self, model: torch.nn.Module | None = None, name: str = "eval") -> dict:
        return {"score": SCORES[self.step]}


def _settings(run_dir: Path, max_steps: int) -> list[str]:
    return [
        *FAST,
        f"run.dir={run_dir}",
        f"train.max_steps={max_steps}",
        "train.eval_every=2",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=1",
        "best.metric=eval/score",
        "best.mode=min",
        "best.patience=3",
    ]


def _run(rank: int, world_size: int, run_dir: Path, max_steps: int) -> dict[str, Any]:
    config = load_config(None, _settings(run_dir, max_steps))
    trainer = make_trainer(config, env_for(rank, world_size))
    trainer.__class__ = _ScoredTrainer
    resumed = trainer.resume()
    status = trainer.fit()
    return {"resumed": resumed, "status": status, "step": trainer.step}


def _stopped_through_a_resume(rank: int, world_size: int, run_dir: Path) -> list[dict[str, Any]]:
    """Train to step 4, resume up to 20: it stops early at 10; a third launch does nothing."""
    return [_run(rank, world_size, run_dir, max_steps) for max_steps in (4, 20, 20)]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[dict]]]:
    workdir = tmp_path_factory.mktemp("best")
    ranks = spawn(2, _stopped_through_a_resume, workdir / "run", workdir=workdir)
    return workdir / "run", ranks


@pytest.mark.distributed
def test_early_stopping_stops_every_rank_at_the_same_step_through_a_resume(
    stopped_run: tuple[Path, list[list[dict]]],
) -> None:
    _, ranks = stopped_run
    for launches in ranks:
        assert [launch["step"] for launch in launches] == [4, 10, 10]
        assert [launch["status"] for launch in launches] == [0, 0, 0]
        assert [launch["resumed"] for launch in launches] == [False, True, True]


@pytest.mark.distributed
def test_the_best_checkpoint_survives_pruning_and_is_named_in_best_json(
    stopped_run: tuple[Path, list[list[dict]]],
) -> None:
    run_dir, _ = stopped_run
    # keep_last=1: the newest (the early stop's) and the best.
    assert [path.name for path in complete_checkpoints(run_dir)] == [
        "step_00000004",
        "step_00000010",
    ]
    best = json.loads((run_dir / BEST_FILE).read_text())
    assert (best["metric"], best["value"], best["step"]) == ("eval/score", 3.0, 4)
    assert Path(best["checkpoint"]) == run_dir / "checkpoints" / "step_00000004"


def test_a_new_best_between_scheduled_checkpoints_is_saved_at_its_step(tmp_path: Path) -> None:
    config = load_config(None, [*_settings(tmp_path, 6), "checkpoint.every_steps=100"])
    trainer = make_trainer(config)
    trainer.__class__ = _ScoredTrainer
    trainer.fit()
    # Step 2 was the first best, then 4; 6 is the end of training.
    assert [path.name for path in complete_checkpoints(tmp_path)] == [
        "step_00000004",
        "step_00000006",
    ]


def test_a_metric_the_evaluation_does_not_record_is_refused_naming_those_it_does(
    tmp_path: Path,
) -> None:
    config = load_config(None, [*_settings(tmp_path, 4), "best.metric=eval/f1"])
    trainer = make_trainer(config)
    trainer.__class__ = _ScoredTrainer
    with pytest.raises(ConfigError, match=r"best.metric=eval/f1 .* records eval/score"):
        trainer.fit()
