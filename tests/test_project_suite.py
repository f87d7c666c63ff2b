"""Rendered projects pass their own test suites, including real 2-process gloo training.

Only some options change what a project's suite does: those read by its Python files (its
package, its tests, its benchmarks) and by the configs its tests load. `SUITE_OPTIONS` finds
them by the scan of tests/variants.py; the other options change files (launchers, containers,
CI, license, metadata) that the render tests and the launcher tests check. So:

- The default project, installed into the test environment as a user installs it, runs its
  whole suite: its machinery's and its example's tests here; the fault tests (crashes, hangs
  and restarts under torchrun, up to a minute each) beside them from a source tree, so that the
  halves can share the workers; and the rest of tests/task in tests/test_update.py, in the
  default project made at the newest release with its owner's changes and updated to this
  template (checked there to be this template's render with those changes, file by file).
- Every value of the options that the shared test helpers read (tests/helpers.py and the
  like, and task.py: the model and data every multi-process test trains, today the example
  task) runs the whole suite but the fault tests, the tests of tasks of their own and the
  multi-process tests of mechanisms no task changes (TASK_INDEPENDENT), in a project of its own
  after the default one.
- Every pair of values of the suite options (a pairwise cover, completing the projects above) runs
  the 2-process training test, which trains and checkpoints with the pair's model, precision and
  tracker under torchrun (the second launch that resumes it runs in the projects above, with each
  model; each precision's and each tracker's resume is tested by the tests that set them:
  test_checkpoint.py's fp16 scaler, test_tracker.py's resumed runs), and each test module that an
  option changes or removes (OPTION_TESTS: the config's, the tracker's, the GPT example's, ...)
  where the pair holds a variant of it that no project above ran. A test module's variant is the
  values of the options that its text reads and that the code it is named for reads (test_config.py:
  the config package, which the precision and the tracker change), so each variant of each test
  module runs once, its multi-process tests included. Two options meet in the config (test_config.py
  runs for each pair of precision and tracker) and in training (the 2-rank test). The other tests
  read no option, and neither does the code they are named for: they set the precision they check
  themselves (test_amp.py, test_trainer.py), and the tracker is test_tracker.py's; the projects
  above run them with every model.

The fault tests exercise code that no option changes (test_restart.py and test_timeouts.py read
no option; a test checks it), so the default options run them once; so do the tests that train
tasks of their own (marked `own_tasks`: test_contract.py and test_loss_normalisation.py, whose
tasks read no option and set the precision they test), and the tests of modules that no option
and no task changes (marked `standalone`: storage).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter
from matrix import DEFAULTS, ROOT, combo_id, cover
from variants import (
    dependencies,
    kept_files,
    render_text,
    representatives,
    sometimes_absent,
    template_files,
)

#: Multi-process tests of mechanisms that no task changes: how the ranks agree to stop (on a
#: signal, or early on a scripted evaluation), how a bad setting ends every rank, how the
#: shipped config's batch splits over 8 ranks, which rank writes which file, how the ranks
#: agree on a damaged checkpoint, a diverged replica or an inf gradient they were handed, how a
#: starved rank and a slow one are named, how a background save waits for the one in flight,
#: and the all-reduce and checkpoint-stall benchmarks, which train nothing of the task's. The
#: default project runs them; projects of other tasks (the other example,
#: tests/test_user_tasks.py) deselect them.
TASK_INDEPENDENT = [
    "tests/task/test_stop_signal.py",
    "tests/task/test_best.py",
    "tests/task/test_distributed.py::test_eight_ranks_train_the_default_config_unchanged",
    "tests/task/test_distributed.py::test_failing_rank_ends_the_job_with_an_error",
    "tests/task/test_ranks.py::test_each_log_file_has_one_writer",
    "tests/task/test_ranks.py::test_train_log_holds_rank_zero_lines_only",
    "tests/task/test_ranks.py::test_a_warning_goes_to_the_rank_s_own_file",
    "tests/task/test_ranks.py::test_replica_check_catches_a_diverged_rank",
    "tests/task/test_ranks.py::test_only_rank_zero_writes_replicated_files",
    "tests/task/test_checkpoint.py::test_ranks_agree_on_the_fallback_when_only_one_rank_cannot_load_its_file",
    "tests/task/test_amp.py::test_inf_gradient_on_one_rank_skips_the_step_on_every_rank",
    "tests/machinery/test_throughput.py::test_a_rank_starved_for_data_is_named_in_the_log",
    "tests/task/test_slow_rank.py",
    "tests/machinery/test_benchmarks.py::test_allreduce_reports_bus_bandwidth_as_nccl_tests_define_it",
    "tests/machinery/test_benchmarks.py::test_checkpoint_stall_reports_the_pause_of_both_kinds_of_save_and_their_ratio",
    "tests/task/test_async_checkpoint.py::test_the_next_background_save_waits_for_the_one_in_flight_and_collectives_do_not_mix",
]
#: Tests of TASK_INDEPENDENT that read the task's form all the same: the names a task with
#: updates logs its loss under, the micro-batch of a whole-batch loss, the split of a step into
#: micro-batches, a loss that exchanges data between ranks (where a slow rank keeps the others
#: waiting). The recipes of those forms run them (tests/test_user_tasks.py).
READ_THE_TASK_FORM = [
    "tests/task/test_distributed.py::test_failing_rank_ends_the_job_with_an_error",
    "tests/task/test_amp.py::test_inf_gradient_on_one_rank_skips_the_step_on_every_rank",
    "tests/task/test_slow_rank.py",
]
#: What a project of another task runs: the suite but the fault tests, the tests that train
#: tasks of their own (own_tasks), those of modules no task changes (standalone) and the
#: task-independent mechanisms, which the default project ran.
OTHER_TASK_SELECTION = [
    "-m",
    "not faults and not own_tasks and not standalone",
    *(f"--deselect={node}" for node in TASK_INDEPENDENT),
]
TWO_RANK_TEST = "test_two_ranks_train_and_checkpoint"
TWO_RANK_NODE = f"tests/task/test_distributed.py::{TWO_RANK_TEST}"
TWO_RANK_RESUME_TEST = "test_a_second_launch_resumes_the_two_ranks_and_the_loss_falls"
#: The files that decide what the project's suite does: every Python file (code, tests,
#: benchmarks) and the configs the tests load.
SUITE_FILES = [
    infile for infile in template_files() if infile.endswith(".py") or infile.startswith("configs/")
]
SUITE_OPTIONS = frozenset().union(*map(dependencies, SUITE_FILES))
TEST_MODULES = [
    infile
    for infile in template_files()
    if infile.startswith("tests/") and Path(infile).name.startswith("test_")
]


def code_options() -> dict[str, frozenset[str]]:
    """Each module and package of the project's code, by name (config, tracker, task, ...),
    with the options its files read."""
    read: dict[str, frozenset[str]] = {}
    for infile in SUITE_FILES:
        if infile.startswith("src/"):
            for part in Path(infile).parts[2:]:
                name = part.removesuffix(".py")
                read[name] = read.get(name, frozenset()) | dependencies(infile)
    return read


CODE_OPTIONS = code_options()


def module_options(infile: str) -> frozenset[str]:
    """The options a test module's tests depend on: those its text reads, and those of the code
    it is named for (test_config.py tests the config package, test_tracker.py tracker.py)."""
    return dependencies(infile) | CODE_OPTIONS.get(
        Path(infile).stem.removeprefix("test_"), frozenset()
    )


#: The test modules that an option changes or removes: the pairs run them where they hold a
#: variant of them that no project before them ran.
OPTION_TESTS = [
    infile for infile in TEST_MODULES if module_options(infile) or infile in sometimes_absent()
]
#: The test modules that are no tests (helpers, fixtures), and the task that every test trains
#: (the helpers take its test_settings): what they read changes every test.
SHARED_TEST_FILES = [
    infile
    for infile in SUITE_FILES
    if infile.startswith("tests/") and not Path(infile).name.startswith("test_")
] + ["src/{{cookiecutter.package_name}}/task.py"]
EACH_VALUE = cover(1, frozenset().union(*map(dependencies, SHARED_TEST_FILES)))
PAIRS = cover(2, SUITE_OPTIONS, start=EACH_VALUE)[len(EACH_VALUE) :]


def first_variants(projects: list[dict]) -> list[list[str]]:
    """For each project in order, the option test modules it holds in a variant (the values of
    the options in `module_options`) that no project before it held."""
    held: set[tuple] = set()
    firsts = []
    for combo in projects:
        kept = kept_files(combo)
        variants = {
            infile: (infile, *(combo[option] for option in sorted(module_options(infile))))
            for infile in OPTION_TESTS
            if infile in kept
        }
        firsts.append([infile for infile, variant in variants.items() if variant not in held])
        held |= set(variants.values())
    return firsts


#: The option test modules that each pair runs.
PAIR_OPTION_TESTS = first_variants([*EACH_VALUE, *PAIRS])[len(EACH_VALUE) :]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def run_project_suite(
    project: Path, env: dict[str, str], *options: str, python: Path | None = None
) -> dict[str, ET.Element]:
    """Run the project's pytest (with `python`, else this one); fail with its output unless it
    passes. Returns its test cases."""
    report = project / "report.xml"
    pytest_command = ["-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    result = subprocess.run(
        [str(python or sys.executable), *pytest_command, *options],
        cwd=project,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "WANDB_MODE": "offline",
            # One MLflow store for the suite (its own tests check the default store): each
            # fresh SQLite store costs a second of migrations.
            "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow-suite.db'}",
            **env,
        },
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    return {case.get("name"): case for case in ET.parse(report).iter("testcase")}


def assert_two_ranks_ran(cases: dict[str, ET.Element], *names: str) -> None:
    for name in (TWO_RANK_TEST, *names):
        two_rank = cases[name]
        assert two_rank.find("skipped") is None and two_rank.find("failure") is None, name


def assert_whole_suite_ran(cases: dict[str, ET.Element]) -> None:
    """The 2-process gloo tests really ran (a launch, and a second that resumes it), and the
    NCCL tests were collected (skipped on CPU)."""
    assert_two_ranks_ran(cases, TWO_RANK_RESUME_TEST)
    assert any("gpu" in name for name in cases), "the NCCL tests must be collected"


def render_from_source(combo: dict, name: str, out: Path) -> tuple[Path, dict[str, str]]:
    """Render a project under a package name of its own (no installed project can shadow it),
    to run from its source tree; returns it and the environment that imports it."""
    context = {**combo, "project_name": name}
    project = Path(
        cookiecutter(str(ROOT), no_input=True, output_dir=str(out), extra_context=context)
    )
    return project, {"PYTHONPATH": str(project / "src")}


def test_the_suite_options_leave_the_pytest_settings_alone() -> None:
    """pyproject.toml is no suite file, for the options it reads do not touch its pytest
    settings."""
    settings = [
        tomllib.loads(render_text("pyproject.toml", combo))["tool"]["pytest"]
        for combo in representatives("pyproject.toml")
    ]
    assert all(each == settings[0] for each in settings)


def marked(marker: str) -> list[str]:
    """The test modules that use `pytest.mark.<marker>`."""
    project = ROOT / "{{cookiecutter.__project_dir}}"
    return [
        infile
        for infile in TEST_MODULES
        if f"pytest.mark.{marker}" in (project / infile).read_text()
    ]


@pytest.mark.parametrize(
    ("marker", "example"),
    [("faults", "tests/task/test_restart.py"), ("standalone", "tests/machinery/test_storage.py")],
)
def test_the_tests_run_once_read_no_option(marker: str, example: str) -> None:
    """So that the default project alone runs them."""
    modules = marked(marker)
    assert example in modules
    assert not frozenset().union(*map(module_options, modules))


def test_a_test_module_is_changed_by_the_options_of_the_code_it_is_named_for() -> None:
    """test_config.py reads no option, but the config package it tests reads the precision and
    the tracker: the pairs run it for each of their values."""
    assert not dependencies("tests/machinery/test_config.py")
    assert module_options("tests/machinery/test_config.py") >= {"mixed_precision", "tracker"}
    assert "tests/machinery/test_config.py" in OPTION_TESTS


def test_the_task_independent_tests_exist() -> None:
    """A renamed test would make its --deselect a silent no-op."""
    assert set(READ_THE_TASK_FORM) <= set(TASK_INDEPENDENT)
    for node in TASK_INDEPENDENT:
        path, _, name = node.partition("::")
        text = (ROOT / "{{cookiecutter.__project_dir}}" / path).read_text()
        assert not name or f"def {name}(" in text, node


def test_the_tests_of_tasks_of_their_own_read_no_option() -> None:
    """So that the default project alone runs them (tests/tasks.py holds their tasks)."""
    own_tasks = [
        "tests/machinery/test_contract.py",
        "tests/task/test_loss_normalisation.py",
        "tests/tasks.py",
    ]
    assert not frozenset().union(*map(module_options, own_tasks))


@pytest.fixture(scope="module")
def installed_default_project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Render the default project and install it (editable, no downloads); uninstall afterwards."""
    out = tmp_path_factory.mktemp("default")
    project = Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(out)))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "-e", str(project)], check=True)
    yield project
    uninstall = [sys.executable, "-m", "pip", "uninstall", "--quiet", "--yes", project.name]
    subprocess.run(uninstall, check=True)


