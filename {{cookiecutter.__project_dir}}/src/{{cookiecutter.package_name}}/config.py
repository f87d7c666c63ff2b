"""Typed run configuration: dataclass defaults, a YAML file, then `section.key=value` overrides.

Everything is validated here, before any process group starts, so a typo fails in one second with a
message that names the key instead of failing minutes later on every rank.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


@dataclass
class RunConfig:
    """Where the run lives. The same directory on a second launch means: resume."""

    dir: str = "runs/default"
    seed: int = 1234


@dataclass
class TaskConfig:
{%- if cookiecutter.example == "classifier" %}
    """Size of the example task (see task.py); replace with your own task's settings."""

    num_train_samples: int = 8192
    num_eval_samples: int = 1000
    input_dim: int = 32
    hidden_dim: int = 128
    num_classes: int = 8
    dropout: float = 0.1
{%- else %}
    """The text and the size of the example language model (see task.py and gpt.py).

    `text_path`: the file to learn, read as bytes; empty: a text of `generated_bytes` bytes
    generated from run.seed, so nothing is downloaded. Its first 90% trains, the rest evaluates,
    in windows of `block_size` + 1 bytes. `num_train_samples` / `num_eval_samples` > 0 take only
    that many windows of each part (quick runs); 0 takes them all. The defaults are a tiny model
    that trains on a laptop CPU; configs/gpt-small.yaml and configs/gpt2-124m.yaml are bigger.
    """

    text_path: str = ""
    generated_bytes: int = 1_000_000
    num_train_samples: int = 0
    num_eval_samples: int = 0
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
{%- endif %}


@dataclass
class DataConfig:
    """DataLoader settings. The global batch is in TrainConfig.

    `num_workers` > 0 loads batches in that many worker processes per rank, each keeping
    `prefetch_factor` batches ready; `persistent_workers` keeps them alive from one epoch (and
    evaluation) to the next. `pin_memory` speeds up copies to a GPU (ignored on CPU).
    """

    num_workers: int = 0
    prefetch_factor: int = 2
    persistent_workers: bool = True
    pin_memory: bool = True


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay to `min_lr_ratio * lr`."""

    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


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
    """

    global_batch_size: int = 128
    micro_batch_size: int = 32
    eval_batch_size: int = 64
    epochs: int = 3
    max_steps: int = -1
    mixed_precision: Literal["bf16", "fp16", "none"] = {{ cookiecutter.mixed_precision | python_string }}
    compile: bool = False
    tf32: bool = True
    eval_every: int = 50
    log_every: int = 10
    progress_bar: bool = True
    peak_tflops: float = 0.0


@dataclass
class CheckpointConfig:
    """Atomic checkpoints in `<run.dir>/checkpoints`; the newest valid one is resumed from.

    `resume`: continue the run in `run.dir` from its newest checkpoint. With `false`, a run
    directory that already holds checkpoints is refused rather than mixed with a new run.
    `stop_on_signals`: SIGTERM (preemption, scancel, torchrun), SIGUSR1 and SIGUSR2 (Slurm's
    time-limit warning) make every rank finish the same step, save a checkpoint and exit; see
    stopping.py for the exit statuses. The ranks compare notes about every `stop_check_s` seconds
    of training (0: after every step), so a stop comes about 2 x stop_check_s after the signal.
    """

    every_steps: int = 50
    keep_last: int = 3
    resume: bool = True
    stop_on_signals: bool = True
    stop_check_s: float = 1.0


@dataclass
class DistConfig:
    """Device, process group and DistributedDataParallel settings.

    `auto` picks CUDA with NCCL when a GPU is visible, else CPU with gloo.
    `timeout_s` bounds start-up and every training collective: a rank that hangs or dies ends
    the job after that long instead of leaving the others waiting. `barrier_timeout_s` bounds the
    waits around checkpoint writes and work only rank 0 does (a tracker that starts slowly).
    `check_replicas_every` > 0 compares a checksum of every parameter across ranks every that
    many steps (a debugging aid: replicas that drift apart mean a bug outside DDP).

    DDP: gradients are all-reduced in buckets of `bucket_cap_mb`, overlapped with backward.
    `broadcast_buffers` copies rank 0's buffers (e.g. BatchNorm statistics) to the others at
    every forward; turn it off for models without buffers that change. `find_unused_parameters`
    is needed only when some parameters get no gradient in a step (costs a graph traversal per
    step). `static_graph` declares that the same parameters are used every step (allows more
    overlap). `comm_hook` compresses the gradients sent: fp16 (or bf16, NCCL only) halves the
    bytes, `powersgd` sends a rank-`powersgd_rank` approximation after the lr warmup (much less,
    lossy; its error feedback is not checkpointed, so a resumed run is no longer bitwise
    reproducible).
    """

    device: Literal["auto", "cuda", "cpu"] = "auto"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: int = 60
    barrier_timeout_s: int = 1800
    bucket_cap_mb: int = 25
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    static_graph: bool = False
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: int = 1
    check_replicas_every: int = 0


@dataclass
class ProfileConfig:
    """A torch.profiler trace of a few steps on rank 0, written to `<run.dir>/profile/`.

    Skips `wait_steps` steps after the start (or the resume), then records `active_steps`. Open
    the trace in https://ui.perfetto.dev or chrome://tracing; summary.txt lists the top ops.
    """

    enabled: bool = False
    wait_steps: int = 5
    active_steps: int = 3
{%- if cookiecutter.tracker != "none" %}


@dataclass
class TrackerConfig:
    """Experiment tracker ({{ cookiecutter.tracker }}); metrics.jsonl is written either way."""

    enabled: bool = True
{%- if cookiecutter.tracker in ["wandb", "mlflow"] %}
    project: str = {{ cookiecutter.project_slug | python_string }}
{%- endif %}
{%- if cookiecutter.tracker == "mlflow" %}
    tracking_uri: str = ""
{%- endif %}
{%- endif %}


