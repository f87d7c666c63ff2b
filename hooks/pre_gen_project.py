"""Validate the answers before anything is rendered.

Every problem is reported as `ERROR: <what> <why> <how to fix>` and generation stops with exit
status 1; cookiecutter then removes the half-made project directory, so nothing is left behind.
The answers arrive as JSON data, never as Python source, so no answer can run code here.
"""

from __future__ import annotations

import json
import keyword
import re
import sys
from importlib import metadata

CONTEXT = json.loads(r"""{{ cookiecutter | tojson }}""")

MIN_COOKIECUTTER = (2, 7)
MAX_PACKAGE_NAME = 50
#: Import names the generated project depends on or ships as top-level directories.
RESERVED_PACKAGE_NAMES = {
    "alembic",
    "configs",
    "cookiecutter",
    "docs",
    "hatchling",
    "launch",
    "mlflow",
    "numpy",
    "pip",
    "pytest",
    "ruff",
    "setuptools",
    "sqlalchemy",
    "src",
    "tensorboard",
    "tests",
    "torch",
    "wandb",
    "yaml",
}
SLUG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PACKAGE = re.compile(r"^[a-z_][a-z0-9_]*$")
EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
ONE_LINE_FIELDS = ("project_name", "description", "author_name")
#: Partition and account names, or comma-separated lists of them; empty means the default.
SLURM_NAME = re.compile(r"^([A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*)?$")
#: Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
SLURM_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}(:\d{1,2}){0,2})$")
#: Whole-number Slurm answers and the smallest value each may take.
SLURM_COUNTS = {"slurm_nodes": 1, "slurm_gpus_per_node": 0, "slurm_cpus_per_process": 1}


def cookiecutter_version_error() -> str | None:
    try:
        found = metadata.version("cookiecutter")
    except metadata.PackageNotFoundError:
        return None
    numbers = tuple(int(part) for part in re.findall(r"\d+", found)[:2])
    if numbers < MIN_COOKIECUTTER:
        return (
            f"this template needs cookiecutter >= 2.7 (found {found}): older versions mishandle "
            "boolean answers. Upgrade with: pip install -U 'cookiecutter>=2.7'"
        )
    return None


def validate(context: dict) -> list[str]:
    """Every problem with the answers, as messages; an empty list means they are fine."""
    errors = []
    slug = str(context["project_slug"])
    if not SLUG.match(slug) or slug in {".", ".."}:
        errors.append(
            f"project_slug {slug!r} is not a safe directory name: use letters, digits, '-', '_' "
            "and '.', starting with a letter or digit (no path separators). "
            "Pass e.g. project_slug=my-project"
        )
    package = str(context["package_name"])
    if not PACKAGE.match(package):
        errors.append(
            f"package_name {package!r} is not a valid import name: use lowercase letters, digits "
            "and '_', not starting with a digit. Pass e.g. package_name=my_project"
        )
    elif keyword.iskeyword(package) or keyword.issoftkeyword(package):
        errors.append(
            f"package_name {package!r} is a Python keyword and cannot be imported. "
            f"Pass e.g. package_name={package}_project"
        )
    elif package in sys.stdlib_module_names or package in RESERVED_PACKAGE_NAMES:
        errors.append(
            f"package_name {package!r} would shadow the module of the same name in the standard "
            f"library or a dependency. Pass e.g. package_name={package}_project"
        )
    elif len(package) > MAX_PACKAGE_NAME:
        errors.append(
            f"package_name {package!r} is {len(package)} characters long; keep it to "
            f"{MAX_PACKAGE_NAME} so imports fit on a line. Pass a shorter package_name=..."
        )
    email = str(context["author_email"])
    if not EMAIL.match(email):
        errors.append(
            f"author_email {email!r} is not an email address (name@domain.tld). "
            "Pass e.g. author_email=you@example.com"
        )
    for field in ONE_LINE_FIELDS:
        value = str(context[field])
        if not value.strip() or any(ord(char) < 32 for char in value):
            errors.append(
                f"{field} {value!r} must be one non-empty line without control characters: "
                "it is written into pyproject.toml and the README."
            )
    for option in ("use_slurm", "use_docker"):
        if not isinstance(context[option], bool):
            errors.append(
                f"{option} {context[option]!r} is not yes or no. Pass {option}=yes or {option}=no"
            )
    errors += slurm_errors(context)
    errors += [f"invalid combination: {message}" for message in refused_combinations(context)]
    return errors


def slurm_errors(context: dict) -> list[str]:
    """Problems with the Slurm answers, which are written into #SBATCH lines as they are."""
    errors = []
    for field in ("slurm_partition", "slurm_account"):
        value = str(context[field])
        if not SLURM_NAME.match(value):
            errors.append(
                f"{field} {value!r} is not a Slurm name: use letters, digits, '_', '.' and '-' "
                f"(a comma-separated list for several), or leave it empty for the default. "
                f"Pass e.g. {field}=gpu"
            )
    for field, minimum in SLURM_COUNTS.items():
        value = str(context[field])
        if not value.isdigit() or int(value) < minimum:
            errors.append(
                f"{field} {value!r} must be a whole number >= {minimum}. Pass e.g. {field}="
                f"{max(minimum, 1)}"
            )
    time_limit = str(context["slurm_time_limit"])
    if not SLURM_TIME.match(time_limit):
        errors.append(
            f"slurm_time_limit {time_limit!r} is not a Slurm time: use minutes, HH:MM:SS or "
            "D-HH:MM:SS. Pass e.g. slurm_time_limit=24:00:00"
        )
    return errors


def refused_combinations(context: dict) -> list[str]:
    """Messages of the `_invalid_combinations` rules that match the answers."""
    messages = []
    for rule in context.get("_invalid_combinations", []):
        if all(_matches(context.get(key), value) for key, value in rule["when"].items()):
            messages.append(rule["message"].format(**context))
    return messages


def _matches(answer: object, expected: object) -> bool:
    return answer in expected if isinstance(expected, list) else answer == expected


def main() -> int:
    errors = [message for message in [cookiecutter_version_error()] if message]
    errors += validate(CONTEXT)
    for message in errors:
        print(f"ERROR: {message}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
