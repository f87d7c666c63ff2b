"""torchrun --max-restarts: a rank that fails mid-run is restarted with the others, the job
resumes from the last checkpoint and ends exactly where an unbroken run ends. One launch holds
both kinds of failure: rank 1 raises in the first attempt, and is killed in the second.

Both runs start from initial weights (init.weights, as fine-tuning does) and keep a moving
average of the weights (ema.decay): the restart must resume its own checkpoint, not start from
the initial weights again, and the average must continue bitwise, up to the exported weights.
The unbroken run's first checkpoint takes longer to write than `dist.timeout_s`, which the
ranks wait for.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import torch

from {{ cookiecutter.package_name }}.checkpointing.checkpoint import load_checkpoint
from {{ cookiecutter.package_name }}.checkpointing.layout import latest_checkpoint
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.task import Task

from ..helpers import FAST, run_torchrun, write_fault_entry

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(300)]

TOTAL_STEPS = 12
#: Attempt (torchrun's TORCHELASTIC_RESTART_COUNT) -> the step rank 1 fails in, how, and the
#: checkpoint the next attempt resumes from (FAST saves every 4 steps): each failure comes
#: after a checkpoint, so that the steps since are trained again.
FAILURES = {
    # Unwinds through the process group's teardown and exits non-zero.
    "0": (6, 'raise RuntimeError("rank 1 failed")', 4),
    # No teardown at all, as when the out-of-memory killer ends a rank.
    "1": (10, "os.kill(os.getpid(), signal.SIGKILL)", 8),
}
#: A restart is a new start-up of every rank; one that neither trains nor fails by then hangs.
LAUNCH_TIMEOUT_S = 180
#: The unbroken run's collective timeout, and how long rank 0 takes to write the replicated
#: state of its first checkpoint (as a large model on a slow disk).
COLLECTIVE_TIMEOUT_S = 4
SLOW_WRITE_S = 5

SLOW_FIRST_SAVE = """
atomic_save = checkpoint._atomic_save


def slow_atomic_save(obj, path):
    if path.name == checkpoint.STATE_FILE and not os.environ.get("SLOW_SAVE_DONE"):
        os.environ["SLOW_SAVE_DONE"] = "1"
        time.sleep({seconds})
    return atomic_save(obj, path)


checkpoint._atomic_save = slow_atomic_save
"""

FAILING_STEPS = """
train_step = Trainer.train_step
failures = {failures}


def failing_train_step(self, batches):
    step, failure, _ = failures.get(os.environ.get("TORCHELASTIC_RESTART_COUNT"), (0, "", 0))
    if self.env.rank == 1 and self.step + 1 == step:
        print("rank 1 fails in step", step, file=sys.stderr, flush=True)
        exec(failure)
    return train_step(self, batches)


Trainer.train_step = failing_train_step
"""


def _overrides(run_dir: Path, initial_weights: Path) -> list[str]:
    return [
        *FAST,
        f"run.dir={run_dir}",
        f"train.max_steps={TOTAL_STEPS}",
        f"init.weights={initial_weights}",
        "ema.decay=0.9",
        "data.num_workers=2",  # as on a real node: the restarted ranks start theirs afresh
    ]


@pytest.fixture(scope="module")
def initial_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state dict of the task's model drawn from another seed: the weights fine-tuned."""
    config = load_config(None, FAST)
    torch.manual_seed(config.run.seed + 1)
    path = tmp_path_factory.mktemp("pretrained") / "weights.pt"
    torch.save(Task(config.task, seed=config.run.seed).build_model().state_dict(), path)
    return path


def _final_state(run_dir: Path) -> dict:
    newest = latest_checkpoint(run_dir)
    assert newest is not None, f"no checkpoint in {run_dir}"
    return load_checkpoint(newest, rank=0, world_size=2).state


@pytest.fixture(scope="module")
def unbroken_launch(
    tmp_path_factory: pytest.TempPathFactory, initial_weights: Path
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The same training without a failure, whose first save is slower than the collective
    timeout."""
    workdir = tmp_path_factory.mktemp("unbroken")
    run_dir = workdir / "run"
    entry = write_fault_entry(workdir, SLOW_FIRST_SAVE.format(seconds=SLOW_WRITE_S))
    overrides = [*_overrides(run_dir, initial_weights), f"dist.timeout_s={COLLECTIVE_TIMEOUT_S}"]
    return run_torchrun(2, overrides, entry=entry), run_dir


@pytest.fixture(scope="module")
def unbroken_run(unbroken_launch: tuple[subprocess.CompletedProcess[str], Path]) -> dict:
    """The final state of the unbroken training."""
    result, run_dir = unbroken_launch
    assert result.returncode == 0, result.stderr[-6000:]
    return _final_state(run_dir)


def test_a_checkpoint_write_longer_than_the_collective_timeout_is_waited_for(
    unbroken_launch: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, run_dir = unbroken_launch
    assert result.returncode == 0, result.stderr[-6000:]
    written = re.search(r"saved checkpoint \S+step_00000004, written in ([\d.]+) s", result.stderr)
    assert written and float(written[1]) >= SLOW_WRITE_S > COLLECTIVE_TIMEOUT_S
    assert latest_checkpoint(run_dir).name == f"step_{TOTAL_STEPS:08d}"


def test_a_rank_that_raises_then_one_that_is_killed_are_restarted_and_end_like_an_unbroken_run(
    unbroken_run: dict, initial_weights: Path, tmp_path: Path
) -> None:
    entry = write_fault_entry(tmp_path, FAILING_STEPS.format(failures=FAILURES))
    run_dir = tmp_path / "run"

    result = run_torchrun(
        2,
        _overrides(run_dir, initial_weights),
        timeout=LAUNCH_TIMEOUT_S,
        entry=entry,
        max_restarts=len(FAILURES),
    )
    output = result.stderr

    assert result.returncode == 0, output[-6000:]
    for step, _, resumed_at in FAILURES.values():
        assert f"rank 1 fails in step {step}" in output
        assert f"at step {resumed_at}" in output, output[-6000:]
    state = _final_state(run_dir)
    assert latest_checkpoint(run_dir).name == f"step_{TOTAL_STEPS:08d}"
    assert state["step"] == TOTAL_STEPS
    assert "initialised the model with the weights from" in output
    for key in ("model", "ema"):
        _assert_bitwise(state[key], unbroken_run[key], f"{key} differs from the unbroken run's")
    exported = safetensors.torch.load_file(run_dir / "export" / "model_ema.safetensors")
    ema_weights = {
        name.removeprefix("module."): tensor
        for name, tensor in state["ema"].items()
        if name.startswith("module.")
    }
    _assert_bitwise(exported, {name: ema_weights[name] for name in exported}, "exported EMA")


def _assert_bitwise(found: dict, expected: dict, what: str) -> None:
    assert found.keys() == expected.keys(), what
    differing = [name for name, tensor in expected.items() if not torch.equal(found[name], tensor)]
    assert not differing, f"{what}: {differing}"
