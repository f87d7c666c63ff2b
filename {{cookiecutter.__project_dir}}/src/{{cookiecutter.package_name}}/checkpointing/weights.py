"""Model weights in and out of a run, without the rest of the training state.

A checkpoint holds everything a run needs to continue (optimizer, schedule, data position, RNG),
which is what resuming wants and what two other uses do not:

- Fine-tuning starts a new run from another run's weights (`init.weights`): only the weights
  are taken, from a run directory, a checkpoint directory, a .pt file or a .safetensors file.
  `load_initial_weights` checks every name and shape before loading, so weights of another
  model fail with a message listing what differs instead of a long traceback.
- Inference needs the model and nothing else, in a plain Python process without the trainer or
  a process group. At the end of training, `export_weights` writes `<run.dir>/export/` with the
  weights as safetensors (no pickle: loading cannot run code), the run's config.yaml, and what
  the task gives the export (contract.py): what it read from its data to build the model
  (`model_settings`, e.g. a vocabulary size) and the files the model is used with
  (`export_files`, e.g. a tokenizer). The folder alone rebuilds the model: `load_model` takes
  it, or a copy of it, anywhere, without the training data. It reads the config without
  validating it (validation checks that training can start here, data and all), builds the
  task, hands it the recorded settings, and lets it build the model.

Tied weights (the GPT example's head shares its matrix with the token embedding) are one tensor
under two names in `state_dict()`; safetensors stores it once, under one of them, and a name
missing from the weights counts as present when its tensor is tied to one that is there.

Weights go in and out under the model's plain names: torch.compile's wrapper (a model that
`build_model` compiles, or a compiled block of it) adds `_orig_mod.` to the names of what it
wraps, and checkpoints, exports and loads leave it out (`plain_state_dict`,
`load_plain_state_dict`), so that weights move between compiled and plain models, and weights
saved with the prefix (by earlier releases) load too. Lazy modules (nn.LazyLinear) not yet
shaped take the shapes of the weights loaded into them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parameter import is_lazy
from torch.optim.swa_utils import AveragedModel

from ..config import ConfigError, read_run_config
from ..contract import TaskBase, adopt
from ..task import Task
from .checkpoint import (
    CheckpointReadError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    atomic_write_text,
    load_checkpoint,
)
from .layout import COMPLETE_MARKER, checkpoint_root, complete_checkpoints
from .storage import fsync_dir, storage_of

log = logging.getLogger(__name__)

EXPORT_DIR = "export"
EXPORT_CONFIG = "config.yaml"
#: What the task read from its data to build the model (`model_settings()`), as JSON.
MODEL_SETTINGS = "model_settings.json"
#: Suffixes read with torch.load (safe unpickler): a state dict, or a dict with a "model" key.
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
#: What torch.compile's wrapper (OptimizedModule) puts before the names of what it wraps.
_COMPILED = "_orig_mod."
#: Names of each kind listed in a mismatch message; the rest are counted.
_LISTED = 10
_FIX = (
    "Build the model with the same task.* settings as the run that wrote the weights (its "
    "config.yaml lists them), or start without init.weights."
)


class WeightsError(ValueError):
    """Weights that cannot be found, read, or loaded into the model."""


class _DamagedError(WeightsError):
    """A checkpoint that fails its checksum or cannot be read: an older one may still serve."""


def load_initial_weights(model: nn.Module, source: str | Path) -> str:
    """Load only the weights from `source` into `model`, in place and on its device.

    `source` is a run directory (its newest intact checkpoint; damaged ones are skipped), one
    checkpoint directory, a .pt/.pth/.bin file (a state dict, or a dict with a "model" key such
    as a checkpoint's state.pt) or a .safetensors file. Every name and shape is checked before
    anything is loaded. Returns a one-line description of what was loaded, for the log.
    """
    path = Path(source)
    if not path.exists():
        raise WeightsError(
            f"initial weights {path} do not exist. Give a run directory, a checkpoint directory, "
            f"a {'/'.join(TORCH_SUFFIXES)} file or a {SAFETENSORS_SUFFIX} file."
        )
    if path.is_dir():
        if (path / COMPLETE_MARKER).is_file():
            state, description = _from_checkpoint(path)
        elif checkpoint_root(path).is_dir():
            state, description = _from_run(path)
        else:
            raise WeightsError(_not_weights_dir(path))
    else:
        state, description = _read_file(path), f"weights from {path}"
    _load_checked(model, state, path)
    return description


def export_weights(
    model: nn.Module,
    run_dir: Path,
    config_yaml: str,
    name: str = "model",
    task: object | None = None,
) -> Path:
    """Write `<run_dir>/export/<name>.safetensors` and `<run_dir>/export/config.yaml`, and with
    `task` what it gives the export: its `export_files()` and its `model_settings()` (as
    model_settings.json, when it has any).

    What `load_model` reads: the weights without the training state, the config, and what the
    task took from its data to build the model, so that the folder alone rebuilds it. Each file
    is written under a temporary name, synced and renamed, so a crash leaves the previous export
    or the new one, never half a file. A DDP, EMA or compiled wrapper is looked through: the
    names are the bare model's, plain. Returns the weights' path.
    """
    export_dir = Path(run_dir) / EXPORT_DIR
    export_dir.mkdir(parents=True, exist_ok=True)
    if task is not None:
        _export_task_parts(adopt(task), export_dir)
    target = export_dir / f"{name}{SAFETENSORS_SUFFIX}"
    partial = target.with_name(target.name + ".partial")
    tensors, tied = _exported_tensors(_bare(model))
    safetensors.torch.save_file(tensors, str(partial), metadata=tied or None)
    with open(partial, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(partial, target)
    atomic_write_text(export_dir / EXPORT_CONFIG, config_yaml)
    fsync_dir(export_dir)
    return target


def load_model(run_dir: str | Path, ema: bool = False) -> nn.Module:
    """The trained model of a run, from its export, on the CPU and in eval mode.

    `run_dir` is a run directory, or an export folder: a run's export/, or a copy of it
    anywhere. For inference in a plain Python process: no trainer, no process group, no
    training data, any working directory. The task is built from the exported config.yaml (not
    validated: its checks are those of training, such as task.data_dir holding shards), takes
    the settings it recorded from its data (`load_model_settings`), and builds the model; the
    exported weights (the moving average's with `ema=True`) are loaded into it. The model is
    what `build_model` returns: compiled, if it compiles it.
    """
    export_dir = _export_dir(Path(run_dir))
    config_path = export_dir / EXPORT_CONFIG
    weights_path = export_dir / f"model{SAFETENSORS_SUFFIX}"
    if not (config_path.is_file() and weights_path.is_file()):
        raise WeightsError(
            f"{run_dir} holds no exported model: neither it nor its {EXPORT_DIR}/ holds "
            f"{weights_path.name} and {config_path.name}. The export is written at the end of "
            "training: run training to the end, or set checkpoint.export=true. To use a "
            "checkpoint instead, build the model and call load_initial_weights(model, run_dir)."
        )
    if ema:
        weights_path = export_dir / f"model_ema{SAFETENSORS_SUFFIX}"
        if not weights_path.is_file():
            raise WeightsError(
                f"{export_dir} holds no moving average of the weights ({weights_path.name}): "
                "train with ema.decay > 0 (e.g. 0.999) to export one, or load with ema=False."
            )
    try:
        config = read_run_config(config_path)
    except ConfigError as error:
        raise WeightsError(f"cannot rebuild the model from {config_path}: {error}") from error
    task = adopt(Task(config.task, seed=config.run.seed))
    if (export_dir / MODEL_SETTINGS).is_file():
        task.load_model_settings(json.loads((export_dir / MODEL_SETTINGS).read_text()))
    model = task.build_model()
    _load_checked(model, _read_file(weights_path), weights_path)
    return model.eval()


def _export_dir(path: Path) -> Path:
    """The export folder `path` names: itself when it holds exported weights, else the run
    directory's export/."""
    return path if (path / f"model{SAFETENSORS_SUFFIX}").is_file() else path / EXPORT_DIR


def _export_task_parts(task: TaskBase, export_dir: Path) -> None:
    """Copy the task's `export_files()` into `export_dir` and record its `model_settings()`."""
    own = {EXPORT_CONFIG, MODEL_SETTINGS}
    for name, source in task.export_files().items():
        if Path(name).name != name or name in own or name.endswith(SAFETENSORS_SUFFIX):
            raise WeightsError(
                f"{type(task).__name__}.export_files() names {name!r}: give each file a plain "
                f"file name, other than {', '.join(sorted(own))} and *{SAFETENSORS_SUFFIX}"
            )
        target = export_dir / name
        try:
            with open(source, "rb") as data:
                storage_of(target).write(target, lambda handle: shutil.copyfileobj(data, handle))
        except OSError as error:
            raise WeightsError(f"cannot export {source} as {target}: {error}") from error
    settings = task.model_settings()
    if settings:
        try:
            text = json.dumps(settings, indent=1, sort_keys=True) + "\n"
        except (TypeError, ValueError) as error:
            raise WeightsError(
                f"{type(task).__name__}.model_settings() must hold JSON values (numbers, "
                f"strings, lists, dicts): {error}"
            ) from error
        atomic_write_text(export_dir / MODEL_SETTINGS, text)


def _from_run(run_dir: Path) -> tuple[Mapping[str, Any], str]:
    """The model state of the newest checkpoint of `run_dir` that is intact."""
    checkpoints = complete_checkpoints(run_dir)
    if not checkpoints:
        raise WeightsError(
            f"run directory {run_dir} holds no complete checkpoint in "
            f"{checkpoint_root(run_dir)}: train it until it saves one, or give a weights file."
        )
    for path in reversed(checkpoints):
        try:
            return _from_checkpoint(path)
        except _DamagedError as error:
            log.warning("skipping checkpoint %s for the initial weights: %s", path, error)
    raise WeightsError(
        f"none of the {len(checkpoints)} checkpoints in {checkpoint_root(run_dir)} can be "
        "loaded (see the warnings above for each)"
    )


def _from_checkpoint(path: Path) -> tuple[Mapping[str, Any], str]:
    try:
        # world_size 0: no rank's own state is wanted, so only state.pt is verified and read.
        loaded = load_checkpoint(path, rank=0, world_size=0)
    except (CorruptCheckpointError, IncompatibleCheckpointError) as error:
        raise _DamagedError(f"checkpoint {path} cannot be used: {error}") from error
    except CheckpointReadError as error:  # the machine's error, not the file's: say so
        raise WeightsError(str(error)) from error
    state = loaded.state.get("model")
    if not isinstance(state, Mapping):
        raise _DamagedError(f"checkpoint {path} holds no model weights (no 'model' in state.pt)")
    step = loaded.state.get("step")
    return (
        state,
        f"weights of step {step} from {path}" if step is not None else f"weights from {path}",
    )


def _read_file(path: Path) -> Mapping[str, Any]:
    suffix = path.suffix.lower()
    try:
        if suffix == SAFETENSORS_SUFFIX:
            return safetensors.torch.load_file(path)
        if suffix in TORCH_SUFFIXES:
            return _model_state(torch.load(path, map_location="cpu", weights_only=True), path)
    except WeightsError:
        raise
    except Exception as error:  # unpickling, zip, header and I/O errors all mean: unusable
        raise WeightsError(f"cannot read weights from {path}: {error}") from error
    raise WeightsError(
        f"{path} is not a weights file: its suffix {path.suffix or '(none)'!r} is none of "
        f"{', '.join((*TORCH_SUFFIXES, SAFETENSORS_SUFFIX))}"
    )


def _model_state(loaded: Any, path: Path) -> Mapping[str, Any]:
    """The state dict in what torch.load returned: itself, or a checkpoint's "model" entry."""
    if isinstance(loaded, Mapping) and isinstance(loaded.get("model"), Mapping):
        return loaded["model"]
    if isinstance(loaded, Mapping) and loaded and all(isinstance(k, str) for k in loaded):
        return loaded
    raise WeightsError(
        f"{path} holds no state dict: expected a dict of tensors, or a dict with a 'model' "
        f"entry holding one, got {'an empty dict' if loaded == {} else type(loaded).__name__}"
    )


def plain_state_dict(module: nn.Module) -> dict[str, Any]:
    """`module.state_dict()` under plain names: without what torch.compile's wrappers add."""
    return {plain_name(key): value for key, value in module.state_dict().items()}


def load_plain_state_dict(module: nn.Module, state: Mapping[str, Any]) -> None:
    """Load `state` into `module` (strictly), each entry under the module's own name for it:
    plain names or compiled ones fit a compiled module or a plain one alike."""
    own = {plain_name(key): key for key in module.state_dict()}
    module.load_state_dict({own.get(plain_name(key), key): value for key, value in state.items()})


def plain_name(key: str) -> str:
    """A state dict's key without what torch.compile's wrappers add to it."""
    return key.replace(_COMPILED, "")


def _load_checked(model: nn.Module, state: Mapping[str, Any], source: Path) -> None:
    """Load `state` into `model` after checking every name and shape; ties are filled in. The
    names are compared plain; a lazy module not yet shaped takes the shape of its weights."""
    expected = plain_state_dict(model)
    state = {plain_name(key): value for key, value in state.items()}
    state = {**state, **_tied_from(state, expected)}
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    shapes = [
        f"{key}: checkpoint {_shape(state[key])} vs model {_shape(tensor)}"
        for key, tensor in expected.items()
        if key in state
        and isinstance(tensor, torch.Tensor)
        and not is_lazy(tensor)
        and _shape(state[key]) != _shape(tensor)
    ]
    if missing or unexpected or shapes:
        problems = [
            _listing("missing from the weights", missing),
            _listing("not in the model", unexpected),
            _listing("of another shape", shapes, separator="; "),
        ]
        raise WeightsError(
            f"the weights in {source} do not fit the model ({type(model).__name__}):\n"
            + "".join(problems)
            + _FIX
        )
    try:
        load_plain_state_dict(model, state)
    except RuntimeError as error:  # names and shapes fit; e.g. a value that is no tensor
        raise WeightsError(f"cannot load the weights in {source}: {error}") from error


def _tied_from(state: Mapping[str, Any], expected: Mapping[str, Any]) -> dict[str, Any]:
    """Entries for the model's names that are missing from `state` but share their tensor with a
    name that is there (tied weights, which safetensors stores once)."""
    present: dict[tuple, str] = {}
    for key, tensor in expected.items():
        if key in state and (identity := _identity(tensor)) is not None:
            present.setdefault(identity, key)
    filled = {}
    for key, tensor in expected.items():
        identity = _identity(tensor)
        if key not in state and identity in present:
            filled[key] = state[present[identity]]
    return filled


def _identity(tensor: Any) -> tuple | None:
    """What two names of one tied tensor have in common; None for what cannot be tied."""
    if not isinstance(tensor, torch.Tensor) or is_lazy(tensor) or tensor.numel() == 0:
        return None
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape))
    return f"a {type(value).__name__}, not a tensor"


