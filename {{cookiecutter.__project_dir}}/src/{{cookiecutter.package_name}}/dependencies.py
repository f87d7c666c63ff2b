"""The packages the project needs, checked before a command imports any of them.

A template update can add a dependency (safetensors and numpy came with 1.0). Until the project
is installed again, each command would end in a ModuleNotFoundError: a traceback per rank under
torchrun, then torchrun's report of 40 lines. `require_installed` says it in one line instead,
naming what is missing and the command that installs it, and exits with status 2.

What the project needs is read from its pyproject.toml where the package runs from its source
tree (an editable install, PYTHONPATH=src): after an update, that file lists what the installed
metadata does not yet. Elsewhere (an installed wheel), and on Python 3.10, which has no TOML
reader, the installed metadata is read. A requirement with an environment marker is not checked.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import sys
from pathlib import Path

#: The project's distribution, as pyproject.toml names it.
DISTRIBUTION = {{ cookiecutter.project_slug | python_string }}
#: The source tree: src/<package>/ is two levels below it.
SOURCE_TREE = Path(__file__).resolve().parents[2]
#: A requirement's distribution name: what comes before its extras, version or marker.
NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
EXIT_MISSING = 2


def declared() -> list[str]:
    """The requirements of the project (its `dependencies`, no extras)."""
    pyproject = SOURCE_TREE / "pyproject.toml"
    if pyproject.is_file() and sys.version_info >= (3, 11):
        import tomllib

        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        if project.get("name") == DISTRIBUTION:
            return list(project.get("dependencies", []))
    try:
        return importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:  # run from a copy of the package alone
        return []


def missing(requirements: list[str]) -> list[str]:
    """The requirements whose distribution is not installed (their version is not compared)."""
    absent = []
    for requirement in requirements:
        match = NAME.match(requirement)
        if match is None or ";" in requirement:
            continue
        try:
            importlib.metadata.distribution(match.group(1))
        except importlib.metadata.PackageNotFoundError:
            absent.append(requirement)
    return absent


def install_command(requirements: list[str]) -> str:
    """What installs them: the project again, from its source tree, or the packages alone."""
    if (SOURCE_TREE / "pyproject.toml").is_file():
        return f"pip install -e {shlex.quote(os.path.relpath(SOURCE_TREE))}"
    return f"pip install {' '.join(shlex.quote(requirement) for requirement in requirements)}"


def require_installed() -> None:
    """Exit with status 2 and one line (from the first process of a node only: torchrun's
    other ranks exit silently) when a package the project needs is not installed."""
    absent = missing(declared())
    if not absent:
        return
    if os.environ.get("LOCAL_RANK", "0") == "0":
        names = " and ".join(NAME.match(requirement).group(1) for requirement in absent)
        print(
            f"error: this project needs {names}, which this environment lacks: "
            f"{install_command(absent)}",
            file=sys.stderr,
        )
    raise SystemExit(EXIT_MISSING)
