"""Every valid combination of options renders a clean, lint-free project.

The combinations come from cookiecutter.json (choice lists and booleans), filtered by the
`_invalid_combinations` table that the pre-generation hook enforces; nothing is listed by hand.

Every combination is checked through its files: a file's rendered text depends only on the
options it reads (tests/variants.py), so each template file is rendered once per distinct value
of those options, and each such variant is checked (no leftover Jinja, it parses, ruff,
shellcheck, hadolint, the CI services' schemas). The file set, the recorded answers and the
Apptainer definition are then checked for every combination. A pairwise cover of the options
is also rendered whole by cookiecutter and checked end to end, which shows as well that the
variants are rendered exactly as cookiecutter renders them.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
import variants
import yaml
from cookiecutter.main import cookiecutter
from matrix import (
    CHOICES,
    DEFAULTS,
    ROOT,
    combo_id,
    is_refused,
    pairwise_cover,
    valid_combinations,
)
from variants import (
    ALL_OPTIONS,
    Forest,
    context_for,
    dependencies,
    grow_forest,
    kept_files,
    option_key,
    references,
    render_file,
    template_files,
)

BIN = Path(sys.executable).parent
LEFTOVER_JINJA = ("{{ cookiecutter.", "{{cookiecutter.", "{%", "{#")
#: Files that configure a file's linter, rendered beside each variant of that file.
COMPANIONS = {infile: ["pyproject.toml"] for infile in template_files() if infile.endswith(".py")}


def expected_files(combo: dict, package: str = "ddp_project") -> set[str]:
    """The exact file set of a rendered project, written out independently of the hooks."""
    files = {
        ".cookiecutter.json",
        ".gitignore",
        ".pre-commit-config.yaml",
        "LICENSE",
        "Makefile",
        "README.md",
        "pyproject.toml",
        "configs/default.yaml",
        "launch/torchrun.sh",
        "tests/__init__.py",
        "tests/conftest.py",
        "tests/helpers.py",
        "tests/tasks.py",
        "benchmarks/allreduce.py",
        "benchmarks/overhead.py",
        "benchmarks/checkpoint_stall.py",
        "benchmarks/gpu_check.py",
    }
    tests = {
        "task": ["amp", "async_checkpoint", "async_checkpoint_faults", "best", "checkpoint"],
        "machinery": ["agreement", "background_save", "benchmarks", "config", "contract"],
    }
    tests["task"] += ["checkpoint_faults", "ddp_options", "distributed", "divergence", "ema"]
    tests["task"] += ["gpu", "gradients", "loss_normalisation", "object_store", "parent_death"]
    tests["task"] += ["ranks", "restart", "resume", "resume_checks", "sharding", "slow_rank"]
    tests["task"] += ["stop_signal", "timeouts", "trainer", "weights", "worker_faults"]
    tests["machinery"] += ["data", "debug_output", "dependencies", "distributed_env"]
    tests["machinery"] += ["divergence_guard", "doctor", "loader_workers"]
    tests["machinery"] += ["flight_recorder", "gpu_check"]
    tests["machinery"] += ["launch", "nccl_log", "network", "plot", "moved_modules", "run_lock"]
    tests["machinery"] += ["storage"]
    tests["machinery"] += ["optimizer", "stragglers", "throughput"]
    for folder, names in tests.items():
        files.add(f"tests/{folder}/__init__.py")
        files |= {f"tests/{folder}/test_{name}.py" for name in names}
    files.add("tests/example/__init__.py")
    modules = ["__init__", "cli", "contract", "dependencies", "doctor", "errors", "launch"]
    modules += ["plot", "task", "train"]
    modules += ["checkpointing/__init__", "cluster/__init__", "faults/__init__"]
    modules += ["config/__init__", "config/loader", "config/schema"]
    modules += ["loading/__init__", "monitoring/__init__", "training/__init__"]
    modules += [f"checkpointing/{name}" for name in ("background_save", "best", "checkpoint")]
    modules += ["checkpointing/checkpointer"]
    modules += [f"checkpointing/{name}" for name in ("layout", "newest_intact", "retention")]
    modules += [f"checkpointing/{name}" for name in ("resume", "run_lock", "storage", "weights")]
    modules += [f"cluster/{name}" for name in ("agent", "agreement", "debug_output")]
    modules += [f"cluster/{name}" for name in ("distributed", "nccl_log", "network")]
    modules += [f"faults/{name}" for name in ("flight_recorder", "parent_watch", "signals")]
    modules += [f"faults/{name}" for name in ("stopping", "watchdog")]
    modules += ["loading/data", "loading/workers"]
    modules += [f"monitoring/{name}" for name in ("logs", "metrics", "profiling", "stragglers")]
    modules += ["monitoring/throughput"]
    modules += [f"training/{name}" for name in ("divergence", "lazy", "losses", "optimizer")]
    modules += [f"training/{name}" for name in ("replicas", "rng", "trainer", "updates")]
    files |= {f"src/{package}/{name}.py" for name in modules}
    if combo["use_slurm"]:
        files.add("launch/slurm/train.sbatch")
    if combo["use_docker"]:
        files |= {"Dockerfile", ".dockerignore", "apptainer.def"}
    if combo["tracker"] != "none":
        files |= {f"src/{package}/monitoring/tracker.py", "tests/machinery/test_tracker.py"}
    if combo["example"] == "gpt":
        files |= {f"src/{package}/{name}.py" for name in ("gpt", "prepare", "loading/shards")}
        files |= {f"tests/machinery/test_{name}.py" for name in ("prepare", "shards")}
        files.add("tests/example/test_gpt.py")
        files.add("benchmarks/shards.py")
        files |= {"configs/gpt-small.yaml", "configs/gpt2-124m.yaml"}
    if combo["example"] == "classifier":
        files.add("tests/example/test_classifier.py")
    if combo["ci"] == "github":
        files |= {".github/workflows/ci.yml", ".github/dependabot.yml"}
    if combo["ci"] == "gitlab":
        files |= {".gitlab-ci.yml", "renovate.json"}
    return files


def tool(name: str) -> str:
    """A linter from the test environment (requirements-test.txt)."""
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: pip install -r requirements-test.txt")
    return str(path)


def run_tool(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


APPTAINER_SECTIONS = {"help", "labels", "files", "post", "environment", "runscript", "test"}


def parse_definition(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """An Apptainer definition file: its header (key: value) and its %sections' lines."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("%"):
            current = sections.setdefault(stripped[1:].split()[0], [])
        elif current is not None:
            if stripped and not stripped.startswith("#"):
                current.append(stripped)
        elif stripped and not stripped.startswith("#"):
            key, _, value = stripped.partition(":")
            header[key.strip()] = value.strip()
    return header, sections


