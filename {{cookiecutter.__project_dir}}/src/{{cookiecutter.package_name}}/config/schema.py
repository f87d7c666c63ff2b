"""The settings of a run: one dataclass per section, with defaults, help lines and range checks.

The `task` section is task.py's `TaskConfig`, the user's own; every other section is defined
here. A setting is a field of one of these dataclasses, with a type, a default and a `#:` comment
above it: its one-line help in `--help`. Types understood: bool, int, float, str, Path,
`Literal[...]`, `enum.Enum` subclasses (written as their values), `X | None`, `list[X]`,
`tuple[X, ...]` and fixed tuples, `dict[str, X]`, and dataclasses nested in a section (set as
`task.encoder.depth=4`). A setting's key is its field's name, or `metadata={"key": ...}` where
the key cannot be a name (`checkpoint.async`: a Python keyword). loader.py reads values onto
these classes; this module knows nothing of files or command lines.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, Literal

from ..checkpointing.storage import is_url, url_problem
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..task import TaskConfig


def task_config_class() -> type:
    """The `task` section's class: `TaskConfig` of task.py, the user's file.

    Looked up when first needed rather than imported above: reading settings stays free of
    torch, which task.py imports, and a task.py of an earlier release, which imports ConfigError
    from this package, still imports.
    """
    from .. import task

    if not hasattr(task, "TaskConfig"):
        raise ImportError(
            f"{task.__file__} defines no TaskConfig. The task's settings live in task.py: move "
            "`class TaskConfig` (with the imports it needs) there from config.py, and import "
            "ConfigError from .errors (CHANGELOG: what a project that updates must change)"
        )
    return task.TaskConfig


@dataclass
class RunConfig:
    """Where the run lives. The same directory on a second launch means: resume."""

    #: Checkpoints, logs and metrics of the run; the same directory again resumes it. A URL
    #: (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX) puts the checkpoints in an object store.
    dir: str = "runs/default"
    #: With a run.dir URL: the local directory of logs, metrics and the lock
    #: (empty: runs/SCHEME/BUCKET/PREFIX in the working directory).
    local_dir: str = ""
    #: Seeds the initial weights, the data order and every random stream.
    seed: int = 1234

    def validate(self) -> None:
        if is_url(self.dir) and (problem := url_problem(self.dir)):
            raise ConfigError(problem)
        if self.local_dir and not is_url(self.dir):
            raise ConfigError(
                f"run.local_dir={self.local_dir} is for a run.dir on an object store; with "
                f"run.dir={self.dir}, logs and metrics are in run.dir itself: drop run.local_dir"
            )


@dataclass
class DataConfig:
    """DataLoader settings. The global batch is in TrainConfig.

    `num_workers` > 0 loads batches in that many worker processes per rank, each keeping
    `prefetch_factor` batches ready; `persistent_workers` keeps them alive from one epoch (and
    evaluation) to the next. `auto` (the default) takes the cores each rank of the host has
    (within its CPU affinity and container limit) minus the rank's own, at most 8; one log
    line says how many. The workers never act on a stop signal: the rank stops and ends them.
    Any number of workers draws the same samples in the same order, with random augmentation
    seeded per sample; 0 loads in the training process, with the rank's own random streams
    unless another rank has workers (then it seeds per sample too). These loader settings
    are each host's own: hosts with other core counts train together. `pin_memory` speeds up
    copies to a GPU (ignored on CPU).
    """

    #: Loader processes per rank; auto: the cores per rank minus one (at most 8); 0: none.
    num_workers: int | Literal["auto"] = "auto"
    #: Batches each worker keeps ready.
    prefetch_factor: int = 2
    #: Keep the workers from one epoch (and evaluation) to the next.
    persistent_workers: bool = True
    #: Page-locked batches, for faster copies to a GPU (ignored on CPU).
    pin_memory: bool = True

    def validate(self) -> None:
        _positive("data", prefetch_factor=self.prefetch_factor)
        if self.num_workers != "auto" and self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0 or auto, got {self.num_workers}")


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay to `min_lr_ratio * lr`."""

    #: Peak learning rate, reached at the end of the warmup.
    lr: float = 3e-3
    #: AdamW's decoupled weight decay.
    weight_decay: float = 0.01
    #: AdamW's decay rates of the gradient's moments.
    betas: tuple[float, float] = (0.9, 0.999)
    #: Optimizer steps of linear warmup to lr.
    warmup_steps: int = 20
    #: The cosine decay ends at min_lr_ratio * lr.
    min_lr_ratio: float = 0.1
    #: Clip the gradients' global norm to this; 0 does not clip.
    grad_clip: float = 1.0

    def validate(self) -> None:
        _not_negative(
            "optim",
            warmup_steps=self.warmup_steps,
            weight_decay=self.weight_decay,
            grad_clip=self.grad_clip,
        )
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"optim.betas must both be in [0, 1), got {list(self.betas)}")
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class TrainConfig:
    """The optimisation schedule.

    `global_batch_size` is what the optimizer sees per step, whatever the world size: each of W
    ranks takes global_batch_size / W samples per step, in micro-batches of at most
    `micro_batch_size` (the largest divisor of the per-rank share that fits), accumulated over as
    many micro-steps as needed. The same config therefore trains on 1 or 64 ranks.

    `compile` runs the model through torch.compile (the first steps take longer while it
    compiles). `tf32` lets float32 matrix products use TF32 tensor cores on CUDA (Ampere and
    newer): much faster, with a 10-bit mantissa in the products. `progress_bar` shows one on
    rank 0 when stderr is a terminal. `peak_tflops` is one device's peak for MFU; 0 looks the GPU
    up in throughput.PEAK_TFLOPS (MFU is left out where it is unknown, e.g. on CPU).
    `straggler_threshold`: each log line measures every rank's own time per step (its compute
    and data wait, without its wait for the others in the gradient all-reduce) and warns, naming
    the rank and its host, when the slowest exceeds the other ranks' median by more than this
    share of it, and by 10 ms or more, in two log windows in a row (stragglers.py; the wait is
    timed in one step of every third of `log_every`).

    `on_nonfinite`: a NaN or infinite loss or gradient norm is read at the next log line and
    always before a checkpoint (no wait for the device in the step). `stop` ends the run with
    exit status 3 naming the step and the rank where it first appeared, and writes no
    checkpoint of it. `skip` drops that step's update on every rank alike (it reads the gradient
    norm after every step, a wait for the device) and stops as `stop` does once more than
    `max_skipped_steps` steps were skipped in the run. With fp16, the loss scaler's own skips of
    steps with overflowing gradients are not counted: only a non-finite loss is.
    """

    #: Samples per optimizer step, across all ranks, whatever the world size.
    global_batch_size: int = 128
    #: At most this many samples per rank in one forward and backward.
    micro_batch_size: int = 32
    #: Samples per rank in one evaluation batch.
    eval_batch_size: int = 64
    #: Passes over the training data (unless max_steps is set).
    epochs: int = 3
    #: Optimizer steps to train; > 0 wins over epochs.
    max_steps: int = -1
    #: Autocast dtype: bf16, fp16 (with loss scaling) or none (float32).
    mixed_precision: Literal["bf16", "fp16", "none"] = {{ cookiecutter.mixed_precision | python_string }}
    #: Run the model through torch.compile.
    compile: bool = False
    #: Let float32 matrix products use TF32 tensor cores on CUDA.
    tf32: bool = True
    #: Evaluate every that many optimizer steps.
    eval_every: int = 50
    #: A log line and a metrics record every that many optimizer steps.
    log_every: int = 10
    #: Warn when a rank's own time per step exceeds the other ranks' median by more than this
    #: share of it (0.25: 25%) and 10 ms, two log windows in a row; 0: never.
    straggler_threshold: float = 0.25
    #: A progress bar on rank 0 when stderr is a terminal.
    progress_bar: bool = True
    #: One device's peak TFLOP/s for MFU; 0 looks the GPU up.
    peak_tflops: float = 0.0
    #: On a non-finite loss or gradient: stop (no checkpoint of it) or skip the step.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    #: With on_nonfinite=skip, the run stops once this many steps were skipped.
    max_skipped_steps: int = 10

    def validate(self) -> None:
        _positive(
            "train",
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            eval_batch_size=self.eval_batch_size,
            log_every=self.log_every,
            eval_every=self.eval_every,
        )
        _not_negative(
            "train",
            max_skipped_steps=self.max_skipped_steps,
            straggler_threshold=self.straggler_threshold,
        )
        if self.epochs <= 0 and self.max_steps <= 0:
            raise ConfigError("set train.epochs or train.max_steps to a positive number")
        if self.peak_tflops < 0:
            raise ConfigError(
                f"train.peak_tflops must be >= 0 (0 looks the GPU up), got {self.peak_tflops}"
            )
        if self.on_nonfinite == "skip" and self.mixed_precision == "fp16":
            raise ConfigError(
                "train.on_nonfinite=skip cannot be used with train.mixed_precision=fp16: fp16's "
                "loss scaler already skips the steps whose gradients overflow. Use "
                "on_nonfinite=stop (a non-finite loss then stops the run), or bf16."
            )


