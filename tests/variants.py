"""Every template file, rendered once per distinct combination of the options it reads.

A file's rendered text depends only on the cookiecutter variables its Jinja reads, and on what
those variables' defaults in cookiecutter.json read in turn. `dependencies` finds them by
walking the file's Jinja syntax tree (its path included); a file that reads the context in a
way the walk cannot pin down (the whole `cookiecutter` object, a key computed at render time,
another template) depends on every option. Rendering each file once per distinct value of its
dependencies, among the valid combinations that keep it, covers every combination by
construction, at a cost that grows with the number of distinct files rather than with the
product of the options.

Files are rendered as cookiecutter's `generate_file` renders them (cookiecutter's Jinja
environment with the template's extensions, the same newline and mode), from a context built
the way `cookiecutter()` builds it; the render tests check that against whole cookiecutter
renders, byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
import tempfile
import types
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from answers import VALID, load_hook
from binaryornot.check import is_binary
from cookiecutter.config import get_user_config
from cookiecutter.environment import StrictEnvironment
from cookiecutter.generate import apply_overwrites_to_context, generate_context
from cookiecutter.prompt import prompt_for_config
from cookiecutter.utils import create_env_with_context
from jinja2 import FileSystemLoader, Template, meta, nodes
from matrix import CHOICES, CONTEXT, DEFAULTS, ROOT, valid_combinations

TEMPLATE = ROOT / "{{cookiecutter.__project_dir}}"
ALL_OPTIONS = frozenset(CHOICES)

# cookiecutter puts the template directory on sys.path for its `_extensions`; so do the tests.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))


def build_context(answers: dict) -> dict:
    """The render context `cookiecutter(no_input=True, extra_context=answers)` builds."""
    context = generate_context(
        context_file=str(ROOT / "cookiecutter.json"),
        default_context=get_user_config()["default_context"],
        extra_context=answers,
    )
    context["_cookiecutter"] = {
        key: value for key, value in context["cookiecutter"].items() if not key.startswith("_")
    }
    context["cookiecutter"].update(prompt_for_config(context, no_input=True))
    context["cookiecutter"]["_template"] = str(ROOT)
    context["cookiecutter"]["_output_dir"] = str(ROOT)
    context["cookiecutter"]["_repo_dir"] = str(ROOT)
    context["cookiecutter"]["_checkout"] = None
    return context


@cache
def environment() -> StrictEnvironment:
    """cookiecutter's Jinja environment for this template, as `generate_files` sets it up. It
    depends on cookiecutter.json alone (`_extensions`, `_jinja2_env_vars`), never on the
    answers, so one serves every combination and compiles each template once."""
    env = create_env_with_context(generate_context(str(ROOT / "cookiecutter.json")))
    env.loader = FileSystemLoader([str(TEMPLATE), str(TEMPLATE.parent / "templates")])
    return env


def template_files() -> list[str]:
    """Every file of the project template, as a path relative to it (still in Jinja)."""
    return sorted(str(path.relative_to(TEMPLATE)) for path in TEMPLATE.rglob("*") if path.is_file())


def references(source: str) -> frozenset[str] | None:
    """The cookiecutter variables a Jinja source reads, or None when the scan cannot tell:
    `cookiecutter` used whole (`cookiecutter | tojson`, `cookiecutter.items()`, `cookiecutter[k]`,
    `{% set c = cookiecutter %}`), an attribute that cookiecutter.json does not define, another
    context name (`_cookiecutter`), or another template (include, import, extends)."""
    env = environment()
    tree = env.parse(source)
    if meta.find_undeclared_variables(tree) - {"cookiecutter"} - set(env.globals):
        return None
    found: set[str] = set()

    def visit(node: nodes.Node) -> bool:
        """Record the variables under `node`; False when one is read in an opaque way."""
        if isinstance(node, (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
            return False
        target = node.node if isinstance(node, (nodes.Getattr, nodes.Getitem)) else None
        if isinstance(target, nodes.Name) and target.name == "cookiecutter":
            if isinstance(node, nodes.Getattr):
                name = node.attr
            else:
                name = node.arg.value if isinstance(node.arg, nodes.Const) else None
            if not isinstance(name, str) or name not in CONTEXT:
                return False
            found.add(name)
            return True
        if isinstance(node, nodes.Name) and node.name == "cookiecutter":
            return False
        return all(visit(child) for child in node.iter_child_nodes())

    return frozenset(found) if visit(tree) else None


@cache
def variable_dependencies(name: str) -> frozenset[str]:
    """The options a cookiecutter.json variable's value depends on: itself if it is an option,
    and whatever its templated default reads (`package_name` reads `project_slug`, ...)."""
    default = CONTEXT.get(name)
    own = {name} & ALL_OPTIONS
    if not isinstance(default, str):
        return frozenset(own)
    read = references(default)
    if read is None:
        return ALL_OPTIONS
    return frozenset(own.union(*(variable_dependencies(other) for other in read)))


@cache
def dependencies(infile: str) -> frozenset[str]:
    """The options a template file's path and text depend on."""
    # cookiecutter copies a binary file as it is, and renders only its path.
    text = "" if is_binary(str(TEMPLATE / infile)) else (TEMPLATE / infile).read_text()
    read = set()
    for source in (infile, text):
        found = references(source)
        if found is None:
            return ALL_OPTIONS
        read |= found
    return frozenset().union(*(variable_dependencies(name) for name in read))