def assert_apptainer_definition_builds_from_the_dockerfile_image(
    definition: str, dockerfile: str, files: set[str]
) -> None:
    """No Apptainer linter installs here: check the header, the sections and that every path
    copied into the image is one of the project's `files` or a directory of them."""
    header, sections = parse_definition(definition)
    image = re.search(r"^FROM (\S+)", dockerfile, re.MULTILINE)
    assert header == {"Bootstrap": "docker", "From": image.group(1)}
    assert {"files", "post", "runscript"} <= set(sections) <= APPTAINER_SECTIONS
    for line in sections["files"]:
        source = line.split()[0]
        assert any(path == source or path.startswith(f"{source}/") for path in files), line


#: The CI services' files and the schemas they validate against.
CI_SCHEMAS = {
    ".github/workflows/ci.yml": "vendor.github-workflows",
    ".gitlab-ci.yml": "vendor.gitlab-ci",
}


def test_matrix_covers_every_value_and_leaves_out_the_refused_combinations() -> None:
    combos = valid_combinations()
    for name, values in CHOICES.items():
        assert {combo[name] for combo in combos} == set(values), name
    assert 0 < len(combos) < math.prod(len(values) for values in CHOICES.values())


# The scan for the options a file reads: it finds every read, and gives up (every option)
# wherever it cannot tell.


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("{{ cookiecutter.license }}", {"license"}),
        ("{{ cookiecutter['license'] }}", {"license"}),
        ("{% if cookiecutter.ci == 'github' %}x{% endif %}", {"ci"}),
        (
            "{{ cookiecutter.project_name | python_string(cookiecutter.tracker) }}",
            {"project_name", "tracker"},
        ),
        ("{% set t = cookiecutter.tracker %}{% for x in [t] %}{{ x }}{% endfor %}", {"tracker"}),
        ("{% macro m() %}{{ cookiecutter.use_docker }}{% endmacro %}{{ m() }}", {"use_docker"}),
        ("{{ '{{ cookiecutter.license }}' }} plain text cookiecutter.ci", set()),
        ("src/{{cookiecutter.package_name}}/monitoring/tracker.py", {"package_name"}),
    ],
)
def test_scan_finds_every_variable_a_template_reads(source: str, found: set[str]) -> None:
    assert references(source) == found