@dataclass
class CheckpointConfig:
    """Atomic checkpoints in `<run.dir>/checkpoints`; the newest valid one is resumed from.

    `resume`: continue the run in `run.dir` from its newest checkpoint. With `false`, a run
    directory that already holds checkpoints is refused rather than mixed with a new run.
    `start_over_if_unusable`: when the run directory holds checkpoints (or damaged ones set
    aside) and none can continue the run, a launch is refused; `true` starts a new run at
    step 0 there instead, keeping the old run's metrics as `metrics.before-start-over-*.jsonl`.
    `stop_on_signals`: SIGTERM (preemption, scancel, torchrun), SIGINT (Ctrl-C), SIGHUP, SIGUSR1
    and SIGUSR2 (Slurm's time-limit warning) make every rank finish the same step, save a
    checkpoint and exit (a second Ctrl-C exits at once); see
    stopping.py for the exit statuses. The ranks compare notes about every `stop_check_s` seconds
    of training (0: after every step), so a stop comes about 2 x stop_check_s after the signal.
    `async` (the field `async_save`: `async` is a Python keyword): a scheduled save copies the
    state to host memory, the only pause, and a background thread writes it while training
    goes on (background_save.py). It costs a second copy of the state in host memory; the
    saves of a stop and of an early stop stay synchronous.
    """

    #: Save a checkpoint every that many optimizer steps.
    every_steps: int = 50
    #: Checkpoints kept; older ones are deleted.
    keep_last: int = 3
    #: Continue from the newest checkpoint in run.dir; false refuses a used run.dir.
    resume: bool = True
    #: When run.dir holds checkpoints and none can be used: start a new run there, not refuse.
    start_over_if_unusable: bool = False
    #: On SIGTERM, SIGINT, SIGHUP, SIGUSR1 or SIGUSR2 every rank saves a checkpoint and stops.
    stop_on_signals: bool = True
    #: Seconds of training between the ranks' checks for a stop; 0: every step.
    stop_check_s: float = 1.0
    #: At the end of training, write the weights as safetensors to <run.dir>/export.
    export: bool = True
    #: Write scheduled checkpoints in the background; training pauses only to copy the state.
    async_save: bool = field(default=False, metadata={"key": "async"})

    def validate(self) -> None:
        _positive("checkpoint", every_steps=self.every_steps, keep_last=self.keep_last)
        if self.stop_check_s < 0:
            raise ConfigError(
                f"checkpoint.stop_check_s must be >= 0 (0 checks after every step), "
                f"got {self.stop_check_s}"
            )


