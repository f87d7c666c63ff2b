"""Stop signals end training cleanly: every rank finishes the same step, a checkpoint is saved
there, the exit status says whether to launch again, and the next launch loses no step.

SIGTERM (preemption, scancel, torchrun), SIGINT (Ctrl-C) and SIGHUP exit with 75; SIGUSR1 and
SIGUSR2 (Slurm's time-limit warning) with 0; a second Ctrl-C at once, with 130. With several
ranks the stop comes one step after the signal (the agreement is read a step late so that it
never blocks); with one process, right after the step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.layout import latest_checkpoint
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.faults import stopping
from {{ cookiecutter.package_name }}.faults.stopping import EXIT_INTERRUPTED, EXIT_RESUMABLE, StopRequests
from {{ cookiecutter.package_name }}.train import main
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import FAST, env_for, make_trainer, spawn

pytestmark = pytest.mark.timeout(300)

TOTAL_STEPS = 12  # checkpoints every 4 steps, evaluation every 4 steps (FAST)


def _overrides(run_dir: Path, *extra: str) -> list[str]:
    # Checks after every step, so that the stop step is known; the cadence has its own test.
    steps = f"train.max_steps={TOTAL_STEPS}"
    return [*FAST, f"run.dir={run_dir}", steps, "checkpoint.stop_check_s=0", *extra]


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)


def _arrange_signal(trainer: Trainer, signum: int, moment: str, step: int) -> None:
    """Make `trainer` send itself `signum` at `moment` ("step", "save" or "eval") of `step`.

    Patches the trainer's own methods, so the signal lands inside that piece of work.
    """
    name = {"step": "train_step", "save": "save", "eval": "evaluate"}[moment]
    original: Callable = getattr(trainer, name)
    offset = 1 if moment == "step" else 0  # train_step runs before the step count goes up

    def signalling(*args: object) -> object:
        if trainer.step + offset == step:
            _signal_self(signum)
        return original(*args)

    setattr(trainer, name, signalling)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}


def _unbroken(rank: int, world_size: int, workdir: Path) -> dict[str, torch.Tensor]:
    config = load_config(None, _overrides(workdir / "run"))
    trainer = make_trainer(config, env_for(rank, world_size))
    trainer.fit()
    return _weights(trainer)


def _signal_on_rank_1_then_resume(
    rank: int, world_size: int, workdir: Path, signame: str, moment: str, step: int
) -> dict:
    config = load_config(None, _overrides(workdir / "run"))
    env = env_for(rank, world_size)
    stop = StopRequests(check_s=0)
    with stop.installed():  # as train.main does, before anything is built
        if rank == 1 and moment == "start-up":
            _signal_self(getattr(signal, signame))
        first = make_trainer(config, env, stop=stop)
        if rank == 1 and moment != "start-up":
            _arrange_signal(first, getattr(signal, signame), moment, step)
        status = first.fit()
    newest = latest_checkpoint(first.run_dir)

    second = make_trainer(config, env)
    second.resume()
    resumed_at = second.step
    second.fit()
    return {
        "status": status,
        "stopped_at": first.step,
        "newest_checkpoint": newest.name if newest else None,
        "resumed_at": resumed_at,
        "finished_at": second.step,
        "weights": _weights(second),
    }


@pytest.fixture(scope="module")
def unbroken_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Rank 0's final weights of the same 2-rank run without a signal."""
    workdir = tmp_path_factory.mktemp("unbroken")
    return spawn(2, _unbroken, workdir, workdir=workdir)[0]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("signame", "moment", "step", "status", "stop_step"),
    [
        ("SIGTERM", "step", 6, EXIT_RESUMABLE, 7),
        ("SIGUSR2", "save", 8, 0, 9),
        ("SIGTERM", "eval", 4, EXIT_RESUMABLE, 5),
        ("SIGTERM", "start-up", 0, EXIT_RESUMABLE, 0),
    ],
    ids=[
        "sigterm-mid-step",
        "sigusr2-during-save",
        "sigterm-during-eval",
        "sigterm-during-start-up",
    ],
)
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step_and_loses_nothing(
    tmp_path: Path,
    unbroken_weights: dict[str, torch.Tensor],
    signame: str,
    moment: str,
    step: int,
    status: int,
    stop_step: int,
) -> None:
    results = spawn(
        2, _signal_on_rank_1_then_resume, tmp_path, signame, moment, step, workdir=tmp_path
    )
    for result in results:
        assert result["status"] == status
        assert result["stopped_at"] == stop_step
        expected = f"step_{stop_step:08d}" if stop_step else None
        assert result["newest_checkpoint"] == expected
        assert result["resumed_at"] == stop_step
        assert result["finished_at"] == TOTAL_STEPS
        for name, tensor in unbroken_weights.items():
            assert torch.equal(result["weights"][name], tensor), name