@pytest.mark.parametrize(
    "source",
    [
        "{{ cookiecutter | tojson }}",
        "{% for key, value in cookiecutter.items() %}{{ value }}{% endfor %}",
        "{{ cookiecutter[name] }}",
        "{{ cookiecutter.get('license') }}",
        "{% set c = cookiecutter %}{{ c.license }}",
        "{{ _cookiecutter.license }}",
        "{{ license }}",
        "{% include 'other.txt' %}",
        "{% import 'macros.txt' as macros %}",
        "{% extends 'base.txt' %}",
    ],
)
def test_scan_gives_up_on_reads_it_cannot_pin_down(source: str) -> None:
    """None: the file then depends on every option."""
    assert references(source) is None


def test_a_derived_variable_depends_on_what_its_default_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(
        variants.CONTEXT, "image", "{{ cookiecutter.license }}-{{ cookiecutter.ci }}"
    )
    monkeypatch.setitem(variants.CONTEXT, "tag", "{{ cookiecutter.image | lower }}")
    variants.variable_dependencies.cache_clear()
    try:
        assert variants.variable_dependencies("tag") == {"license", "ci"}
    finally:
        variants.variable_dependencies.cache_clear()


def test_a_file_that_reads_the_whole_context_depends_on_every_option() -> None:
    assert dependencies(".cookiecutter.json") == ALL_OPTIONS


def test_every_file_renders_alike_whatever_the_options_it_does_not_read() -> None:
    """The scan, tried against the renders: from the default combination, changing any one
    option that a file does not read to any other value leaves the file unchanged."""
    env = variants.environment()
    default_files = kept_files(DEFAULTS)
    for infile in default_files:
        if variants.is_binary(str(variants.TEMPLATE / infile)):
            continue
        template = env.get_template(infile)
        expected = template.render(**context_for(DEFAULTS))
        for name in sorted(ALL_OPTIONS - dependencies(infile)):
            for value in CHOICES[name]:
                combo = {**DEFAULTS, name: value}
                if not is_refused(combo) and infile in kept_files(combo):
                    assert template.render(**context_for(combo)) == expected, (infile, name, value)


# Every combination, through the variants of its files: one worker renders them once.


@pytest.fixture(scope="session")
def forest(tmp_path_factory: pytest.TempPathFactory) -> Forest:
    return grow_forest(tmp_path_factory.mktemp("variants"), COMPANIONS)


def variants_with_suffix(forest: Forest, *suffixes: str) -> list[Path]:
    return [path for path in forest.files() if path.suffix in suffixes]


every_combination = pytest.mark.xdist_group("variants")


@every_combination
def test_every_variant_has_no_leftover_jinja(forest: Forest) -> None:
    leftovers = [
        forest.describe(path)
        for path in forest.files()
        if not variants.is_binary(str(path)) and _has_leftover_jinja(path.read_text())
    ]
    assert not leftovers


@cache
def _has_leftover_jinja(text: str) -> bool:
    """Cached by text: most variants of a file differ only in the files rendered beside them."""
    return any(mark in text for mark in LEFTOVER_JINJA)