def option_key(combo: dict, options: frozenset[str]) -> tuple:
    """The values of `options` in `combo`, in cookiecutter.json's order of the options."""
    return tuple(combo[name] for name in _ordered(options))


@cache
def _ordered(options: frozenset[str]) -> tuple[str, ...]:
    return tuple(name for name in CHOICES if name in options)


def templated(value: object) -> bool:
    """Whether a cookiecutter.json value is Jinja that cookiecutter renders into the answer."""
    return isinstance(value, str) and ("{{" in value or "{%" in value)


@cache
def derived_from() -> frozenset[str]:
    """The options that the templated values of cookiecutter.json read (none, so far)."""
    derived = [name for name, value in CONTEXT.items() if templated(value)]
    return frozenset().union(*map(variable_dependencies, derived))


@cache
def _base_context(key: str) -> dict:
    return build_context(json.loads(key))


def context_for(combo: dict) -> dict:
    """The render context of a combination, as `build_context` makes it. cookiecutter renders
    every value in it, which costs 50 ms; so one context is built per distinct value of the
    options that templated values read, and the other options' answers, plain values, are
    put in as cookiecutter puts them."""
    base = _base_context(
        json.dumps({**DEFAULTS, **{name: combo[name] for name in derived_from()}}, sort_keys=True)
    )
    assert not any(map(templated, combo.values())), combo
    context = {**base, "cookiecutter": {**base["cookiecutter"], **combo}}
    # cookiecutter's record of the answers before rendering: each choice list, chosen first.
    context["_cookiecutter"] = {
        name: list(value) if isinstance(value, list) else value
        for name, value in base["_cookiecutter"].items()
    }
    apply_overwrites_to_context(context["_cookiecutter"], combo)
    return context


@cache
def path_template(infile: str) -> Template:
    return environment().from_string(infile)


def project_path(infile: str, context: dict) -> str:
    """Where a template file lands in the project."""
    return path_template(infile).render(**context)


def render_text(infile: str, combo: dict) -> str:
    """A template file's text as a project of `combo` gets it."""
    return environment().get_template(infile).render(**context_for(combo))


def representatives(infile: str) -> list[dict]:
    """For each distinct value of the options `infile` depends on, the first valid combination
    that has it and keeps the file."""
    first: dict[tuple, dict] = {}
    for combo in valid_combinations():
        if infile in kept_files(combo):
            first.setdefault(option_key(combo, dependencies(infile)), combo)
    return list(first.values())


@cache
def _source(infile: str) -> tuple[bool, str | None, int]:
    """What `generate_file` reads of a template file besides its text: whether it is binary
    (copied as it is), the newline of its first line (the rendered file's newline) and its mode."""
    path = TEMPLATE / infile
    with path.open(encoding="utf-8", errors="replace") as source:
        source.readline()
        newline = source.newlines[0] if isinstance(source.newlines, tuple) else source.newlines
    return is_binary(str(path)), newline, path.stat().st_mode


def render_file(infile: str, context: dict, project: Path) -> Path:
    """Write a template file into `project` as cookiecutter's `generate_file` does (rendered
    with the same environment, newline and mode), and return its path. The cover's whole
    renders check that the two agree byte for byte."""
    out = project / project_path(infile, context)
    if not out.parent.is_dir():
        out.parent.mkdir(parents=True)
    binary, newline, mode = _source(infile)
    if binary:
        shutil.copyfile(TEMPLATE / infile, out)
    else:
        text = environment().get_template(infile.replace(os.sep, "/")).render(**context)
        with out.open("w", encoding="utf-8", newline=newline) as rendered:
            rendered.write(text)
    out.chmod(stat.S_IMODE(mode))
    return out


@cache
def post_gen_hook() -> types.ModuleType:
    """The post-generation hook, rendered and imported as cookiecutter runs it."""
    return load_hook("post_gen_project.py", VALID)


@cache
def pruned_by() -> frozenset[str]:
    """The options that decide which files a project keeps: those the hook's table names."""
    table = post_gen_hook().KEEP_ONLY_IF
    return frozenset(name for condition in table.values() for name in condition)


#: Where the hook prunes empty stand-ins of a project's files. One directory serves every
#: run: each puts back the files the last one deleted (deleting is slow on some disks).
_STAND_INS = tempfile.TemporaryDirectory(prefix="stand-ins-")


