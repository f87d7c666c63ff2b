"""torchrun --max-restarts: a rank that fails mid-run is restarted with the others, the job
resumes from the last checkpoint and ends exactly where an unbroken run ends.

Both runs start from initial weights (init.weights, as fine-tuning does) and keep a moving
average of the weights (ema.decay): the restart must resume its own checkpoint, not start from
the initial weights again, and the average must continue bitwise, up to the exported weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from {{ cookiecutter.package_name }}.checkpoint import latest_checkpoint, load_checkpoint
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.task import Task

from .helpers import FAST, run_torchrun, write_fault_entry

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(300)]

TOTAL_STEPS = 12
CHECKPOINT_STEP = 4  # FAST saves every 4 steps
FAIL_IN_STEP = 6  # after the checkpoint at step 4: the restart resumes from there, step 5 is redone
#: A restart is a new start-up of every rank; one that neither trains nor fails by then hangs.
LAUNCH_TIMEOUT_S = 120

#: The fault: rank 1 fails in optimizer step FAIL_IN_STEP of the first attempt (torchrun
#: numbers the attempts in TORCHELASTIC_RESTART_COUNT).
FAILING_STEP = """
train_step = Trainer.train_step


def failing_train_step(self, batches):
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if first_attempt and self.env.rank == 1 and self.step + 1 == {step}:
        print("rank 1 fails in step {step}", file=sys.stderr, flush=True)
        {failure}
    return train_step(self, batches)


Trainer.train_step = failing_train_step
"""

FAILURES = {
    # Unwinds through the process group's teardown and exits non-zero.
    "exception": 'raise RuntimeError("rank 1 failed")',
    # No teardown at all, as when the out-of-memory killer ends a rank.
    "killed": "os.kill(os.getpid(), signal.SIGKILL)",
}


def _overrides(run_dir: Path, initial_weights: Path) -> list[str]:
    return [
        *FAST,
        f"run.dir={run_dir}",
        f"train.max_steps={TOTAL_STEPS}",
        f"init.weights={initial_weights}",
        "ema.decay=0.9",
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
def unbroken_run(tmp_path_factory: pytest.TempPathFactory, initial_weights: Path) -> dict:
    """The final state of the same training without a failure."""
    run_dir = tmp_path_factory.mktemp("unbroken") / "run"
    result = run_torchrun(2, _overrides(run_dir, initial_weights))
    assert result.returncode == 0, result.stderr[-6000:]
    return _final_state(run_dir)


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_rank_failing_after_a_checkpoint_is_restarted_and_ends_like_an_unbroken_run(
    failure: str, unbroken_run: dict, initial_weights: Path, tmp_path: Path
) -> None:
    fault = FAILING_STEP.format(step=FAIL_IN_STEP, failure=FAILURES[failure])
    entry = write_fault_entry(tmp_path, fault)
    run_dir = tmp_path / "run"

    result = run_torchrun(
        2,
        _overrides(run_dir, initial_weights),
        timeout=LAUNCH_TIMEOUT_S,
        entry=entry,
        max_restarts=1,
    )
    output = result.stderr

    assert result.returncode == 0, output[-6000:]
    assert f"rank 1 fails in step {FAIL_IN_STEP}" in output
    assert "resumed from" in output and f"at step {CHECKPOINT_STEP}" in output, output[-6000:]
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
