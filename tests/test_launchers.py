"""The rendered launchers: exact dry-run commands, and real runs on the engines they target.

Dry runs are compared with golden files in tests/golden/ (regenerate them with
UPDATE_GOLDEN=1 after an intended change, and review the diff). The real runs train the
rendered project across two network-namespace hosts with torchrun's c10d rendezvous, and under
`sbatch` on a one-node Slurm cluster started for the tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import CompletedProcess

import pytest
from cookiecutter.main import cookiecutter
from engines import SlurmCluster, slurm_cluster, wait_until
from matrix import ROOT

GOLDEN = Path(__file__).parent / "golden"
BIN = Path(sys.executable).parent
PACKAGE = "launch_test"

pytestmark = [pytest.mark.xdist_group("launchers"), pytest.mark.timeout(600)]
#: The real torchrun runs need no Slurm cluster: under `pytest -n` they run beside the sbatch
#: tests, on another worker.
torchrun_group = pytest.mark.xdist_group("launchers-torchrun")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default project (Slurm and containers on), importable from its source tree."""
    out = tmp_path_factory.mktemp("launch")
    context = {"project_name": "Launch Test"}
    return Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(out), extra_context=context))


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stand-ins for the machine's commands, one directory each, so that dry runs see a fixed
    machine: a Slurm allocation of node01 and node02, four GPUs, or no NVIDIA driver."""
    root = tmp_path_factory.mktemp("fake-bin")
    fakes = {
        "slurm": ("scontrol", 'printf "node01\\nnode02\\n"'),
        "gpus": (
            "nvidia-smi",
            'for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done',
        ),
        "no-gpus": ("nvidia-smi", 'echo "NVIDIA-SMI has failed: no driver" >&2; exit 9'),
    }
    for fake, (command, body) in fakes.items():
        script = root / fake / command
        script.parent.mkdir()
        script.write_text(f"#!/usr/bin/env bash\n{body}\n")
        script.chmod(0o755)
    return root


def launch(project: Path, script: str, env: dict[str, str], path: list[Path]) -> CompletedProcess:
    """Run a launcher from the project root with only `env` and `path` set."""
    return subprocess.run(
        ["bash", script, "train.max_steps=10"],
        cwd=project,
        env={"PATH": ":".join([*map(str, path), "/usr/bin", "/bin"]), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def dry_run(project: Path, script: str, env: dict[str, str], path: list[Path]) -> str:
    """The launcher's dry-run output."""
    result = launch(project, script, {**env, "DRY_RUN": "1"}, path)
    assert result.returncode == 0, result.stderr
    return result.stdout