@cache
def _kept(key: str) -> dict[str, str]:
    context = context_for(json.loads(key))
    paths = {infile: project_path(infile, context) for infile in template_files()}
    project = Path(_STAND_INS.name)
    for path in paths.values():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).touch()
    missing = post_gen_hook().prune(project, context["cookiecutter"])
    assert not missing, f"the post-generation hook's table names unrendered {missing}"
    return {infile: path for infile, path in paths.items() if (project / path).exists()}


def kept_files(combo: dict) -> dict[str, str]:
    """Template file -> its path in the project, for each file a project of `combo` keeps:
    every file rendered, less what the post-generation hook's `prune` deletes (on empty
    stand-ins; the hook reads only the options its table names, so one run serves them all)."""
    values = {name: combo[name] for name in pruned_by()}
    return _kept(json.dumps({**DEFAULTS, **values}, sort_keys=True))


@cache
def sometimes_absent() -> frozenset[str]:
    """The template files that some valid combination does not keep."""
    always = set(template_files()).intersection(*map(kept_files, valid_combinations()))
    return frozenset(template_files()) - always


@dataclass
class Forest:
    """Partial projects under `root`, one per combination that some file variant is rendered
    for (`root/<index in valid_combinations()>/`). Each holds the files rendered for that
    combination, exactly as cookiecutter renders them, and where it holds Python files, empty
    stand-ins for the rest of the project."""

    root: Path
    combos: list[dict]
    companions: dict[str, list[str]]
    #: (template file, its options' values) -> index of the combination it is rendered for
    index: dict[tuple[str, tuple], int] = field(default_factory=dict)
    #: Empty files that stand for the rest of a project beside the variants
    stand_ins: set[Path] = field(default_factory=set)

    def path(self, infile: str, combo: dict) -> Path:
        """The rendered variant of `infile` that `combo` gets."""
        number = self.index[infile, option_key(combo, dependencies(infile))]
        return self.root / str(number) / kept_files(combo)[infile]

    def files(self) -> list[Path]:
        """Every rendered variant."""
        every = (path for path in self.root.rglob("*") if path.is_file())
        return sorted(path for path in every if path not in self.stand_ins)

    def describe(self, path: Path) -> str:
        """A rendered file as a failure names it: its path in the project, and the values of
        the options it (and its companions) depend on."""
        number, *parts = path.relative_to(self.root).parts
        combo = self.combos[int(number)]
        relative = "/".join(parts)
        infile = next(name for name, kept in kept_files(combo).items() if kept == relative)
        group = [infile, *self.companions.get(infile, [])]
        options = frozenset().union(*map(dependencies, group))
        values = ", ".join(f"{name}={combo[name]}" for name in _ordered(options))
        return f"{relative} [{values or 'any options'}]"

    def explain(self, output: str) -> str:
        """A tool's output with each rendered file's path (absolute, or relative to `root`)
        replaced by `describe`."""
        pattern = rf"(?:{re.escape(str(self.root))}/|(?<![\w/.]))(\d+/[^\s:]+)"

        def describe(found: re.Match) -> str:
            path = self.root / found[1]
            return self.describe(path) if path.is_file() else found[0]

        return re.sub(pattern, describe, output)


def grow_forest(root: Path, companions: dict[str, list[str]]) -> Forest:
    """Render every template file once per distinct value of the options it depends on, for
    the first valid combination (in `valid_combinations()` order) that keeps it. A file's
    `companions` (its linter's configuration, say) are rendered beside it, and then its
    variants are also told apart by the options the companions depend on."""
    forest = Forest(root, valid_combinations(), companions)
    kept = [kept_files(combo) for combo in forest.combos]
    wanted: dict[int, set[str]] = {}
    for infile in template_files():
        group = [infile, *companions.get(infile, [])]
        options = frozenset().union(*map(dependencies, group))
        first: dict[tuple, int] = {}
        for number, combo in enumerate(forest.combos):
            if infile not in kept[number]:
                continue
            key = option_key(combo, options)
            if key not in first:
                first[key] = number
                wanted.setdefault(number, set()).update(group)
            forest.index.setdefault((infile, option_key(combo, dependencies(infile))), first[key])
    for number, infiles in wanted.items():
        combo = forest.combos[number]
        context = context_for(combo)
        project = root / str(number)
        if any(infile.endswith(".py") for infile in infiles):
            # ruff tells first-party imports by the modules that exist: the rest of the
            # project is there as empty stand-ins.
            for infile, path in kept[number].items():
                if infile not in infiles:
                    stand_in = project / path
                    stand_in.parent.mkdir(parents=True, exist_ok=True)
                    stand_in.touch()
                    forest.stand_ins.add(stand_in)
        for infile in sorted(infiles):
            render_file(infile, context, project)
    return forest
