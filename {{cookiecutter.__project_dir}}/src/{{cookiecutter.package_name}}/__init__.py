{{ cookiecutter.description | python_string(docstring=True) }}

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

__version__ = "0.1.0"

#: The package's layout before 1.0 held every module at this level. Each of these now lives in
#: a subpackage; importing it by its old name still works in this release, with a FutureWarning
#: naming the new place, and stops working in the next.
MOVED = {
    "agreement": "cluster.agreement",
    "distributed": "cluster.distributed",
    "network": "cluster.network",
    "parent_watch": "faults.parent_watch",
    "signals": "faults.signals",
    "stopping": "faults.stopping",
    "watchdog": "faults.watchdog",
    "background_save": "checkpointing.background_save",
    "best": "checkpointing.best",
    "checkpoint": "checkpointing.checkpoint",
    "resume": "checkpointing.resume",
    "run_lock": "checkpointing.run_lock",
    "storage": "checkpointing.storage",
    "weights": "checkpointing.weights",
    "data": "loading.data",
    "shards": "loading.shards",
    "logs": "monitoring.logs",
    "metrics": "monitoring.metrics",
    "profiling": "monitoring.profiling",
    "throughput": "monitoring.throughput",
    "tracker": "monitoring.tracker",
    "divergence": "training.divergence",
    "losses": "training.losses",
    "optimizer": "training.optimizer",
    "rng": "training.rng",
    "trainer": "training.trainer",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `<package>.<old name>` as the module that moved: the same module object, so
    `isinstance`, patches and pickled references (a checkpoint's) keep working."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED:
            return None
        if importlib.util.find_spec(f"{__name__}.{MOVED[name]}") is None:
            return None  # not rendered in this project (an option left it out)
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new_name = f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}"
        warnings.warn(
            f"{spec.name} moved to {new_name} in release 1.0: import it from there "
            f"(the old name stops working in the next release)",
            FutureWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new_name)
        self._own_specs[new_name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system has given the module the old name's spec: give back its own.
        module.__spec__ = self._own_specs.pop(module.__name__)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> Any:
    """`from <package> import load_model`: loading exported or checkpointed weights, imported
    on first use so that the launcher, which imports this package, stays light."""
    if name == "load_model":
        from .checkpointing.weights import load_model

        return load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