SLURM_JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_JOB_NUM_NODES": "2",
}
#: case name: (launcher, environment, fake machine)
DRY_RUNS = {
    "torchrun-cpu": ("launch/torchrun.sh", {}, "no-gpus"),
    "torchrun-gpus": ("launch/torchrun.sh", {}, "gpus"),
    "torchrun-visible-gpus": ("launch/torchrun.sh", {"CUDA_VISIBLE_DEVICES": "2,3"}, "gpus"),
    "torchrun-two-nodes": (
        "launch/torchrun.sh",
        {
            "NNODES": "2",
            "NPROC_PER_NODE": "8",
            "RDZV_ENDPOINT": "node01:29400",
            "RDZV_ID": "exp1",
            "MAX_RESTARTS": "3",
            "LOCAL_ADDR": "node01",
        },
        "gpus",
    ),
    "sbatch-gpus": ("launch/slurm/train.sbatch", {**SLURM_JOB, "SLURM_GPUS_ON_NODE": "8"}, "slurm"),
    "sbatch-cpu": ("launch/slurm/train.sbatch", SLURM_JOB, "slurm"),
    "sbatch-task-per-gpu": (
        "launch/slurm/train.sbatch",
        {**SLURM_JOB, "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "8"},
        "slurm",
    ),
    "sbatch-container": (
        "launch/slurm/train.sbatch",
        {**SLURM_JOB, "SLURM_GPUS_ON_NODE": "8", "CONTAINER": "train.sif"},
        "slurm",
    ),
    # The rendezvous port follows the job id, so that jobs sharing a node do not collide; an
    # exported MASTER_PORT wins.
    "sbatch-next-job": (
        "launch/slurm/train.sbatch",
        {**SLURM_JOB, "SLURM_JOB_ID": "4243", "SLURM_GPUS_ON_NODE": "8"},
        "slurm",
    ),
    "sbatch-task-per-gpu-next-job": (
        "launch/slurm/train.sbatch",
        {
            **SLURM_JOB,
            "SLURM_JOB_ID": "4243",
            "SLURM_GPUS_ON_NODE": "8",
            "SLURM_NTASKS_PER_NODE": "8",
        },
        "slurm",
    ),
    "sbatch-master-port": (
        "launch/slurm/train.sbatch",
        {**SLURM_JOB, "SLURM_GPUS_ON_NODE": "8", "MASTER_PORT": "31000"},
        "slurm",
    ),
    "sbatch-task-per-gpu-master-port": (
        "launch/slurm/train.sbatch",
        {
            **SLURM_JOB,
            "SLURM_GPUS_ON_NODE": "8",
            "SLURM_NTASKS_PER_NODE": "8",
            "MASTER_PORT": "31000",
        },
        "slurm",
    ),
}


@pytest.mark.parametrize("case", DRY_RUNS)
def test_dry_run_prints_the_exact_command(project: Path, fake_bin: Path, case: str) -> None:
    script, env, machine = DRY_RUNS[case]
    if "CONTAINER" in env:
        (project / env["CONTAINER"]).touch()
    command = dry_run(project, script, env, [fake_bin / machine])
    golden = GOLDEN / f"{case}.txt"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(command)
    assert command == golden.read_text()


def rendezvous_port(command: str) -> int:
    """The port of a batch script's dry run: its c10d endpoint, or MASTER_PORT without torchrun."""
    found = re.search(r"--rdzv-endpoint=node01:(\d+) |MASTER_PORT=(\d+) ", command)
    assert found, command
    return int(found.group(1) or found.group(2))


@pytest.mark.parametrize("tasks_per_node", ["1", "8"], ids=["torchrun", "task-per-gpu"])
def test_sbatch_port_follows_the_job_id_unless_exported(
    project: Path, fake_bin: Path, tasks_per_node: str
) -> None:
    """Two jobs on one node must not meet on the same port: the default is 20000 + job id % 10000
    (below Linux's ephemeral ports); an exported MASTER_PORT is used as given."""
    env = {**SLURM_JOB, "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": tasks_per_node}
    script = "launch/slurm/train.sbatch"
    path = [fake_bin / "slurm"]
    ports = {
        job_id: rendezvous_port(dry_run(project, script, {**env, "SLURM_JOB_ID": job_id}, path))
        for job_id in ("4242", "4243", "123456")
    }
    assert ports == {"4242": 24242, "4243": 24243, "123456": 23456}
    exported = dry_run(project, script, {**env, "MASTER_PORT": "31000"}, path)
    assert rendezvous_port(exported) == 31000


#: Every setting the launchers read as a number, with the other settings it needs.
NUMERIC_SETTINGS = [
    ("launch/slurm/train.sbatch", "SLURM_JOB_ID", SLURM_JOB),
    ("launch/slurm/train.sbatch", "SLURM_JOB_NUM_NODES", SLURM_JOB),
    ("launch/slurm/train.sbatch", "SLURM_GPUS_ON_NODE", SLURM_JOB),
    ("launch/slurm/train.sbatch", "SLURM_NTASKS_PER_NODE", SLURM_JOB),
    ("launch/slurm/train.sbatch", "MASTER_PORT", SLURM_JOB),
    ("launch/slurm/train.sbatch", "NPROC_PER_NODE", SLURM_JOB),
    ("launch/slurm/train.sbatch", "SHUTDOWN_TIMEOUT", SLURM_JOB),
    ("launch/torchrun.sh", "NNODES", {"RDZV_ENDPOINT": "node01:29400"}),
    ("launch/torchrun.sh", "NPROC_PER_NODE", {}),
    ("launch/torchrun.sh", "MAX_RESTARTS", {}),
    ("launch/torchrun.sh", "SHUTDOWN_TIMEOUT", {}),
]


@pytest.mark.parametrize(
    ("script", "name", "env"),
    NUMERIC_SETTINGS,
    ids=[f"{Path(script).name}-{name}" for script, name, _ in NUMERIC_SETTINGS],
)
def test_hostile_numbers_are_refused_without_running_them(
    project: Path, fake_bin: Path, tmp_path: Path, script: str, name: str, env: dict[str, str]
) -> None:
    """Bash arithmetic runs command substitutions inside array subscripts: `(( v > 0 ))` or
    `[[ v -gt 0 ]]` with v='a[$(cmd)]' runs cmd. The launchers check such settings as plain
    digits first and stop with a clear message."""
    marker = tmp_path / "ran"
    hostile = f"a[$(touch {marker})]"
    result = launch(project, script, {**env, name: hostile, "DRY_RUN": "1"}, [fake_bin / "slurm"])
    assert not marker.exists(), f"{name} ran a command"
    assert result.returncode == 2, result.stderr
    assert f"{name} must be a" in result.stderr
    assert hostile in result.stderr
    assert result.stdout == ""


def test_hostile_cuda_visible_devices_is_only_counted(
    project: Path, fake_bin: Path, tmp_path: Path
) -> None:
    """torchrun.sh counts the entries of CUDA_VISIBLE_DEVICES as text, never as arithmetic."""
    marker = tmp_path / "ran"
    env = {"CUDA_VISIBLE_DEVICES": f"a[$(touch {marker})]"}
    command = dry_run(project, "launch/torchrun.sh", env, [fake_bin / "gpus"])
    assert not marker.exists()
    assert "--nproc-per-node=1 " in command


def test_an_empty_cuda_visible_devices_hides_every_gpu(project: Path, fake_bin: Path) -> None:
    """CUDA sees no GPU when CUDA_VISIBLE_DEVICES is set and empty: torchrun.sh starts the 2 CPU
    processes of a machine without GPUs, not one per GPU that nvidia-smi lists."""
    env = {"CUDA_VISIBLE_DEVICES": ""}
    command = dry_run(project, "launch/torchrun.sh", env, [fake_bin / "gpus"])
    assert "--nproc-per-node=2 " in command


@pytest.mark.parametrize(
    ("script", "env", "message"),
    [
        ("launch/slurm/train.sbatch", {}, "not inside a Slurm job: submit this script with sbatch"),
        ("launch/slurm/train.sbatch", {**SLURM_JOB, "MASTER_PORT": "70000"}, "must be a port"),
        ("launch/torchrun.sh", {"NNODES": "2"}, "NNODES=2 needs RDZV_ENDPOINT=HOST:PORT"),
        ("launch/torchrun.sh", {"NNODES": "2", "RDZV_ENDPOINT": "node01"}, "must be HOST:PORT"),
        ("launch/torchrun.sh", {"NPROC_PER_NODE": "all"}, "NPROC_PER_NODE must be a positive"),
        ("launch/torchrun.sh", {"NNODES": "0"}, "NNODES must be a positive number"),
        ("launch/torchrun.sh", {"MAX_RESTARTS": "-1"}, "MAX_RESTARTS must be a number"),
        ("launch/slurm/train.sbatch", {**SLURM_JOB, "CONTAINER": "nope.sif"}, "is not a file"),
    ],
    ids=lambda value: value if isinstance(value, str) and "/" not in value else None,
)
def test_bad_launch_settings_fail_before_starting_anything(
    project: Path, fake_bin: Path, script: str, env: dict[str, str], message: str
) -> None:
    result = launch(project, script, {**env, "DRY_RUN": "1"}, [fake_bin / "slurm"])
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


SHORT_RUN = [
    "task.num_train_samples=512",
    "task.hidden_dim=32",
    "train.global_batch_size=32",
    "train.micro_batch_size=8",
    "train.max_steps=20",
    "train.log_every=5",
    "checkpoint.every_steps=10",
    # A loader worker process per rank, as on any real node: it gets every signal a launcher or
    # a terminal sends the job's processes. One is enough for that (the generated fault tests
    # and the two-host tests run 2), and spares the CPU these runs share.
    "data.num_workers=1",
]


#: Steps of a run long enough to be interrupted: it is signalled once its first checkpoint
#: (step 100) is written, and stops within a few seconds (300 to 460 steps here, at the
#: stop check after the signal); a requeued run then trains the rest.
LONG_STEPS = 1200
LONG_RUN = [
    *SHORT_RUN,
    "train.epochs=1000",
    f"train.max_steps={LONG_STEPS}",
    "train.log_every=500",
    "checkpoint.every_steps=100",
    # What a signal does to loader workers is the torchrun and scancel tests' (WORKER): these
    # long runs across a requeue load in the training process, sparing the CPU they share.
    "data.num_workers=0",
]
WORKER = "data.num_workers=1"
#: A run that no test lets finish: the torchrun tests stop it by a signal, however long the
#: launches they make meanwhile take on a loaded machine.
UNENDING_STEPS = 1_000_000
UNENDING_RUN = [
    *SHORT_RUN,
    "train.epochs=100000",
    f"train.max_steps={UNENDING_STEPS}",
    "train.log_every=500",
    "checkpoint.every_steps=100",
]


def project_env(project: Path, **extra: str) -> dict[str, str]:
    """The environment a user has after installing the project: its package and torchrun."""
    path = f"{BIN}:{os.environ['PATH']}"
    env = {"PATH": path, "PYTHONPATH": str(project / "src"), "OMP_NUM_THREADS": "1"}
    return {**os.environ, **env, **extra}


def torchrun_report(run_dir: Path) -> str:
    """What torchrun itself wrote, which the launcher keeps beside the run's logs."""
    return (run_dir / f"torchrun_{socket.gethostname()}.log").read_text()


def assert_ends_with_its_status(output: str, status: int) -> None:
    """The launcher's last line gives the exit status, and torchrun's report (a
    ChildFailedError or SignalException traceback) is nowhere on the screen."""
    last = output.rstrip("\n").splitlines()[-1]
    assert re.match(rf"launch: exit status {status} on \S+: ", last), output[-3000:]
    torchrun_words = ("Traceback", "ChildFailedError", "SignalException")
    assert not [word for word in torchrun_words if word in output], output[-3000:]


def assert_ends_with_the_training_s_message(output: str, message: str, status: int) -> None:
    """The last lines are the training's (its `message`, a summary line after it at most) and
    the launcher's status line."""
    assert_ends_with_its_status(output, status)
    assert message in "".join(output.rstrip("\n").splitlines()[-3:-1]), output[-3000:]


def final_checkpoint(run_dir: Path) -> dict:
    """The completion marker of the newest checkpoint (written last, so the checkpoint is whole)."""
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return json.loads((newest / "COMPLETE").read_text())


@torchrun_group
def test_usr1_stops_a_torchrun_run_after_one_step_with_a_checkpoint(
    project: Path, tmp_path: Path
) -> None:
    """USR1 to launch/torchrun.sh, as `kill -USR1 PID` sends it: the script passes it on to
    torchrun, which passes it on to its workers (--signals-to-handle) instead of dying of it;
    both ranks stop after the same step, save a checkpoint there, and the script exits 0.
    Meanwhile a second launch on the same run directory is refused with exit status 4."""
    launch, run_dir, log = start_torchrun_run(project, tmp_path)
    second = subprocess.run(  # while the first one runs: another job holds the run directory
        ["bash", "launch/torchrun.sh", *UNENDING_RUN, f"run.dir={run_dir}"],
        cwd=project,
        env=project_env(project, NPROC_PER_NODE="2"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 4, second.stderr[-3000:]  # the training's, not torchrun's 1
    assert "is in use by another job" in second.stderr
    os.kill(launch.pid, signal.SIGUSR1)
    [code] = wait_for_all([launch], timeout=120)
    text = log.read_text()
    assert code == 0, text[-3000:]
    stopped = re.search(r"stopped at step (\d+) of \d+ on a stop request \(SIGUSR1\)", text)
    assert stopped, text[-3000:]
    # torchrun passing it on to each worker, in its own output, kept beside the run's logs
    assert "closing signal SIGUSR1" in torchrun_report(run_dir)
    assert final_checkpoint(run_dir)["step"] == int(stopped.group(1))


def wait_for_first_checkpoint(run_dir: Path) -> None:
    """Until the run has saved a checkpoint: the training is running, its signal handlers set."""
    checkpoints = run_dir / "checkpoints"
    wait_until(lambda: any(checkpoints.glob("step_*/COMPLETE")), 120, "a first checkpoint")


def start_torchrun_run(project: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """An UNENDING_RUN of 2 processes under launch/torchrun.sh, once its first checkpoint is
    written: (launcher, run dir, log)."""
    run_dir = tmp_path / "run"
    log = tmp_path / "torchrun.log"
    with log.open("w") as output:
        launcher = subprocess.Popen(
            ["bash", "launch/torchrun.sh", *UNENDING_RUN, f"run.dir={run_dir}"],
            cwd=project,
            env=project_env(project, NPROC_PER_NODE="2"),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for_first_checkpoint(run_dir)
    return launcher, run_dir, log


#: Who gets SIGTERM, and the exit status of launch/torchrun.sh then.
TERM_TARGETS = {
    # The script, as `kill PID`, `docker stop` or a process manager signal it: it passes the
    # signal on to torchrun and reports the training's 75.
    "launcher": 75,
    # Every process of the run, as Slurm signals a job step: torchrun and the workers get it
    # twice (directly, and passed on), which changes nothing.
    "every-process": 75,
    # torchrun alone: it passes the signal on to its workers and exits 1 whatever they did; the
    # script, not signalled, reports the status the training recorded.
    "torchrun": 75,
}


@torchrun_group
@pytest.mark.parametrize("target", TERM_TARGETS)
def test_sigterm_stops_a_torchrun_run_with_a_checkpoint(
    project: Path, tmp_path: Path, target: str
) -> None:
    """SIGTERM: both ranks stop after the same step and save a checkpoint there, every rank's
    part of it, and launch/torchrun.sh exits with the status its header documents."""
    launcher, run_dir, log = start_torchrun_run(project, tmp_path)
    if target == "launcher":
        os.kill(launcher.pid, signal.SIGTERM)
    elif target == "every-process":
        # Every process of this run, and no other, has its run directory on the command line.
        subprocess.run(["pkill", "-TERM", "-f", f"run.dir={run_dir}"], check=True)
    else:
        torchrun = subprocess.run(
            ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True, check=True
        )
        os.kill(int(torchrun.stdout.split()[0]), signal.SIGTERM)
    [code] = wait_for_all([launcher], timeout=120)
    text = log.read_text()
    assert code == TERM_TARGETS[target], text[-3000:]
    stopped = re.search(rf"stopped at step (\d+) of {UNENDING_STEPS} on SIGTERM", text)
    assert stopped, text[-3000:]
    assert_ends_with_the_training_s_message(text, "launch the same command again", 75)
    marker = final_checkpoint(run_dir)
    assert marker["step"] == int(stopped.group(1))
    assert sorted(marker["files"]) == ["rank_00000.pt", "rank_00001.pt", "state.pt"]


@torchrun_group
def test_ctrl_c_to_every_process_stops_with_a_checkpoint_at_the_current_step(
    project: Path, tmp_path: Path
) -> None:
    """A terminal's Ctrl-C reaches every process of its foreground group, and torchrun passes
    the SIGINT it got on to its workers: each rank sees two, the second a moment later. That
    is one Ctrl-C: both ranks stop after the same step with a checkpoint there (exit 75), and
    the log says what arrived."""
    launcher, run_dir, log = start_torchrun_run(project, tmp_path)
    workers = subprocess.run(  # torchrun starts them as `python -u -m ...`
        ["pgrep", "-f", "--", f"-u -m {PACKAGE}.train .*run.dir={run_dir}"],
        capture_output=True,
        text=True,
        check=True,
    )
    for pid in workers.stdout.split():
        os.kill(int(pid), signal.SIGINT)
    time.sleep(0.3)  # their handlers have run: torchrun's copy comes as a second SIGINT
    os.killpg(launcher.pid, signal.SIGINT)  # the launcher's group: it and torchrun
    [code] = wait_for_all([launcher], timeout=120)
    text = log.read_text()
    assert code == 75, text[-3000:]
    stopped = re.search(rf"stopped at step (\d+) of {UNENDING_STEPS} on SIGINT", text)
    assert stopped, text[-3000:]
    assert "the same Ctrl-C passed on by the launcher" in text
    assert "interrupted again" not in text
    assert_ends_with_the_training_s_message(text, "launch the same command again", 75)
    assert "SignalException" in torchrun_report(run_dir)
    assert final_checkpoint(run_dir)["step"] == int(stopped.group(1))


@torchrun_group
def test_a_bad_setting_exits_2_through_the_launcher(project: Path, tmp_path: Path) -> None:
    """torchrun exits 1 whenever a worker did not exit 0; launch/torchrun.sh exits with what
    the training said, and its last lines are the training's refusal and that status."""
    bad = subprocess.run(
        ["bash", "launch/torchrun.sh", "train.epochz=3", f"run.dir={tmp_path / 'run'}"],
        cwd=project,
        env=project_env(project, NPROC_PER_NODE="2"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert_ends_with_the_training_s_message(bad.stderr, "error: unknown key(s) train.epochz", 2)


def wait_for_all(processes: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes of processes started with their own session; stragglers are killed (None)."""
    codes: list[int | None] = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            codes.append(None)
    return codes


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def sbatch(slurm: SlurmCluster, project: Path, flags: list[str], overrides: list[str]) -> str:
    """Submit the project's batch script from its root as a user does; return the job id.

    The job meets on its default port, derived from its id."""
    env = {
        key: value
        for key, value in project_env(project, SLURM_CONF=slurm.env["SLURM_CONF"]).items()
        if key != "MASTER_PORT"
    }
    command = ["sbatch", "--parsable", *flags, "launch/slurm/train.sbatch", *overrides]
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def wait_for_job(slurm: SlurmCluster, job_id: str, timeout: float = 300) -> dict[str, str]:
    wait_until(lambda: slurm.job(job_id)["JobState"] in FINISHED, timeout, f"job {job_id}")
    return slurm.job(job_id)


def job_output(project: Path, job_id: str) -> str:
    return (project / f"launch-test-{job_id}.out").read_text()


def completed_job_output(slurm: SlurmCluster, project: Path, job_id: str) -> str:
    """Wait for the job; fail with its output and the daemons' logs unless it exited 0."""
    job = wait_for_job(slurm, job_id)
    output = job_output(project, job_id)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output + slurm.logs()
    return output


# The rendered script asks for 8 GPUs per node; these flags are how a user runs the same script
# on a CPU-only partition (2 CPU processes per node with gloo).
CPU_FLAGS = ["--gpus-per-node=0", "--cpus-per-task=2"]
TASK_PER_PROCESS_FLAGS = ["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1"]


@pytest.mark.parametrize(
    "flags", [CPU_FLAGS, TASK_PER_PROCESS_FLAGS], ids=["torchrun", "task-per-process"]
)
def test_usr1_before_the_time_limit_checkpoints_requeues_and_resumes(
    slurm: SlurmCluster, project: Path, tmp_path: Path, flags: list[str]
) -> None:
    """A job of either kind (torchrun per node, or one task per process) trains to its end on
    a real cluster, across a requeue. Slurm's warning signal (sent to the batch shell, as
    --signal=B:USR1 does) reaches the training processes: they stop after the same step with a
    checkpoint, the job requeues itself, and the next run resumes from exactly that step and
    finishes the training."""
    run_dir = tmp_path / "run"
    job_id = sbatch(slurm, project, flags, [f"run.dir={run_dir}", *LONG_RUN])
    wait_for_first_checkpoint(run_dir)
    slurm.run("scancel", "--signal=USR1", "--batch", job_id)
    let_requeued_job_start(slurm, job_id)
    output = completed_job_output(slurm, project, job_id)
    assert slurm.job(job_id)["Restarts"] == "1", output
    assert "USR1: asking the training to save a checkpoint and stop" in output
    assert f"requeueing job {job_id} (training exited with 0)" in output
    assert_resumed_where_it_stopped(output, run_dir, "a stop request")


def assert_resumed_where_it_stopped(output: str, run_dir: Path, reason: str) -> None:
    """The job's first run stopped mid-training with `reason`, the next one resumed from exactly
    that step and finished."""
    stopped = re.search(rf"stopped at step (\d+) of {LONG_STEPS} on {re.escape(reason)}", output)
    resumed = re.search(r"resumed from \S+ at step (\d+)", output)
    assert stopped and resumed, output
    assert resumed.group(1) == stopped.group(1)
    assert 0 < int(stopped.group(1)) < LONG_STEPS
    assert final_checkpoint(run_dir)["step"] == LONG_STEPS


def let_requeued_job_start(slurm: SlurmCluster, job_id: str) -> None:
    """A requeued job waits two minutes before it may start again; once it is back in the queue
    (an earlier update would be lost while it is still completing), let it start now. Not in the
    second of the requeue, though: slurmd would refuse the new launch credential as revoked (it
    compares whole seconds)."""
    wait_until(lambda: slurm.job(job_id).get("Reason") == "BeginTime", 60, "the requeue")
    time.sleep(2)
    slurm.run("scontrol", "update", f"jobid={job_id}", "starttime=now")


#: Preemption cases: (flags, partition of the training job, who requeues it). TERM reaches
#: every process of either kind of job; a torchrun job requeued by the script after a TERM is
#: test_term_by_hand_checkpoints_requeues_and_resumes[steps].
PREEMPTIONS = {
    "task-per-process-cancel": (TASK_PER_PROCESS_FLAGS, "debug", "the script"),
    "torchrun-requeue": (CPU_FLAGS, "requeue", "Slurm"),
}


@pytest.mark.parametrize("case", PREEMPTIONS)
def test_preemption_checkpoints_requeues_and_resumes(
    slurm: SlurmCluster, project: Path, tmp_path: Path, case: str
) -> None:
    """A job in a partition of higher priority needs the whole node: Slurm preempts the training
    job with TERM to every process of it (KILL after KillWait). The training stops after one
    step with a checkpoint; the job is requeued, by the batch script where Slurm cancels
    preempted jobs (PreemptMode=CANCEL), by Slurm alone where it requeues them (REQUEUE), and
    the next run resumes from exactly that step and finishes."""
    flags, partition, requeuer = PREEMPTIONS[case]
    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", *LONG_RUN]
    job_id = sbatch(slurm, project, [*flags, f"--partition={partition}"], overrides)
    wait_for_first_checkpoint(run_dir)
    urgent = ["--partition=urgent", "--exclusive", "--output=/dev/null", "--wrap=true"]
    urgent_id = slurm.run("sbatch", "--parsable", *urgent).stdout.strip()
    let_requeued_job_start(slurm, job_id)
    output = completed_job_output(slurm, project, job_id)
    assert wait_for_job(slurm, urgent_id)["JobState"] == "COMPLETED"
    assert slurm.job(job_id)["Restarts"] == "1", output
    assert "DUE TO PREEMPTION" in output
    assert "TERM: the training saves a checkpoint and stops" in output
    if requeuer == "Slurm":
        assert f"job {job_id} is requeued by Slurm (training exited with 75)" in output
    else:
        assert f"requeueing job {job_id} (training exited with 75)" in output
    assert_resumed_where_it_stopped(output, run_dir, "SIGTERM")


#: SIGTERM sent by hand to a running job: (scancel flags, batch script flags)
TERM_BY_HAND = {
    # To the batch script alone, as --signal=B:TERM@<seconds> sends it before a time limit: the
    # script passes it on to the training.
    "batch-script": (["--batch"], TASK_PER_PROCESS_FLAGS),
    # To the job's steps: torchrun exits 1, and its task reports the training's 75.
    "steps": ([], CPU_FLAGS),
}


@pytest.mark.parametrize("case", TERM_BY_HAND)
def test_term_by_hand_checkpoints_requeues_and_resumes(
    slurm: SlurmCluster, project: Path, tmp_path: Path, case: str
) -> None:
    """`scancel --signal=TERM` while the job runs: the training stops with a checkpoint, the
    job requeues itself and resumes from exactly that step."""
    scancel_flags, flags = TERM_BY_HAND[case]
    run_dir = tmp_path / "run"
    job_id = sbatch(slurm, project, flags, [f"run.dir={run_dir}", *LONG_RUN])
    wait_for_first_checkpoint(run_dir)
    slurm.run("scancel", "--signal=TERM", *scancel_flags, job_id)
    let_requeued_job_start(slurm, job_id)
    output = completed_job_output(slurm, project, job_id)
    assert slurm.job(job_id)["Restarts"] == "1", output
    assert f"requeueing job {job_id} (training exited with 75)" in output
    assert_resumed_where_it_stopped(output, run_dir, "SIGTERM")


@pytest.mark.parametrize(
    "flags", [CPU_FLAGS, TASK_PER_PROCESS_FLAGS], ids=["torchrun", "task-per-process"]
)
def test_scancel_stops_with_a_checkpoint_and_never_requeues(
    slurm: SlurmCluster, project: Path, tmp_path: Path, flags: list[str]
) -> None:
    """A plain `scancel` sends TERM like a preemption, but the user wants the job gone: the
    training stops with a checkpoint at its step, and the job stays CANCELLED (scontrol requeue
    would revive even a cancelled job, so the script must not call it)."""
    run_dir = tmp_path / "run"
    job_id = sbatch(slurm, project, flags, [f"run.dir={run_dir}", *LONG_RUN, WORKER])
    wait_for_first_checkpoint(run_dir)
    slurm.run("scancel", job_id)
    # Done once it is neither running nor completing: a requeued job would be PENDING.
    ended = ("RUNNING", "COMPLETING")
    wait_until(lambda: slurm.job(job_id)["JobState"] not in ended, 120, f"job {job_id} to end")
    job = slurm.job(job_id)
    output = job_output(project, job_id)
    assert (job["JobState"], job["Restarts"]) == ("CANCELLED", "0"), output + slurm.logs()
    assert f"job {job_id} was cancelled: not requeued (training exited with 75)" in output
    stopped = re.search(rf"stopped at step (\d+) of {LONG_STEPS} on SIGTERM", output)
    assert stopped, output
    assert final_checkpoint(run_dir)["step"] == int(stopped.group(1))


def test_a_bad_setting_fails_the_job_with_status_2_and_no_requeue(
    slurm: SlurmCluster, project: Path, tmp_path: Path
) -> None:
    """The batch script passes on the training's status, not torchrun's 1: a job whose
    settings are refused ends FAILED with exit code 2, and is not requeued."""
    job_id = sbatch(slurm, project, CPU_FLAGS, [f"run.dir={tmp_path / 'run'}", "train.epochz=3"])
    job = wait_for_job(slurm, job_id)
    output = job_output(project, job_id)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "2:0", "0"), output
    # Slurm's own line about the task's exit code follows the launcher's.
    assert "srun: error:" in output.splitlines()[-1], output
    before_slurm = output[: output.rindex("srun: error:")]
    assert_ends_with_the_training_s_message(before_slurm, "unknown key(s) train.epochz", 2)