def _sigterm_on_rank_1_after(rank: int, world_size: int, workdir: Path, delay: float) -> dict:
    """SIGTERM from a timer started as training starts: it lands wherever rank 1 happens to be
    (a step, a save, an evaluation, the agreement itself, or after the last step)."""
    config = load_config(None, _overrides(workdir / "run"))
    env = env_for(rank, world_size)
    stop = StopRequests(check_s=0)
    with stop.installed():
        first = make_trainer(config, env, stop=stop)
        timer = threading.Timer(delay, _signal_self, (signal.SIGTERM,))
        if rank == 1:
            timer.start()
        status = first.fit()
        timer.cancel()
        timer.join() if timer.is_alive() else None
    newest = latest_checkpoint(first.run_dir)
    second = make_trainer(config, env)
    second.resume()
    second.fit()
    return {
        "status": status,
        "stopped_at": first.step,
        "newest_checkpoint": newest.name if newest else None,
        "weights": _weights(second),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.1, 0.2, 0.4])
def test_sigterm_at_any_moment_stops_both_ranks_together_and_loses_no_step(
    tmp_path: Path, unbroken_weights: dict[str, torch.Tensor], delay: float
) -> None:
    results = spawn(2, _sigterm_on_rank_1_after, tmp_path, delay, workdir=tmp_path)
    assert results[0]["status"] == results[1]["status"]
    assert results[0]["stopped_at"] == results[1]["stopped_at"]
    for result in results:
        if result["status"] == EXIT_RESUMABLE and result["stopped_at"] > 0:
            assert result["newest_checkpoint"] == f"step_{result['stopped_at']:08d}"
        else:  # the signal came before the first step or after the last one
            assert result["stopped_at"] in (0, TOTAL_STEPS)
        for name, tensor in unbroken_weights.items():
            assert torch.equal(result["weights"][name], tensor), name


def _sigterm_on_rank_1_checking_every_two_seconds(
    rank: int, world_size: int, workdir: Path
) -> dict:
    """SIGTERM in rank 1's step 40, long after the first check has set the interval from the
    step time: with checks 2 s apart, more than one step apart unless a step takes a second."""
    overrides = [*FAST, f"run.dir={workdir / 'run'}", "train.max_steps=5000", "train.epochs=100"]
    config = load_config(None, [*overrides, "train.eval_every=100000"])
    stop = StopRequests(check_s=2.0)
    with stop.installed():
        first = make_trainer(config, env_for(rank, world_size), stop=stop)
        if rank == 1:
            _arrange_signal(first, signal.SIGTERM, "step", 40)
        status = first.fit()
    newest = latest_checkpoint(first.run_dir)
    return {
        "status": status,
        "stopped_at": first.step,
        "newest_checkpoint": newest.name,
        "interval": stop._interval,
    }


@pytest.mark.distributed
def test_checking_every_few_seconds_still_stops_every_rank_at_one_step(tmp_path: Path) -> None:
    """Short steps: the ranks compare notes every many steps, chosen alike on every rank."""
    results = spawn(2, _sigterm_on_rank_1_checking_every_two_seconds, tmp_path, workdir=tmp_path)
    assert 40 <= results[0]["stopped_at"] == results[1]["stopped_at"] < 5000
    assert results[0]["interval"] == results[1]["interval"] > 1
    for result in results:
        assert result["status"] == EXIT_RESUMABLE
        assert result["newest_checkpoint"] == f"step_{result['stopped_at']:08d}"


def _agree_without_a_first_agreement(rank: int, world_size: int) -> int | None:
    stop = StopRequests(check_s=0)
    if rank == 1:
        stop.note(signal.SIGTERM, 1000.0)
    for step in range(1, 6):
        if stop.agreed_after_step():
            return step
    return None


def test_a_loop_that_never_agreed_before_its_first_step_still_stops_every_rank_together(
    tmp_path: Path,
) -> None:
    """A loop of a user's own may call only agreed_after_step: the ranks still find each other
    and stop at one step, though only rank 1 was signalled."""
    stopped_at = spawn(2, _agree_without_a_first_agreement, workdir=tmp_path)
    assert stopped_at[0] is not None
    assert stopped_at == [stopped_at[0]] * 2


def test_a_single_process_stops_right_after_the_step_it_was_signalled_in(tmp_path: Path) -> None:
    trainer = make_trainer(load_config(None, _overrides(tmp_path)))
    _arrange_signal(trainer, signal.SIGTERM, "step", 3)
    assert trainer.fit() == EXIT_RESUMABLE
    assert trainer.step == 3
    assert latest_checkpoint(trainer.run_dir).name == "step_00000003"


@pytest.mark.parametrize(
    ("signame", "status", "reason"),
    [
        ("SIGINT", EXIT_RESUMABLE, "SIGINT"),
        ("SIGHUP", EXIT_RESUMABLE, "SIGHUP"),
        ("SIGUSR1", 0, "a stop request (SIGUSR1)"),
    ],
)
def test_ctrl_c_sighup_and_sigusr1_stop_with_a_checkpoint_and_the_log_names_them(
    tmp_path: Path, signame: str, status: int, reason: str
) -> None:
    """Ctrl-C, a closed terminal or ssh session, a stop request: a checkpoint at the step and
    the status for it. The ranks agree on them as on SIGTERM (a stop) and SIGUSR2 (a request):
    the 2-rank cases above."""
    trainer = make_trainer(load_config(None, _overrides(tmp_path)))
    _arrange_signal(trainer, getattr(signal, signame), "step", 3)
    assert trainer.fit() == status
    assert trainer.stop.reason == reason
    assert latest_checkpoint(trainer.run_dir).name == "step_00000003"