def _listing(title: str, names: list[str], separator: str = ", ") -> str:
    if not names:
        return ""
    shown = separator.join(names[:_LISTED])
    more = f"{separator}and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return f"  {len(names)} {title}: {shown}{more}\n"


def _not_weights_dir(path: Path) -> str:
    message = (
        f"{path} is neither a run directory nor a checkpoint directory: it holds no "
        f"{checkpoint_root(path).name}/ and no {COMPLETE_MARKER} marker."
    )
    exported = path / EXPORT_DIR / f"model{SAFETENSORS_SUFFIX}"
    if exported.is_file():
        message += f" It holds exported weights: give {exported}."
    return message


def _bare(model: nn.Module) -> nn.Module:
    """The model inside DDP or an EMA's AveragedModel, whose names carry no `module.`."""
    while isinstance(model, (DistributedDataParallel, AveragedModel)):
        model = model.module
    return model


def _exported_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's tensors under plain names, contiguous and on the CPU, a tied tensor once:
    under the first of its names in sorted order, as safetensors' save_model keeps it; and each
    name left out, with the name it is stored under (safetensors' metadata for ties)."""
    state = plain_state_dict(model)
    stored_as: dict[tuple, str] = {}
    for key in sorted(state):
        identity = _identity(state[key])
        if identity is not None:
            stored_as.setdefault(identity, key)
    tensors, tied = {}, {}
    for key, tensor in state.items():
        identity = _identity(tensor)
        if identity is None or stored_as[identity] == key:
            tensors[key] = tensor.detach().cpu().contiguous()
        else:
            tied[key] = stored_as[identity]
    return tensors, tied
