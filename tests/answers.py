"""Answers for the hook tests: a complete valid context, the hooks rendered the way cookiecutter
renders them, and generation from a replay file, which hands its values to the template as they
are (answers on the command line are rendered as Jinja by cookiecutter first)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import jinja2
from cookiecutter.main import cookiecutter
from matrix import CONTEXT, DEFAULTS, ROOT

HOOKS = ROOT / "hooks"


def _load_formats() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "template_extensions", ROOT / "template_extensions.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The template's Jinja filters (template_extensions.py), as cookiecutter loads them.
FORMATS = _load_formats()
#: The options a person answers (no private or derived keys), with valid values.
ANSWERS = {
    **DEFAULTS,
    "project_name": "DDP Project",
    "project_slug": "ddp-project",
    "package_name": "ddp_project",
    "description": "A project.",
    "author_name": "Ada Lovelace",
    "author_email": "ada@example.com",
    "slurm_partition": "gpu",
    "slurm_account": "",
    "slurm_nodes": "2",
    "slurm_gpus_per_node": "0",
    "slurm_cpus_per_process": "8",
    "slurm_time_limit": "2-00:00:00",
}
#: What a generated project records in .cookiecutter.json, ready to replay.
RECORDED = {**ANSWERS, "__project_dir": "ddp-project"}
#: Everything the pre-generation hook sees in a real generation: the answers, the private keys
#: of cookiecutter.json, the derived directory name and the keys cookiecutter adds.
VALID = {
    **{name: value for name, value in CONTEXT.items() if name.startswith("_")},
    **ANSWERS,
    "__project_dir": "ddp-project",
    "_template": str(ROOT),
    "_output_dir": "/tmp/out",
    "_repo_dir": str(ROOT),
    "_checkout": None,
}


def load_hook(name: str, context: dict) -> types.ModuleType:
    """Render a hook as cookiecutter does (answers as JSON, the template's extension loaded)
    and import it as a module."""
    environment = jinja2.Environment(extensions=[FORMATS.FormatFilters])
    source = environment.from_string((HOOKS / name).read_text()).render(cookiecutter=context)
    module = types.ModuleType(name.removesuffix(".py"))
    sys.modules[module.__name__] = module  # as for any import (dataclasses look it up)
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def render_from_replay(tmp_path: Path, answers: dict) -> Path:
    """Generate from a replay file in `tmp_path` holding `answers`, into tmp_path/out."""
    out = tmp_path / "out"
    out.mkdir()
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"cookiecutter": answers}, ensure_ascii=False))
    return Path(cookiecutter(str(ROOT), replay=str(replay), output_dir=str(out)))
