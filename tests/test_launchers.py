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
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import CompletedProcess

import pytest
from cookiecutter.main import cookiecutter
from engines import SlurmCluster, free_port, slurm_cluster, two_hosts, wait_until
from matrix import ROOT

GOLDEN = Path(__file__).parent / "golden"
BIN = Path(sys.executable).parent
PACKAGE = "launch_test"

pytestmark = [pytest.mark.xdist_group("launchers"), pytest.mark.timeout(600)]


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


@pytest.mark.parametrize(
    ("script", "env", "message"),
    [
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
    "data.num_workers=0",
]


#: A run long enough to be interrupted: 3000 steps, checkpoints every 200.
LONG_RUN = [
    *SHORT_RUN,
    "train.epochs=1000",
    "train.max_steps=3000",
    "train.log_every=500",
    "checkpoint.every_steps=200",
]


def project_env(project: Path, **extra: str) -> dict[str, str]:
    """The environment a user has after installing the project: its package and torchrun."""
    path = f"{BIN}:{os.environ['PATH']}"
    env = {"PATH": path, "PYTHONPATH": str(project / "src"), "OMP_NUM_THREADS": "1"}
    return {**os.environ, **env, **extra}


def final_checkpoint(run_dir: Path) -> dict:
    """The completion marker of the newest checkpoint (written last, so the checkpoint is whole)."""
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return json.loads((newest / "COMPLETE").read_text())


def test_two_hosts_train_as_one_job_with_torchrun(project: Path, tmp_path: Path) -> None:
    """Two network-namespace hosts with 2 processes each meet by c10d rendezvous at the first
    host and train as 4 gloo ranks over the veth link, writing one shared checkpoint."""
    run_dir = tmp_path / "run"
    with two_hosts(f"ddp{os.getpid() % 100000}") as hosts:
        first = hosts[0]
        launches = []
        for host in hosts:
            env = project_env(
                project,
                NNODES="2",
                NPROC_PER_NODE="2",
                RDZV_ENDPOINT=f"{first.address}:29400",
                RDZV_ID="two-hosts",
                LOCAL_ADDR=host.address,
                GLOO_SOCKET_IFNAME=host.interface,
            )
            command = [*host.prefix, "bash", "launch/torchrun.sh", f"run.dir={run_dir}", *SHORT_RUN]
            log = (tmp_path / f"{host.namespace}.log").open("w")
            launches.append(
                subprocess.Popen(
                    command,
                    cwd=project,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        codes = wait_for_all(launches, timeout=300)
    logs = {path.name: path.read_text()[-3000:] for path in tmp_path.glob("*.log")}
    assert codes == [0, 0], logs
    marker = final_checkpoint(run_dir)
    assert (marker["step"], marker["world_size"]) == (20, 4)
    assert sorted(marker["files"]) == [*(f"rank_{rank:05d}.pt" for rank in range(4)), "state.pt"]


def test_usr1_stops_a_torchrun_run_after_one_step_with_a_checkpoint(
    project: Path, tmp_path: Path
) -> None:
    """USR1 to every process of a torchrun.sh run, as the README's `pkill -USR1 -f` sends it
    (torchrun included, which ignores it): both ranks stop after the same step, save a
    checkpoint there and exit 0."""
    run_dir = tmp_path / "run"
    overrides = [*LONG_RUN, f"run.dir={run_dir}"]
    log = tmp_path / "torchrun.log"
    with log.open("w") as output:
        launch = subprocess.Popen(
            ["bash", "launch/torchrun.sh", *overrides],
            cwd=project,
            env=project_env(project, NPROC_PER_NODE="2"),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    checkpoints = run_dir / "checkpoints"
    wait_until(lambda: any(checkpoints.glob("step_*/COMPLETE")), 120, "a first checkpoint")
    # Every process of this run, and no other, has its run directory on the command line.
    subprocess.run(["pkill", "-USR1", "-f", f"run.dir={run_dir}"], check=True)
    [code] = wait_for_all([launch], timeout=120)
    text = log.read_text()
    assert code == 0, text[-3000:]
    stopped = re.search(r"stopped at step (\d+) of \d+ on SIGUSR1", text)
    assert stopped, text[-3000:]
    assert final_checkpoint(run_dir)["step"] == int(stopped.group(1))


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
    """Submit the project's batch script from its root as a user does; return the job id."""
    env = project_env(project, MASTER_PORT=str(free_port()), SLURM_CONF=slurm.env["SLURM_CONF"])
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


def test_sbatch_trains_with_torchrun_on_a_real_cluster(
    slurm: SlurmCluster, project: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    job_id = sbatch(slurm, project, CPU_FLAGS, [f"run.dir={run_dir}", *SHORT_RUN])
    output = completed_job_output(slurm, project, job_id)
    marker = final_checkpoint(run_dir)
    assert (marker["step"], marker["world_size"]) == (20, 2)
    assert "training complete at step 20" in output


def test_sbatch_runs_one_task_per_process_without_torchrun(
    slurm: SlurmCluster, project: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    job_id = sbatch(slurm, project, TASK_PER_PROCESS_FLAGS, [f"run.dir={run_dir}", *SHORT_RUN])
    completed_job_output(slurm, project, job_id)
    marker = final_checkpoint(run_dir)
    assert (marker["step"], marker["world_size"]) == (20, 2)


@pytest.mark.parametrize(
    "flags", [CPU_FLAGS, TASK_PER_PROCESS_FLAGS], ids=["torchrun", "task-per-process"]
)
def test_usr1_before_the_time_limit_checkpoints_requeues_and_resumes(
    slurm: SlurmCluster, project: Path, tmp_path: Path, flags: list[str]
) -> None:
    """Slurm's warning signal (sent to the batch shell, as --signal=B:USR1 does) reaches the
    training processes: they stop after the same step with a checkpoint, the job requeues
    itself, and the next run resumes from exactly that step and finishes the training."""
    run_dir = tmp_path / "run"
    job_id = sbatch(slurm, project, flags, [f"run.dir={run_dir}", *LONG_RUN])
    checkpoints = run_dir / "checkpoints"
    # A first checkpoint means the training is running, with its signal handler in place.
    wait_until(lambda: any(checkpoints.glob("step_*/COMPLETE")), 120, "a first checkpoint")
    slurm.run("scancel", "--signal=USR1", "--batch", job_id)
    # A requeued job waits two minutes before it may start again; once it is back in the queue
    # (an earlier update would be lost while it is still completing), let it start now. Not in
    # the second of the requeue, though: slurmd would refuse the new launch credential as
    # revoked (it compares whole seconds).
    wait_until(lambda: slurm.job(job_id).get("Reason") == "BeginTime", 60, "the requeue")
    time.sleep(2)
    slurm.run("scontrol", "update", f"jobid={job_id}", "starttime=now")
    output = completed_job_output(slurm, project, job_id)
    assert slurm.job(job_id)["Restarts"] == "1", output
    assert "USR1: asking the training to save a checkpoint and stop" in output
    assert f"requeueing job {job_id} (training exited with 0)" in output
    stopped = re.search(r"stopped at step (\d+) of \d+ on SIGUSR1", output)
    resumed = re.search(r"resumed from \S+ at step (\d+)", output)
    assert stopped and resumed, output
    assert resumed.group(1) == stopped.group(1)
    assert 0 < int(stopped.group(1)) < 3000
    assert final_checkpoint(run_dir)["step"] == 3000
