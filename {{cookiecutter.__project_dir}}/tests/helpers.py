"""Helpers shared by the tests: small fast configs, trainers, and multi-process launchers."""

from __future__ import annotations

import gc
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Dataset, Subset

import {{ cookiecutter.package_name }}
from {{ cookiecutter.package_name }}.cluster.distributed import (
    DistEnv,
    destroy_process_groups,
    start_control_group,
)
from {{ cookiecutter.package_name }}.config import Config
from {{ cookiecutter.package_name }}.contract import member_of
from {{ cookiecutter.package_name }}.faults.stopping import StopRequests
from {{ cookiecutter.package_name }}.monitoring.metrics import MetricsLogger
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.training.trainer import Trainer

#: Task.whole_batch_loss: a micro-batch's loss reads the step's samples together (negatives
#: gathered across ranks), so gradient accumulation is refused for it: its tests train one
#: micro-batch per rank and step. The task's members are read through the contract's defaults:
#: a task need not derive from TaskBase.
WHOLE_BATCH_LOSS: bool = member_of(Task, "whole_batch_loss")
#: A test of gradient accumulation itself, which such a task refuses.
accumulates = pytest.mark.skipif(
    WHOLE_BATCH_LOSS, reason="Task.whole_batch_loss: accumulation is refused for this task"
)
#: The parts of the task's model trained apart (Task.updates); empty: the whole model at once.
UPDATES: tuple[str, ...] = tuple(member_of(Task, "updates"))
#: Where the log names the training figures the tests follow (loss, lr, grad_norm): the task's,
#: or its first update's.
TRAIN_PREFIX = f"train/{UPDATES[0]}/" if UPDATES else "train/"
TRAINING_LOSS = f"{TRAIN_PREFIX}loss"


def micro_batch_size(size: int, global_batch_size: int) -> str:
    """The setting train.micro_batch_size=`size`; for a whole-batch loss, `global_batch_size`,
    which splits into one micro-batch per rank on any world size."""
    return f"train.micro_batch_size={global_batch_size if WHOLE_BATCH_LOSS else size}"


#: Overrides that make a run take seconds on a laptop CPU: the shared sections' here, then the
#: task's own `test_settings` (a small model and data set), which may also change train.*.
FAST = [
    "train.global_batch_size=32",
    micro_batch_size(8, 32),
    "train.log_every=2",
    "train.eval_every=4",
    "checkpoint.every_steps=4",
    "data.num_workers=0",
    *member_of(Task, "test_settings"),
]