@every_combination
def test_every_python_variant_compiles(forest: Forest) -> None:
    """Each distinct text once: most variants of a file differ only in the pyproject.toml
    rendered beside them."""
    parsed: set[str] = set()
    for path in variants_with_suffix(forest, ".py"):
        text = path.read_text()
        if text in parsed:
            continue
        parsed.add(text)
        try:
            ast.parse(text, filename=str(path))
        except SyntaxError as error:
            pytest.fail(f"{forest.describe(path)}: {error}")


@every_combination
def test_every_data_file_variant_parses(forest: Forest) -> None:
    """YAML, TOML and JSON files all load."""
    loaders = {".yaml": yaml.safe_load, ".yml": yaml.safe_load, ".toml": tomllib.loads}
    for path in variants_with_suffix(forest, ".yaml", ".yml", ".toml", ".json"):
        try:
            loaders.get(path.suffix, json.loads)(path.read_text())
        except ValueError as error:  # each parser's errors are ValueErrors
            pytest.fail(f"{forest.describe(path)}: {error}")


@every_combination
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_every_python_variant_passes_ruff(forest: Forest, command: list[str]) -> None:
    """Each file as its project's ruff configuration (the pyproject.toml beside it, rendered
    for the same options) checks and formats it: one ruff run over every variant."""
    result = run_tool(
        [tool("ruff"), *command, "--no-cache", "--output-format=concise", "."], cwd=forest.root
    )
    assert result.returncode == 0, forest.explain(result.stdout + result.stderr)


@every_combination
def test_every_shell_script_variant_passes_bash_and_shellcheck(forest: Forest) -> None:
    scripts = variants_with_suffix(forest, ".sh", ".sbatch")
    assert scripts
    for path in scripts:
        result = run_tool(["bash", "-n", str(path)])
        assert result.returncode == 0, forest.explain(result.stderr)
    result = run_tool([tool("shellcheck"), *map(str, scripts)])
    assert result.returncode == 0, forest.explain(result.stdout + result.stderr)


@every_combination
def test_every_dockerfile_variant_passes_hadolint(forest: Forest) -> None:
    dockerfiles = [path for path in forest.files() if path.name == "Dockerfile"]
    assert dockerfiles
    result = run_tool([tool("hadolint"), *map(str, dockerfiles)])
    assert result.returncode == 0, forest.explain(result.stdout + result.stderr)


@every_combination
@pytest.mark.parametrize("ci_file", CI_SCHEMAS)
def test_every_ci_variant_matches_its_schema(forest: Forest, ci_file: str) -> None:
    """GitHub and GitLab files validate against the services' published schemas."""
    files = [path for path in forest.files() if str(path).endswith(f"/{ci_file}")]
    assert files
    command = [tool("check-jsonschema"), "--builtin-schema", CI_SCHEMAS[ci_file]]
    result = run_tool([*command, *map(str, files)])
    assert result.returncode == 0, forest.explain(result.stdout + result.stderr)


@every_combination
def test_every_combination_records_every_answer(forest: Forest) -> None:
    """Each option given arrives in the project's recorded answers (no silent typo)."""
    for combo in forest.combos:
        recorded = json.loads(forest.path(".cookiecutter.json", combo).read_text())
        answers = recorded["cookiecutter"]
        assert {key: answers[key] for key in combo} == combo


def test_every_combination_has_exactly_the_expected_files() -> None:
    """The post-generation hook's table keeps the files that `expected_files` lists."""
    for combo in valid_combinations():
        assert set(kept_files(combo).values()) == expected_files(combo), combo_id(combo)


@every_combination
def test_every_combination_builds_its_apptainer_image_from_its_dockerfile_image(
    forest: Forest,
) -> None:
    for combo in forest.combos:
        files = kept_files(combo)
        if "apptainer.def" not in files:
            assert "Dockerfile" not in files
            continue
        assert_apptainer_definition_builds_from_the_dockerfile_image(
            forest.path("apptainer.def", combo).read_text(),
            forest.path("Dockerfile", combo).read_text(),
            set(files.values()),
        )


# The package's imports: no module imports one that imports it back, in any combination.