@dataclass
class Config:
    """The whole run configuration; `Config()` is the documented default."""

    run: RunConfig = field(default_factory=RunConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
{%- if cookiecutter.tracker != "none" %}
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
{%- endif %}

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (lists for tuples), fit for YAML, JSON and checkpoints."""
        return _plain(dataclasses.asdict(self))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build the config from defaults, an optional YAML file, then `section.key=value` overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        values = _read_yaml(Path(path))
    for override in overrides or []:
        _apply_override(values, override)
    config = _build(Config, values, prefix="")
    validate(config)
    return config


def from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (e.g. the copy stored in a checkpoint)."""
    config = _build(Config, values, prefix="")
    validate(config)
    return config


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`section.key` -> value for a nested dict such as `Config.to_dict()`: the overrides' names."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def to_yaml(config: Config) -> str:
    """The resolved config as YAML, in declaration order."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def validate(config: Config) -> None:
    """Range checks that types alone cannot express."""
    positive = {
        "train.global_batch_size": config.train.global_batch_size,
        "train.micro_batch_size": config.train.micro_batch_size,
        "train.eval_batch_size": config.train.eval_batch_size,
        "train.log_every": config.train.log_every,
        "train.eval_every": config.train.eval_every,
        "checkpoint.every_steps": config.checkpoint.every_steps,
        "checkpoint.keep_last": config.checkpoint.keep_last,
        "dist.timeout_s": config.dist.timeout_s,
        "dist.barrier_timeout_s": config.dist.barrier_timeout_s,
        "dist.bucket_cap_mb": config.dist.bucket_cap_mb,
        "dist.powersgd_rank": config.dist.powersgd_rank,
        "data.prefetch_factor": config.data.prefetch_factor,
        "profile.active_steps": config.profile.active_steps,
{%- if cookiecutter.example == "classifier" %}
        "task.num_train_samples": config.task.num_train_samples,
        "task.num_eval_samples": config.task.num_eval_samples,
{%- else %}
        "task.generated_bytes": config.task.generated_bytes,
        "task.block_size": config.task.block_size,
        "task.n_layer": config.task.n_layer,
        "task.n_head": config.task.n_head,
        "task.n_embd": config.task.n_embd,
{%- endif %}
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
{%- if cookiecutter.example == "gpt" %}
    task = config.task
    if task.n_embd % task.n_head:
        raise ConfigError(
            f"task.n_embd={task.n_embd} must be a multiple of task.n_head={task.n_head}: "
            "each attention head takes an equal share of the embedding"
        )
    if not 0 <= task.dropout < 1:
        raise ConfigError(f"task.dropout must be in [0, 1), got {task.dropout}")
    for key in ("num_train_samples", "num_eval_samples"):
        if getattr(task, key) < 0:
            raise ConfigError(f"task.{key} must be >= 0 (0 takes every window of the text)")
    if task.text_path and not Path(task.text_path).is_file():
        raise ConfigError(
            f"task.text_path={task.text_path} is not a file. Give the path of a text file to "
            "train on, or leave task.text_path empty to train on a generated text."
        )
{%- endif %}
    if config.train.epochs <= 0 and config.train.max_steps <= 0:
        raise ConfigError("set train.epochs or train.max_steps to a positive number")
    if config.checkpoint.stop_check_s < 0:
        raise ConfigError(
            f"checkpoint.stop_check_s must be >= 0 (0 checks after every step), "
            f"got {config.checkpoint.stop_check_s}"
        )
    if config.dist.check_replicas_every < 0:
        raise ConfigError("dist.check_replicas_every must be >= 0 (0 turns the check off)")
    if config.train.peak_tflops < 0:
        raise ConfigError(
            f"train.peak_tflops must be >= 0 (0 looks the GPU up), got {config.train.peak_tflops}"
        )
    if config.profile.wait_steps < 0:
        raise ConfigError(f"profile.wait_steps must be >= 0, got {config.profile.wait_steps}")
    if config.data.num_workers < 0:
        raise ConfigError(f"data.num_workers must be >= 0, got {config.data.num_workers}")
    if config.optim.lr <= 0:
        raise ConfigError(f"optim.lr must be positive, got {config.optim.lr}")
    if not 0 <= config.optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {config.optim.min_lr_ratio}")


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from error
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded


def _apply_override(values: dict[str, Any], override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key or "." not in key:
        raise ConfigError(
            f"override {override!r} must look like section.key=value, e.g. train.epochs=5"
        )
    *sections, leaf = key.split(".")
    node = values
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {section!r} is not a section")
    try:
        node[leaf] = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {override!r}: cannot parse value {raw!r}: {error}") from error


def _build(cls: type, values: Any, prefix: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        where = prefix.rstrip(".") or "top level"
        keys = ", ".join(prefix + key for key in unknown)
        raise ConfigError(f"unknown key(s) {keys} in {where}; valid keys: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name not in values:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, values[name], prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(values[name], hint, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = get_origin(hint)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin is tuple:
        items = get_args(hint)
        if not isinstance(value, (list, tuple)) or len(value) != len(items):
            raise ConfigError(f"{key} must be a list of {len(items)} values, got {value!r}")
        pairs = enumerate(zip(value, items, strict=True))
        return tuple(_coerce(item, kind, f"{key}[{i}]") for i, (item, kind) in pairs)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str and isinstance(value, str):
        return value
    expected = getattr(hint, "__name__", hint)
    raise ConfigError(f"{key} must be of type {expected}, got {value!r} ({type(value).__name__})")


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