@dataclass
class BestConfig:
    """Keep the best checkpoint by an evaluation metric, and stop early when it stops improving.

    `metric` names a record of the evaluation, as metrics.jsonl writes it (`eval/loss`,
    `eval/accuracy`, `eval_ema/loss`); `mode` says whether lower or higher is better. When an
    evaluation improves on the best by more than `min_delta`, a checkpoint of that step is
    written (if none is due) and kept out of `checkpoint.keep_last` pruning, and
    `<run.dir>/best.json` names it. `patience` > 0 stops the run, with a checkpoint, after that
    many evaluations in a row without improvement.
    """

    #: Evaluation metric that picks the best checkpoint (e.g. eval/loss); empty: off.
    metric: str = ""
    #: min: lower is better (a loss); max: higher is better (an accuracy).
    mode: Literal["min", "max"] = "min"
    #: An evaluation improves on the best only by more than this.
    min_delta: float = 0.0
    #: Stop after this many evaluations without improvement; 0: never.
    patience: int = 0

    def validate(self) -> None:
        _not_negative("best", min_delta=self.min_delta, patience=self.patience)
        if self.patience and not self.metric:
            raise ConfigError(
                "best.patience needs best.metric: the evaluation metric whose improvement it "
                "waits for (e.g. best.metric=eval/loss)"
            )
        if self.metric and not self.metric.startswith(("eval/", "eval_ema/")):
            raise ConfigError(
                f"best.metric={self.metric} is not an evaluation metric: name one as "
                "metrics.jsonl records it, e.g. eval/loss, eval/accuracy or eval_ema/loss"
            )