def test_default_project_machinery_and_example_tests_pass(installed_default_project: Path) -> None:
    """Its tests/task run in the project updated from the newest release (test_update.py)."""
    folders = ["tests/machinery", "tests/example"]
    cases = run_project_suite(installed_default_project, {}, *folders, "-m", "not faults")
    ran = {case.get("classname", "").rsplit(".", 1)[0] for case in cases.values()}
    assert {"tests.machinery", "tests.example"} <= ran


def test_default_project_fault_tests_pass(tmp_path: Path) -> None:
    project, env = render_from_source(DEFAULTS, "Default Faults", tmp_path)
    cases = run_project_suite(project, env, "-m", "faults")
    assert cases, "the fault tests must be collected"


@pytest.mark.parametrize("combo", EACH_VALUE[1:], ids=combo_id)
def test_project_suite_passes_for_every_value_of_the_options_the_test_helpers_read(
    combo: dict, tmp_path: Path
) -> None:
    project, env = render_from_source(combo, f"Value {EACH_VALUE.index(combo)}", tmp_path)
    assert_whole_suite_ran(run_project_suite(project, env, *OTHER_TASK_SELECTION))


@pytest.mark.parametrize("combo", PAIRS, ids=combo_id)
def test_single_process_and_option_tests_and_two_rank_training_pass_for_every_pair_of_values(
    combo: dict, tmp_path: Path
) -> None:
    index = PAIRS.index(combo)
    project, env = render_from_source(combo, f"Pair {index + 1}", tmp_path)
    files = kept_files(combo)
    modules = [files[infile] for infile in PAIR_OPTION_TESTS[index]]
    cases = run_project_suite(project, env, TWO_RANK_NODE, *modules)
    assert_two_ranks_ran(cases)
    ran = {case.get("classname") for case in cases.values()}
    assert {module.removesuffix(".py").replace("/", ".") for module in modules} <= ran
