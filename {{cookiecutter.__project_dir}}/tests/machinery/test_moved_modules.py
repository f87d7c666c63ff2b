"""The modules that moved into subpackages in 1.0 still import by their old names for one
release, as the same module objects, each with a FutureWarning naming its new place."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest

import {{ cookiecutter.package_name }}
from {{ cookiecutter.package_name }} import MOVED
from {{ cookiecutter.package_name }}.checkpointing import checkpoint


def rendered(old: str) -> bool:
    """Whether this project has the module (an option may leave it out)."""
    return importlib.util.find_spec(f"{{ cookiecutter.package_name }}.{MOVED[old]}") is not None


@pytest.mark.parametrize("old", [old for old in sorted(MOVED) if rendered(old)])
def test_an_old_module_name_imports_the_moved_module_with_a_future_warning(old: str) -> None:
    new = f"{{ cookiecutter.package_name }}.{MOVED[old]}"
    sys.modules.pop(f"{{ cookiecutter.package_name }}.{old}", None)
    with pytest.warns(FutureWarning, match=f"moved to {new} in release 1.0"):
        module = importlib.import_module(f"{{ cookiecutter.package_name }}.{old}")
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new, "the moved module keeps its own spec"


def test_the_old_form_of_an_import_from_a_moved_module_works() -> None:
    """`from <package>.weights import load_model`, as a script of an earlier release has it,
    in a fresh process."""
    script = (
        "import warnings\n"
        "warnings.simplefilter('error', FutureWarning)\n"
        "try:\n"
        "    from {{ cookiecutter.package_name }}.weights import load_model\n"
        "except FutureWarning as warning:\n"
        "    print(warning)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "checkpointing.weights" in result.stdout


def test_load_model_is_imported_from_the_package_itself() -> None:
    from {{ cookiecutter.package_name }}.checkpointing.weights import load_model

    assert {{ cookiecutter.package_name }}.load_model is load_model


def test_the_package_names_no_other_attribute_lazily() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        _ = {{ cookiecutter.package_name }}.nonexistent


def test_every_moved_module_is_found_in_its_subpackage_or_left_out_by_an_option() -> None:
    """A module moved again without updating MOVED would make its old name fail."""
    optional = {"shards", "tracker"}
    for old, new in MOVED.items():
        assert rendered(old) or old in optional, f"MOVED names {new}, which does not exist"


@pytest.mark.parametrize("name", sorted(checkpoint.MOVED_NAMES))
def test_a_name_that_left_checkpoint_py_imports_from_there_with_a_future_warning(
    name: str,
) -> None:
    new = f"{{ cookiecutter.package_name }}.checkpointing.{checkpoint.MOVED_NAMES[name]}"
    with pytest.warns(FutureWarning, match=f"{name} moved to {new} in release 1.0"):
        value = getattr(checkpoint, name)
    assert value is getattr(importlib.import_module(new), name)