#: The package's modules, as template files.
PACKAGE_FILES = [
    name for name in template_files() if name.startswith("src/") and name.endswith(".py")
]


def package_combinations() -> list[dict]:
    """A valid combination for each distinct value of the options the package's files read."""
    options = frozenset().union(*map(dependencies, PACKAGE_FILES))
    first: dict[tuple, dict] = {}
    for combo in valid_combinations():
        first.setdefault(option_key(combo, options), combo)
    return list(first.values())


def imports_that_run(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module, at its top or in its functions; not those under
    `if TYPE_CHECKING:`, which only a type checker reads."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            children = node.orelse
        else:
            children = [node]
        for child in children:
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            found += imports_that_run(child)
    return found


@cache
def imported_names(source: str, package: str) -> frozenset[str]:
    """What a module of `package` imports, by absolute name: `from .x import y` gives x.y,
    which is a module or a name in module x. Cached by text: few files differ by option."""
    names: set[str] = set()
    for node in imports_that_run(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            parents = package.split(".")[: package.count(".") + 2 - node.level]
            base = ".".join([*parents, base] if base else parents)
        names |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return frozenset(names)


def with_packages_above(module: str) -> set[str]:
    """`module` and the packages that importing it imports first: a.b.c -> a, a.b, a.b.c."""
    parts = module.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts) + 1)}


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of the package that importing it runs: those it imports and the
    packages above them, but for its own packages, which are being imported already.
    `sources`: each file's text by its path under src/ (`pkg/sub/__init__.py`)."""
    modules = {}
    for path, source in sources.items():
        parts = Path(path).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules[name] = (source, name if is_package else name.rpartition(".")[0])
    return {
        name: {
            reached
            for imported in imported_names(source, package)
            for reached in with_packages_above(imported)
            if reached in modules
        }
        - with_packages_above(name)
        for name, (source, package) in modules.items()
    }


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of imports as the modules along it, the first again at the end; [] if none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(graph[module]):
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return []

    return next(filter(None, map(visit, sorted(graph))), [])


def test_the_import_graph_finds_a_cycle_through_a_function_and_a_package() -> None:
    """A function-level import is a cycle as much as a top-level one (a lazy import only hides
    it), and importing a.b.c runs a/b/__init__.py first."""
    sources = {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from . import leaf\n",
        "pkg/sub/leaf.py": "x = 1\n",
        "pkg/sub/other.py": "from ..late import f\n",
        "pkg/user.py": "from .sub.leaf import x\n",
        "pkg/late.py": "def f():\n    from . import user\n",
    }
    assert import_cycle(import_graph(sources)) == []
    sources["pkg/sub/__init__.py"] = "from . import leaf, other\n"
    cycle = ["pkg.late", "pkg.user", "pkg.sub", "pkg.sub.other", "pkg.late"]
    assert import_cycle(import_graph(sources)) == cycle


def test_no_module_of_the_package_imports_one_that_imports_it_back() -> None:
    """Each module has one job and the jobs have a direction: task.py imports the machinery it
    needs, and the machinery never needs what imports task.py. For each distinct set of the
    package's files."""
    texts: dict[tuple, str] = {}  # each file once per value of the options it reads
    for combo in package_combinations():
        sources = {}
        for infile, path in kept_files(combo).items():
            if infile in PACKAGE_FILES:
                variant = (infile, option_key(combo, dependencies(infile)))
                if variant not in texts:
                    texts[variant] = variants.render_text(infile, combo)
                sources[path.removeprefix("src/")] = texts[variant]
        cycle = import_cycle(import_graph(sources))
        assert not cycle, f"{combo_id(combo)}: " + " -> ".join(cycle)


# Whole projects: a pairwise cover of the options, rendered by cookiecutter.


@pytest.fixture(scope="session")
def render_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("renders")


@cache
def _render(root: Path, key: str) -> Path:
    combo = json.loads(key)
    out = root / hashlib.sha1(key.encode()).hexdigest()[:12]
    return Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(out), extra_context=combo))


def render(root: Path, combo: dict) -> Path:
    """Render once per combination and session; the tests below all read the same render."""
    return _render(root, json.dumps(combo, sort_keys=True))


