"""Typed run configuration: dataclass defaults, a YAML file, then `section.key=value` overrides.

Everything is validated here, before any process group starts, so a typo fails in one second with a
message that names the key instead of failing minutes later on every rank.

schema.py holds the settings (a dataclass per section, with defaults, `#:` help lines and range
checks; the `task` section is task.py's `TaskConfig`); loader.py reads a YAML file and overrides
onto them. The functions below bind the loader to this module's `Config`, looked up when called,
so that a subclass of `Config` put in its place here (a test's task with more fields) is the one
loaded, listed and printed.
Import everything from here: `from <package>.config import Config, load_config`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from . import loader
from .loader import Setting, to_yaml
from .schema import (
    BestConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DistConfig,
    EmaConfig,
    InitConfig,
    OptimConfig,
    ProfileConfig,
    RunConfig,
{%- if cookiecutter.tracker != "none" %}
    TrackerConfig,
{%- endif %}
    TrainConfig,
    task_config_class,
    validate,
)

__all__ = [
    "BestConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "EmaConfig",
    "InitConfig",
    "OptimConfig",
    "ProfileConfig",
    "RunConfig",
    "Setting",
{%- if cookiecutter.tracker != "none" %}
    "TrackerConfig",
{%- endif %}
    "TrainConfig",
    "flatten",
    "from_dict",
    "load_config",
    "read_run_config",
    "settings",
    "task_config_class",
    "to_yaml",
    "validate",
]

#: config.py, the module this package replaced in 1.0. An update that could not delete it (it
#: held changes of the project's own) leaves it here, where Python would ignore it in silence.
_LEFT_BEHIND = Path(__file__).parent.with_suffix(".py")
if _LEFT_BEHIND.exists():
    raise ImportError(
        f"{_LEFT_BEHIND} is ignored: the config is the package {_LEFT_BEHIND.with_suffix('')} "
        "since 1.0. Carry your changes over (TaskConfig into task.py, other settings into "
        "config/schema.py), then delete config.py (CHANGELOG: what a project that updates must "
        "change)"
    )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build the config from defaults, an optional YAML file, then `section.key=value` overrides."""
    return loader.load(Config, path, overrides)


def from_dict(values: dict[str, Any]) -> Config:
    """The defaults with `values` (nested as in `Config.to_dict()`) applied, checked, validated."""
    return loader.build(Config, values)


def read_run_config(path: str | Path) -> Config:
    """The settings a run wrote (an export's config.yaml), type-checked but not validated.

    For rebuilding the run's model elsewhere. `validate` checks that training can start here:
    task.data_dir holds a manifest, init.weights exists, an object store's package is
    installed. A machine that only loads the model may hold none of that, and the run passed
    those checks when it wrote the file.
    """
    return loader.read_checked(Config, Path(path))


def flatten(values: dict[str, Any]) -> dict[str, Any]:
    """`section.key` -> value for a nested dict such as `Config.to_dict()`: the overrides' names
    (a dict-valued setting stays one value: see loader.flatten)."""
    return loader.flatten(values, Config)


def settings() -> list[Setting]:
    """Every `section.key` of `Config()` with its type, default and one-line help, in order."""
    return loader.settings(Config)


def __getattr__(name: str) -> Any:
    """`from .config import TaskConfig`, as projects before 1.0 wrote it, works for one more
    release, with a warning: the class is task.py's now."""
    if name != "TaskConfig":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    package = __name__.rpartition(".")[0]
    warnings.warn(
        f"import TaskConfig from {package}.task: {__name__}.TaskConfig goes in the next release",
        FutureWarning,
        stacklevel=2,
    )
    return task_config_class()
