"""Remove the files of options that were not chosen, from one declarative table.

A path in the table that the rendered project does not contain is a template bug: it fails the
generation loudly instead of leaving the table to drift from the template.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

CONTEXT = json.loads(r"""{{ cookiecutter | tojson }}""")

#: path (relative to the project, `{package_name}` expanded) -> answers under which it is kept.
#: A list means "any of these values".
KEEP_ONLY_IF = {
    "launch/slurm": {"use_slurm": True},
    "Dockerfile": {"use_docker": True},
    ".dockerignore": {"use_docker": True},
    "apptainer.def": {"use_docker": True},
    "src/{package_name}/gpt.py": {"example": "gpt"},
    "src/{package_name}/prepare.py": {"example": "gpt"},
    "src/{package_name}/loading/shards.py": {"example": "gpt"},
    "benchmarks/shards.py": {"example": "gpt"},
    "tests/machinery/test_prepare.py": {"example": "gpt"},
    "tests/machinery/test_shards.py": {"example": "gpt"},
    "configs/gpt-small.yaml": {"example": "gpt"},
    "configs/gpt2-124m.yaml": {"example": "gpt"},
    "tests/example/test_gpt.py": {"example": "gpt"},
    "tests/example/test_classifier.py": {"example": "classifier"},
    "src/{package_name}/monitoring/tracker.py": {"tracker": ["tensorboard", "wandb", "mlflow"]},
    "tests/machinery/test_tracker.py": {"tracker": ["tensorboard", "wandb", "mlflow"]},
    ".github": {"ci": "github"},
    ".gitlab-ci.yml": {"ci": "gitlab"},
    "renovate.json": {"ci": "gitlab"},
}


def should_keep(condition: dict, context: dict) -> bool:
    return all(
        context[key] in value if isinstance(value, list) else context[key] == value
        for key, value in condition.items()
    )


def prune(project: Path, context: dict) -> list[str]:
    """Delete what the answers deselect; return the table's paths that were missing."""
    missing = []
    for pattern, condition in KEEP_ONLY_IF.items():
        path = project / pattern.format(package_name=context["package_name"])
        if not path.exists():
            missing.append(str(path.relative_to(project)))
        elif not should_keep(condition, context):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    return missing


def main() -> int:
    missing = prune(Path.cwd(), CONTEXT)
    for path in missing:
        message = f"ERROR: template bug: {path} is listed in KEEP_ONLY_IF but was not rendered"
        print(message, file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