@dataclass
class EmaConfig:
    """An exponential moving average of the weights, evaluated beside them.

    After every optimizer step, ema = decay * ema + (1 - decay) * weights (buffers are copied).
    With `decay` > 0, each evaluation also runs on the average and logs it as `eval_ema/*`; the
    average is in every checkpoint and exported with the final weights.
    """

    #: Decay of the weights' moving average per step (e.g. 0.999); 0: off.
    decay: float = 0.0

    def validate(self) -> None:
        if not 0 <= self.decay < 1:
            raise ConfigError(f"ema.decay must be in [0, 1) (0 turns EMA off), got {self.decay}")


@dataclass
class InitConfig:
    """Weights to start a new run from (fine-tuning): the optimizer and the step start afresh.

    `weights` is another run's directory (its newest intact checkpoint), one checkpoint's
    directory, a .pt file (a state dict, or a checkpoint's state.pt) or a .safetensors file.
    Used only when the run starts: a run that resumes continues from its own checkpoint.
    """

    #: Initial weights: a run dir, checkpoint dir, .pt or .safetensors file; empty: none.
    weights: str = ""

    def validate(self) -> None:
        if self.weights and not Path(self.weights).exists():
            raise ConfigError(
                f"init.weights={self.weights} does not exist. Give a run directory, a "
                "checkpoint directory, a .pt or a .safetensors file, or leave it empty."
            )