def test_a_second_ctrl_c_exits_at_once_without_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first Ctrl-C asks for the stop's checkpoint; a second one, during that save, ends the
    command at once (130), and leaves no checkpoint that a resume would load. (A clock that
    moves a minute per signal: the second one is pressed, not passed on by a launcher.)"""
    train_step, save = Trainer.train_step, Trainer.save
    minutes = iter(range(60, 6000, 60))
    monkeypatch.setattr(stopping, "_now", lambda: float(next(minutes)))

    def interrupted_train_step(self: Trainer, batches: object) -> tuple:
        if self.step == 1:
            _signal_self(signal.SIGINT)
        return train_step(self, batches)

    def interrupted_save(self: Trainer) -> Path:
        _signal_self(signal.SIGINT)
        return save(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted_train_step)
    monkeypatch.setattr(Trainer, "save", interrupted_save)
    assert main(_overrides(tmp_path / "run")) == EXIT_INTERRUPTED
    assert latest_checkpoint(tmp_path / "run") is None


def test_a_ctrl_c_that_reaches_a_rank_twice_is_one_stop_with_a_checkpoint() -> None:
    """A terminal sends SIGINT to its whole foreground group, and torchrun (or srun, mpirun)
    passes the one it got on to its workers milliseconds later: a rank that sees both stops as
    on one Ctrl-C, and the log says what arrived. A Ctrl-C a second or more later is a second
    press: exit at once."""
    stop = StopRequests()
    stop.note(signal.SIGINT, 1000.0)
    stop.note(signal.SIGINT, 1000.004)  # the launcher's copy: no KeyboardInterrupt
    assert stop.describe_arrivals().endswith(
        "0.004 s later: the same Ctrl-C passed on by the launcher"
    )
    with pytest.raises(KeyboardInterrupt):
        stop.note(signal.SIGINT, 1002.0)


#: The training command as `python -m` runs it, sending itself SIGTERM as soon as torch starts
#: to be imported: a preemption or torchrun's stop while the process is still starting.
SIGTERM_DURING_IMPORTS = """
import importlib.abc, os, runpy, signal, sys


class SignalOnTorchImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGTERM)
        return None


sys.meta_path.insert(0, SignalOnTorchImport())
runpy.run_module("{{ cookiecutter.package_name }}.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.faults  # a process of its own per case: run once, not with every option pair
@pytest.mark.parametrize(
    ("setting", "status"),
    [("true", EXIT_RESUMABLE), ("false", -signal.SIGTERM)],
    ids=["stop-on-signals", "signals-left-alone"],
)
def test_a_sigterm_while_torch_is_imported_takes_effect_once_training_starts(
    tmp_path: Path, setting: str, status: int
) -> None:
    """Recorded from the first lines of the entry point, before the heavy imports: every rank
    then stops at start-up with the documented status. With stop_on_signals=false the signal
    keeps its usual effect, delivered once the setting is read."""
    entry = tmp_path / "entry.py"
    entry.write_text(SIGTERM_DURING_IMPORTS)
    overrides = _overrides(tmp_path / "run", f"checkpoint.stop_on_signals={setting}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(entry), *overrides], env=env, capture_output=True, text=True
    )
    assert result.returncode == status, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    if status == EXIT_RESUMABLE:
        assert f"stopped at step 0 of {TOTAL_STEPS} on SIGTERM" in result.stderr


def test_the_training_command_exits_75_after_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The status that torchrun restarts on and the Slurm script requeues on."""
    train_step = Trainer.train_step

    def signalling_train_step(self: Trainer, batches: object) -> tuple:
        if self.step == 2:
            _signal_self(signal.SIGTERM)
        return train_step(self, batches)

    monkeypatch.setattr(Trainer, "train_step", signalling_train_step)
    assert main(_overrides(tmp_path / "run")) == EXIT_RESUMABLE
    assert latest_checkpoint(tmp_path / "run").name == "step_00000003"


def test_the_previous_handlers_are_back_after_training(tmp_path: Path) -> None:
    trainer = make_trainer(load_config(None, _overrides(tmp_path)))
    _arrange_signal(trainer, signal.SIGUSR1, "step", 3)
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    assert trainer.fit() == 0
    assert trainer.step == 3
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_with_stop_on_signals_off_the_signals_are_left_alone(tmp_path: Path) -> None:
    config = load_config(None, _overrides(tmp_path, "checkpoint.stop_on_signals=false"))
    trainer = make_trainer(config)
    train_step = trainer.train_step
    handlers = []

    def recording_train_step(batches: object) -> tuple:
        handlers.append(signal.getsignal(signal.SIGTERM))
        return train_step(batches)

    trainer.train_step = recording_train_step
    before = signal.getsignal(signal.SIGTERM)
    assert trainer.fit() == 0
    assert trainer.step == TOTAL_STEPS
    assert set(handlers) == {before}