def project_files(project: Path) -> set[str]:
    return {str(path.relative_to(project)) for path in project.rglob("*") if path.is_file()}


#: (command, content digest) pairs that passed: identical content is linted once per session.
_LINT_PASSED: set[tuple[str, ...]] = set()


def lint_once(command: list[str], path: Path) -> None:
    """Run a linter on one file unless identical content already passed the same command."""
    key = (*command, hashlib.sha1(path.read_bytes()).hexdigest())
    if key in _LINT_PASSED:
        return
    result = run_tool([*command, str(path)])
    assert result.returncode == 0, f"{command[0]} {path.name}:\n{result.stdout}{result.stderr}"
    _LINT_PASSED.add(key)


# One xdist group per combination: under `pytest -n`, a combination's checks share one render.
COVER = [
    pytest.param(combo, id=combo_id(combo), marks=pytest.mark.xdist_group(combo_id(combo)))
    for combo in pairwise_cover()
]


@pytest.mark.parametrize("combo", COVER)
class TestPairwiseCoverRendersWhole:
    def test_records_every_answer(self, render_root: Path, combo: dict) -> None:
        project = render(render_root, combo)
        answers = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]
        assert {key: answers[key] for key in combo} == combo

    def test_has_exactly_the_expected_files(self, render_root: Path, combo: dict) -> None:
        assert project_files(render(render_root, combo)) == expected_files(combo)

    def test_every_file_is_rendered_as_its_variant_is(
        self, render_root: Path, combo: dict, tmp_path: Path
    ) -> None:
        """The variants' renderer writes what cookiecutter writes, byte for byte and mode."""
        project = render(render_root, combo)
        for infile, path in kept_files(combo).items():
            variant = render_file(infile, context_for(combo), tmp_path)
            assert variant.read_bytes() == (project / path).read_bytes(), path
            assert variant.stat().st_mode == (project / path).stat().st_mode, path

    def test_has_no_leftover_jinja(self, render_root: Path, combo: dict) -> None:
        for path in render(render_root, combo).rglob("*"):
            if path.is_file():
                text = path.read_text()
                assert not [mark for mark in LEFTOVER_JINJA if mark in text], path

    def test_python_compiles(self, render_root: Path, combo: dict) -> None:
        for path in render(render_root, combo).rglob("*.py"):
            ast.parse(path.read_text(), filename=str(path))

    def test_passes_ruff_check_and_format(self, render_root: Path, combo: dict) -> None:
        """The project is formatted exactly as its own ruff configuration formats it."""
        project = render(render_root, combo)
        for command in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
            result = run_tool([tool("ruff"), *command, "."], cwd=project)
            assert result.returncode == 0, result.stdout + result.stderr

    def test_shell_scripts_pass_shellcheck(self, render_root: Path, combo: dict) -> None:
        project = render(render_root, combo)
        for path in [*project.rglob("*.sh"), *project.rglob("*.sbatch")]:
            lint_once([tool("shellcheck")], path)

    def test_dockerfile_passes_hadolint(self, render_root: Path, combo: dict) -> None:
        dockerfile = render(render_root, combo) / "Dockerfile"
        if combo["use_docker"]:
            lint_once([tool("hadolint")], dockerfile)
        else:
            assert not dockerfile.exists()

    def test_apptainer_definition_builds_from_the_dockerfile_image(
        self, render_root: Path, combo: dict
    ) -> None:
        project = render(render_root, combo)
        if not combo["use_docker"]:
            assert not (project / "apptainer.def").exists()
            return
        assert_apptainer_definition_builds_from_the_dockerfile_image(
            (project / "apptainer.def").read_text(),
            (project / "Dockerfile").read_text(),
            project_files(project),
        )

    def test_ci_configuration_matches_its_schema(self, render_root: Path, combo: dict) -> None:
        project = render(render_root, combo)
        for path, schema in CI_SCHEMAS.items():
            if (project / path).exists():
                lint_once([tool("check-jsonschema"), "--builtin-schema", schema], project / path)