@dataclass
class DistConfig:
    """Device, process group and DistributedDataParallel settings.

    `auto` picks CUDA with NCCL when a GPU is visible, else CPU with gloo.
    `timeout_s` bounds start-up and every training collective: a rank that hangs or dies ends
    the job after that long instead of leaving the others waiting. `barrier_timeout_s` bounds the
    waits around checkpoint writes and work only rank 0 does (a tracker that starts slowly).
    The ranks' replicas are compared at every log line and before every checkpoint (a checksum
    of the parameters rides in their all-gather): replicas that part mean a change outside DDP,
    and every rank stops with exit status 2, naming the parameters. `check_replicas_every` > 0
    compares them also every that many steps, in an all-gather of its own, to find the step.
    Before the first step the ranks compare their code, settings, versions, devices and data
    (agreement.py); `allow_mixed_devices` lets ranks with different GPU types train together.
    Under NCCL, each rank's flight recorder keeps its last `flight_recorder_entries` collectives
    and writes them to `<run.dir>/comm_traces/` when one times out, for `torchfrtrace` to name
    the ranks that did not join (faults/flight_recorder.py; 0 turns it off). `debug` turns on,
    for one run, NCCL's INFO log (one file per process in `<run.dir>/debug/`) and
    torch.distributed's debug mode (TORCH_DISTRIBUTED_DEBUG=INFO; its lines need
    TORCH_CPP_LOG_LEVEL=INFO exported before the launch); variables you exported are kept
    (cluster/debug_output.py).

    DDP: gradients are all-reduced in buckets of `bucket_cap_mb`, overlapped with backward.
    `broadcast_buffers` copies rank 0's buffers (e.g. BatchNorm statistics) to the others at
    every forward; turn it off for models without buffers that change. `find_unused_parameters`
    is needed only when some parameters get no gradient in a step (costs a graph traversal per
    step). `static_graph` declares that the same parameters are used every step (allows more
    overlap; refused with gradient accumulation, which DDP's static graph does not support).
    `comm_hook` compresses the gradients sent: fp16 (or bf16, NCCL only) halves the bytes,
    `powersgd` sends a rank-`powersgd_rank` approximation after the lr warmup (much less,
    lossy; its error feedback is not checkpointed, so a resumed run is no longer bitwise
    reproducible).
    """

    #: auto: CUDA when a GPU is visible, else CPU.
    device: Literal["auto", "cuda", "cpu"] = "auto"
    #: auto: NCCL on CUDA, gloo on CPU; mpi needs a torch built with MPI.
    backend: Literal["auto", "nccl", "gloo", "mpi"] = "auto"
    #: Seconds a start-up or training collective may wait before the job ends.
    timeout_s: int = 60
    #: Seconds the ranks wait for checkpoint writes and rank-0-only work.
    barrier_timeout_s: int = 1800
    #: Size of DDP's gradient all-reduce buckets, in MB.
    bucket_cap_mb: int = 25
    #: Copy rank 0's buffers (e.g. BatchNorm statistics) at every forward.
    broadcast_buffers: bool = True
    #: Allow parameters without a gradient in a step (costs a traversal).
    find_unused_parameters: bool = False
    #: The same parameters are used at every step (allows more overlap).
    static_graph: bool = False
    #: Gradient compression: fp16, bf16 (NCCL only), powersgd (lossy) or none.
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    #: Rank of PowerSGD's low-rank gradient approximation.
    powersgd_rank: int = 1
    #: Also compare the replicas every that many steps (they are at every log line); 0: not.
    check_replicas_every: int = 0
    #: Train on ranks with different GPU types (refused by default).
    allow_mixed_devices: bool = False
    #: NCCL collectives each rank keeps, written to <run.dir>/comm_traces/ on a timeout; 0: off.
    flight_recorder_entries: int = 2000
    #: NCCL's INFO log into <run.dir>/debug/, and torch.distributed's debug mode.
    debug: bool = False

    def validate(self) -> None:
        _positive(
            "dist",
            timeout_s=self.timeout_s,
            barrier_timeout_s=self.barrier_timeout_s,
            bucket_cap_mb=self.bucket_cap_mb,
            powersgd_rank=self.powersgd_rank,
        )
        if self.check_replicas_every < 0:
            raise ConfigError(
                "dist.check_replicas_every must be >= 0 (0: the replicas are compared at log "
                "lines and checkpoints only)"
            )
        if self.flight_recorder_entries < 0:
            raise ConfigError(
                "dist.flight_recorder_entries must be >= 0 (0 turns NCCL's flight recorder off)"
            )