#: The project's benchmark scripts (benchmarks/ is not a package).
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ as a module (the folder is not a package), registered under its
    name as an import would be (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_torchrun(
    nproc: int,
    overrides: list[str],
    timeout: float = 180,
    entry: Path | None = None,
    max_restarts: int = 0,
    launcher: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Train under `torchrun --standalone`: it picks a free port, so parallel tests never clash.

    `entry` runs a script instead of the package's entry point (tests inject faults with one).
    `launcher` runs torchrun as launch/torchrun.sh does, through the project's launcher.
    The output goes to files, not pipes: the ranks run in sessions of their own and would keep a
    pipe open after torchrun. A launch that hangs gets SIGTERM, on which torchrun ends its ranks
    (SIGKILL after its grace period), and fails the test with the end of its log.
    """
    target = [str(entry)] if entry else ["-m", "{{ cookiecutter.package_name }}.train"]
    runner = "{{ cookiecutter.package_name }}.launch" if launcher else "torch.distributed.run"
    command = [
        sys.executable,
        "-m",
        runner,
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        *target,
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, text=True)
        try:
            process.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        stdout.seek(0)
        stderr.seek(0)
        result = subprocess.CompletedProcess(
            command, process.returncode, stdout.read(), stderr.read()
        )
    if timed_out:
        pytest.fail(f"torchrun did not end within {timeout} s; log:\n{result.stderr[-6000:]}")
    return result


#: What a fault-injecting entry point runs around its fault (see write_fault_entry).
_FAULT_ENTRY_HEAD = """import os
import signal
import sys
import time

from {{ cookiecutter.package_name }} import train
from {{ cookiecutter.package_name }}.checkpointing import checkpoint
from {{ cookiecutter.package_name }}.launch import exit_status_recorded
from {{ cookiecutter.package_name }}.training.trainer import Trainer
"""
# As train.py's own entry ends: the status recorded for the launcher (run_torchrun(launcher=)).
_FAULT_ENTRY_TAIL = """
sys.exit(exit_status_recorded(train.main))
"""


def write_fault_entry(directory: Path, fault: str) -> Path:
    """A training entry point for `run_torchrun(entry=...)` that runs `fault` before main().

    `fault` is Python source that patches the package (e.g. Trainer.train_step) to fail, hang
    or slow down; it may use os, signal, sys, time, checkpoint, train and Trainer.
    """
    entry = directory / "entry.py"
    entry.write_text(_FAULT_ENTRY_HEAD + fault + _FAULT_ENTRY_TAIL)
    return entry


# Worker processes fork from a server that has already imported torch: much faster than a
# fresh interpreter per worker, and unlike a plain fork it copies no test-runner threads.
# DistributedDataParallel imports torch._dynamo when it is built (2 s of CPU on every rank):
# the server imports it once.
mp.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch._dynamo",
        "{{ cookiecutter.package_name }}.training.trainer",
    ]
)


def spawn(
    world_size: int, worker: Callable[..., Any], *args: Any, workdir: Path, timeout: float = 120
) -> list[Any]:
    """Run `worker(rank, world_size, *args)` on `world_size` new processes joined by gloo.

    The ranks meet through a FileStore in `workdir` (no port, so tests never collide). Returns
    each rank's return value, in rank order. A worker's exception fails the test with its
    traceback; a hang is killed after `timeout` seconds.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(
        _spawned,
        args=(world_size, worker, args, str(workdir), os.environ.get("CUDA_VISIBLE_DEVICES")),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{worker.__name__} did not finish within {timeout} s")
    return [
        torch.load(workdir / f"result_{rank}.pt", weights_only=False) for rank in range(world_size)
    ]


def _spawned(
    rank: int,
    world_size: int,
    worker: Callable[..., Any],
    args: tuple,
    workdir: str,
    visible_gpus: str | None,
) -> None:
    # The GPUs the test sees (none for a test not marked gpu: conftest.py), not those of the
    # test that started the forkserver: CUDA reads the variable when this process first uses it.
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    if visible_gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
    torch.set_num_threads(1)
    # Started from the forkserver, this process would start DataLoader workers that way too,
    # pickling the test's task; fork them, as a training process started by torchrun does.
    mp.set_start_method("fork", force=True)
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    start_control_group(timeout_s=60)
    try:
        result = worker(rank, world_size, *args)
        torch.save(result, os.path.join(workdir, f"result_{rank}.pt"))
        del result
        # As in process_group(): drop the worker's DDP objects before the group goes away.
        gc.collect()
        dist.barrier()
    finally:
        destroy_process_groups()


#: Run in a fresh process: `load_model(argv[1])`, its weights saved to loaded.pt.
_LOAD_MODEL = """
import sys

import torch

from {{ cookiecutter.package_name }} import load_model

torch.save(load_model(sys.argv[1]).state_dict(), "loaded.pt")
"""


def load_in_fresh_process(path: Path, cwd: Path) -> dict[str, torch.Tensor]:
    """The weights of `load_model(path)` in a new Python process whose working directory is
    `cwd`: nothing the test imported, built or cached is there, as on a machine that only
    serves the model. The package is found by its absolute path, however the tests found it."""
    cwd.mkdir(parents=True, exist_ok=True)
    package_root = Path({{ cookiecutter.package_name }}.__file__).resolve().parents[1]
    search_path = [str(package_root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(search_path)}
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_MODEL, str(path)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return torch.load(cwd / "loaded.pt", weights_only=True)


def env_for(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank, world_size=world_size, launcher="test")


def make_trainer(
    config: Config,
    env: DistEnv | None = None,
    task: Task | None = None,
    stop: StopRequests | None = None,
    device: torch.device | None = None,
) -> Trainer:
    """A trainer for `config` on the CPU unless `device` says otherwise (single process unless
    `env` says otherwise)."""
    env = env or DistEnv()
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    task = task or Task(config.task, seed=config.run.seed)
    metrics = MetricsLogger(run_dir, is_main=env.is_main)
    device = device or torch.device("cpu")
    return Trainer(config, task, env, device, run_dir, metrics, stop)


def train_steps(trainer: Trainer, steps: int) -> dict[str, torch.Tensor]:
    """Run `steps` optimizer steps from the start of epoch 0; return a copy of the weights."""
    trainer.sampler.set_epoch(0)
    batches = iter(trainer.train_loader)
    for _ in range(steps):
        trainer.train_step(batches)
        trainer.step += 1
    return {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}


def first_part(model: torch.nn.Module) -> torch.nn.Module:
    """Where a test adds a layer to the task's model: the whole model, or its first update's
    part (each trainable parameter belongs to one part)."""
    return getattr(model, UPDATES[0]) if UPDATES else model


def inner_modules(model: Any) -> Any:
    """What `getattr(model, "module", model)` reaches in a loss: the module DDP wraps (each
    part's, in a task with updates), whose forward bypasses DDP."""
    if not UPDATES:
        return getattr(model, "module", model)
    parts = {name: getattr(model, name) for name in UPDATES}
    return SimpleNamespace(**{name: getattr(p, "module", p) for name, p in parts.items()})


def optimizer_states(trainer: Trainer) -> dict[str | None, dict[str, Any]]:
    """The state of each optimizer, by update (None: the one of a task without Task.updates)."""
    return {update.name: update.optimizer.state_dict() for update in trainer.updates}


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([param.grad.detach().flatten() for param in model.parameters()]).clone()


def float64(task_class: type[Task]) -> type[Task]:
    """`task_class` in float64 and eval mode, so that comparisons between runs can be tight.

    Eval mode, kept when the trainer calls `train()`, turns dropout off and makes BatchNorm use
    its running statistics: runs on different world sizes then compute the same function.
    Every floating-point tensor of a batch is converted to float64 before the task sees it.
    """

    class Float64(task_class):
        def build_model(self) -> torch.nn.Module:
            model = super().build_model().double().eval()
            model.train = lambda mode=True: model  # stays in eval mode
            return model

        def training_loss(self, model: torch.nn.Module, batch: Any, **update: str) -> Any:
            return super().training_loss(model, as_float64(batch), **update)

        def evaluation_sums(self, model: torch.nn.Module, batch: Any) -> Any:
            return super().evaluation_sums(model, as_float64(batch))

    Float64.__name__ = Float64.__qualname__ = f"Float64{task_class.__name__}"
    return Float64


def as_float64(batch: Any) -> Any:
    """`batch` with each floating-point tensor in float64, in tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {key: as_float64(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(as_float64(value) for value in batch)
    return batch


#: The project's task in float64 and eval mode.
Float64Task = float64(Task)


def with_samples(
    task_class: type[Task], train: int | None = None, evaluation: int | None = None
) -> type[Task]:
    """`task_class` on the first `train` training and `evaluation` evaluation samples only.

    For tests that need a number of steps per epoch or an odd evaluation set, whatever sizes the
    task's own settings give.
    """

    class WithSamples(task_class):
        def build_datasets(self) -> tuple[Dataset, Dataset]:
            train_set, eval_set = super().build_datasets()
            return _first(train_set, train, "training"), _first(eval_set, evaluation, "evaluation")

    WithSamples.__name__ = WithSamples.__qualname__ = f"{task_class.__name__}WithSamples"
    return WithSamples


def with_random_draws(task_class: type[Task]) -> type[Task]:
    """`task_class` whose training samples are augmented at random, whatever they hold: each
    fetch draws from Python's, NumPy's and torch's generators and, about half the time, gives
    a neighbouring sample instead. What a run trains on then depends on every draw of the data
    being reproducible."""

    class WithRandomDraws(task_class):
        def build_datasets(self) -> tuple[Dataset, Dataset]:
            train_set, eval_set = super().build_datasets()
            return RandomlySubstituted(train_set), eval_set

    WithRandomDraws.__name__ = WithRandomDraws.__qualname__ = f"{task_class.__name__}WithDraws"
    return WithRandomDraws


class RandomlySubstituted(Dataset):
    """`dataset`, each fetch a random draw from every generator a data set may use."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        offset = random.randrange(8) + int(torch.randint(8, ())) + int(numpy.random.randint(8))
        return self.dataset[(index + offset % 2) % len(self.dataset)]


def _first(dataset: Dataset, count: int | None, name: str) -> Dataset:
    if count is None:
        return dataset
    if len(dataset) < count:
        raise ValueError(
            f"this test needs {count} {name} samples, but the task's {name} set holds "
            f"{len(dataset)} with its test_settings: make it larger there"
        )
    return Subset(dataset, range(count))