@dataclass
class ProfileConfig:
    """A torch.profiler trace of a few steps on rank 0, written to `<run.dir>/profile/`, and
    NVTX ranges for Nsight Systems.

    Skips `wait_steps` steps after the start (or the resume), then records `active_steps`. Open
    the trace in https://ui.perfetto.dev or chrome://tracing; summary.txt lists the top ops.
    `nvtx` marks the phases of every step (data wait, forward, backward, optimizer) with NVTX
    ranges on every rank of a GPU run, for `nsys profile` (profiling.py); leave `enabled` off
    then, since both profilers would want the GPU's counters.
    """

    #: Record a torch.profiler trace of a few steps on rank 0.
    enabled: bool = False
    #: Steps to skip after the start (or the resume) before recording.
    wait_steps: int = 5
    #: Steps to record.
    active_steps: int = 3
    #: NVTX ranges around each step's phases on GPUs, for Nsight Systems (nsys profile).
    nvtx: bool = False

    def validate(self) -> None:
        _positive("profile", active_steps=self.active_steps)
        _not_negative("profile", wait_steps=self.wait_steps)
{%- if cookiecutter.tracker != "none" %}


@dataclass
class TrackerConfig:
    """Experiment tracker ({{ cookiecutter.tracker }}); metrics.jsonl is written either way."""

    #: Log the metrics to {{ cookiecutter.tracker }} too.
    enabled: bool = True
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}
    #: The project (or experiment) the run is logged under.
    project: str = {{ cookiecutter.project_slug | python_string }}
{%- endif %}
{%- if cookiecutter.tracker == "mlflow" %}
    #: MLflow tracking server or store; empty: MLFLOW_TRACKING_URI, else <run.dir>/mlflow.db.
    tracking_uri: str = ""
{%- endif %}
{%- endif %}


@dataclass
class Config:
    """The whole run configuration; `Config()` is the documented default."""

    run: RunConfig = field(default_factory=RunConfig)
    task: TaskConfig = field(default_factory=lambda: task_config_class()())
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    best: BestConfig = field(default_factory=BestConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    init: InitConfig = field(default_factory=InitConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
{%- if cookiecutter.tracker != "none" %}
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
{%- endif %}

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict, fit for YAML, JSON and checkpoints.

        Paths become strings, enums their values and tuples lists: `from_dict` turns them back.
        """
        return plain(self)


def validate(config: Config) -> None:
    """Range checks that types alone cannot express: each section's `validate()`, beside its
    fields, the task's last (TaskConfig's, when it has one)."""
    sections = [getattr(config, setting.name) for setting in dataclasses.fields(config)]
    for section in [*(s for s in sections if s is not config.task), config.task]:
        checks = getattr(section, "validate", None)
        if checks is not None:
            checks()


def _positive(section: str, **values: float) -> None:
    for key, value in values.items():
        if value <= 0:
            raise ConfigError(f"{section}.{key} must be positive, got {value}")


def _not_negative(section: str, **values: float) -> None:
    for key, value in values.items():
        if value < 0:
            raise ConfigError(f"{section}.{key} must be >= 0, got {value}")


def field_types(section: type) -> dict[str, Any]:
    """The types of a section's fields; `Config.task`'s names task.py's TaskConfig, which this
    module cannot import at its top (see task_config_class)."""
    if issubclass(section, Config):
        return typing.get_type_hints(section, localns={"TaskConfig": task_config_class()})
    return typing.get_type_hints(section)


def setting_key(setting: dataclasses.Field) -> str:
    """The key of a setting in YAML and overrides: its field's name unless its metadata says."""
    return setting.metadata.get("key", setting.name)


def plain(value: Any) -> Any:
    """`value` as YAML and JSON hold it: dicts, lists, strings, numbers, booleans and null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {setting_key(f): plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, PurePath):
        return str(value)
    return value
