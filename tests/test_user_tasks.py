"""A rendered project serves tasks written as users write them, with nothing else changed.

Each task of tests/user_tasks/ replaces the default project's task.py: what
docs/bring-your-own-model.md tells users to edit. The example's own test module goes with the
example, as a user replacing it would delete it; every other generated test stays as rendered
and trains the user's task (its test_settings). Two of them are projects of before 1.0, whose
TaskConfig lived in config.py (user_tasks/*_config.py): the test moves it into task.py by the
steps of the CHANGELOG (since 1.0 the config is the package config/, and Python would ignore a
config.py left beside it).

The task suite of a recipe (RECIPE_SUITE) is the generated tests/task but the fault tests and
the multi-process tests of mechanisms no task changes (test_project_suite.TASK_INDEPENDENT),
which the default project runs, save those that read the task's form
(test_project_suite.READ_THE_TASK_FORM: the names a task with updates logs, the micro-batch of
a whole-batch loss, a loss that exchanges data between ranks, the split of a step's batch). A
recipe of the default task's form (one update, a loss of each micro-batch alone that exchanges
nothing) runs, of the task suite, the tests of what a model and its optimizer change
(MODEL_TESTS): gradients equal to one process's, checkpoints that resume bitwise, an export
that loads. Their data path is the default task's or the token task's, which run the whole
task suite. Both recipes pass the whole of it too (about a minute each on 2 loaded cores, a
transformers import per process for the GPT-2): the template's suite runs what they change.

- token_task.py (dict batches padded by a collate, a (sum, count) loss over real tokens,
  throughput in real tokens, named parameter groups, tied weights, metrics with their own
  counts, task state in checkpoints) runs the task suite and the machinery tests that read
  the task: its settings (TaskConfig) and its throughput units.
- cnn_task.py (NumPy augmentation with the global generator, BatchNorm, tuple batches, a class
  that does not derive from TaskBase) runs the task suite and the throughput tests, which
  read the members it lacks through the contract's defaults: 2 gloo ranks train, crash and
  resume bitwise, and resume on 1 and 4 ranks, among the rest.
- sgd_task.py (an optimizer and a schedule of its own: SGD with Nesterov momentum, group
  options of SGD's, a step-decay factor per step) runs the model tests: 2 ranks, accumulation
  and 1 rank make the same updates in float64, a crash resumes bitwise with the momentum
  buffers and the schedule's step, a run resumes on 1 and 4 ranks, the export loads.
- hf_gpt2_task.py (a Hugging Face GPT2LMHeadModel from a tiny GPT2Config, no download) runs
  the model tests, then a single-process epoch whose throughput adds up to its real tokens.
- gan_task.py (a GAN with alternating updates: `Task.updates`, the discriminator's step then the
  generator's, each with its own Adam and learning rate) runs the task suite, among it the
  gradient tests (per update: 2 ranks == 1 rank == accumulation in float64, one all-reduce per
  update and step, the other part under no_sync) and a crash that resumes both updates and
  the moving average bitwise. Ranks killed and restarted by torchrun resume through the same
  checkpoints: the default project's fault tests restart them.
- contrastive_task.py (an encoder trained with InfoNCE whose negatives are gathered from
  every rank with autograd, `whole_batch_loss`, evaluation by per-sample sums) runs the task
  suite, among it the gradient tests (2 ranks == 1 rank in float64, accumulation refused
  naming the micro-batch size) and the resume tests.

A task of the first release's interface is held by the generated tests themselves
(tests/machinery/test_contract.py). torchvision's ResNet-18 recipe is not run: torchvision's
PyPI wheel for torch 2.13 is built against CUDA and does not import beside the CPU torch here
(`operator torchvision::nms does not exist`); the CNN covers its form.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from matrix import DEFAULTS
from test_project_suite import (
    READ_THE_TASK_FORM,
    TASK_INDEPENDENT,
    render_from_source,
    run_project_suite,
)

USER_TASKS = Path(__file__).parent / "user_tasks"
#: The generated task suite as a recipe runs it (see above).
RECIPE_SUITE = [
    "tests/task",
    "-m",
    "not faults",
    *(f"--deselect={node}" for node in TASK_INDEPENDENT if node not in READ_THE_TASK_FORM),
]
#: What a recipe of the default task's form runs of the task suite (see above).
MODEL_TESTS = [
    "tests/task/test_gradients.py",
    "tests/task/test_resume.py",
    "tests/task/test_weights.py",
]
#: A TaskConfig of before 1.0, as config.py held it: the text from its decorator on.
OLD_TASK_CONFIG = re.compile(r"^@dataclass\nclass TaskConfig:\n.*", re.S | re.M)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def project_with_task(name: str, task: str, out: Path) -> tuple[Path, dict[str, str], Path]:
    """The default project, rendered under a package name of its own, with `task` as its
    task.py and the example's own test module deleted.

    Returns the project, the environment that imports it, and its package directory."""
    project, env = render_from_source(DEFAULTS, name, out)
    (package_dir,) = (project / "src").iterdir()
    (package_dir / "task.py").write_text(task)
    example_tests = project / "tests" / "example" / f"test_{DEFAULTS['example']}.py"
    assert example_tests.is_file(), "the example's own tests moved: update this test"
    example_tests.unlink()
    return project, env, package_dir


def old_task_config(config: str) -> str:
    """The `class TaskConfig` block of a TaskConfig file of before 1.0."""
    [block] = OLD_TASK_CONFIG.findall(config)
    return block.rstrip("\n") + "\n"


def moved_as_the_changelog_says(task: str, config: str) -> str:
    """task.py of before 1.0 with its TaskConfig moved in from config.py, by the steps of the
    CHANGELOG ("What a project that updates must change"): the class below the imports with the
    imports it needs, and ConfigError imported from .errors."""
    assert task.count("from .config import TaskConfig\n") == 1
    task = task.replace("from .config import TaskConfig\n", "from .errors import ConfigError\n")
    future = "from __future__ import annotations\n"
    assert task.count(future) == 1
    task = task.replace(future, f"{future}\nfrom dataclasses import dataclass\n")
    first_definition = re.search(r"^(class |def |@)", task, re.M)
    assert first_definition, "no definition after the imports"
    at = first_definition.start()
    return task[:at] + old_task_config(config) + "\n\n" + task[at:]


def test_a_token_task_with_dict_batches_padding_and_task_state_passes_the_task_suite(
    tmp_path: Path,
) -> None:
    task = (USER_TASKS / "token_task.py").read_text()
    project, env, _ = project_with_task("User Token Task", task, tmp_path)
    # The task suite, and the machinery tests that read the task: its settings (TaskConfig) and
    # its throughput units (real tokens); the other machinery tests ran in the default project.
    read_the_task = ["tests/machinery/test_config.py", "tests/machinery/test_throughput.py"]
    cases = run_project_suite(project, env, *RECIPE_SUITE, *read_the_task)
    assert "test_weights_are_bitwise_equal_to_an_unbroken_run" in cases
    assert "test_evaluation_and_checkpoint_time_is_not_counted_as_training" in cases


def test_a_cnn_of_its_own_class_with_numpy_augmentation_and_batchnorm_passes_the_task_suite(
    tmp_path: Path,
) -> None:
    """A task that does not derive from TaskBase: the tests read what it lacks through the
    contract's defaults. Random flips drawn with NumPy's global generator: bitwise on the same
    2 ranks, and at the exact sample on 1 and 4. The task was written before 1.0 and updated
    by the CHANGELOG."""
    task = moved_as_the_changelog_says(
        (USER_TASKS / "cnn_task.py").read_text(), (USER_TASKS / "cnn_config.py").read_text()
    )
    assert "TaskBase" not in task.split('"""')[2]  # its code, past the docstring
    project, env, _ = project_with_task("User Cnn Task", task, tmp_path)
    throughput = "tests/machinery/test_throughput.py"
    cases = run_project_suite(project, env, *RECIPE_SUITE, throughput)
    assert "test_weights_are_bitwise_equal_to_an_unbroken_run" in cases
    assert "test_evaluation_and_checkpoint_time_is_not_counted_as_training" in cases


def test_a_task_with_sgd_and_a_schedule_of_its_own_passes_the_model_tests(
    tmp_path: Path,
) -> None:
    """SGD with Nesterov momentum and a step-decay factor per step: 2 ranks, accumulation and 1
    rank make the same updates in float64; a crashed run ends bitwise where an unbroken run
    ends (the momentum buffers and the schedule's step are in the checkpoints)."""
    task = (USER_TASKS / "sgd_task.py").read_text()
    project, env, _ = project_with_task("User Sgd Task", task, tmp_path)
    cases = run_project_suite(project, env, *MODEL_TESTS)
    assert "test_two_ranks_equal_one_process_with_the_whole_batch" in cases
    assert "test_weights_are_bitwise_equal_to_an_unbroken_run" in cases


def test_a_gan_with_alternating_updates_passes_the_task_suite(tmp_path: Path) -> None:
    """Two Adams, whose steps a learning rate far too high does not blow up: the divergence
    test blows the weights up whatever the optimizer. The log names each update's loss; a
    crash resumes both updates bitwise (test_resume.py, in the suite)."""
    task = (USER_TASKS / "gan_task.py").read_text()
    project, env, _ = project_with_task("User Gan Task", task, tmp_path)
    cases = run_project_suite(project, env, *RECIPE_SUITE)
    assert "test_two_ranks_equal_one_process_with_the_whole_batch" in cases
    assert "test_same_global_batch_trains_the_same_on_one_or_two_ranks" in cases
    assert "test_weights_that_blow_up_stop_the_run_at_a_log_line" in cases
    assert "test_ranks_alike_name_nobody" in cases
    assert "test_weights_are_bitwise_equal_to_an_unbroken_run" in cases


def test_a_contrastive_loss_with_negatives_from_every_rank_passes_the_task_suite(
    tmp_path: Path,
) -> None:
    """InfoNCE against every rank's embeddings, gathered with autograd and not scaled by the
    world size: 2 ranks make the updates of one process with the whole batch in float64, a
    split that needs accumulation is refused, a crashed run ends bitwise where an unbroken run
    ends, and a run resumed on 1 and 4 ranks continues it. One micro-batch per rank, and a
    loss whose gather keeps the other ranks waiting for a slow one: the tests follow."""
    task = (USER_TASKS / "contrastive_task.py").read_text()
    project, env, _ = project_with_task("User Contrastive Task", task, tmp_path)
    cases = run_project_suite(project, env, *RECIPE_SUITE)
    refusal = cases["test_a_whole_batch_loss_refuses_accumulation_naming_the_micro_batch_size"]
    assert refusal.find("skipped") is None
    assert "test_weights_are_bitwise_equal_to_an_unbroken_run" in cases


#: Run in the project: one epoch of 8 steps on 256 sequences (each trained on once), then the
#: real tokens of the training set against those the logged throughput adds up to.
THROUGHPUT_CHECK = """
import json, sys
from pathlib import Path

from {package}.monitoring.metrics import read_metrics
from {package}.task import Task
from {package}.config import load_config
from {package}.train import main

run_dir = Path(sys.argv[1])
overrides = [
    *Task.test_settings,
    "task.num_train_samples=256",
    "train.global_batch_size=32",
    "train.micro_batch_size=8",
    "train.epochs=1",
    "train.log_every=2",
    "train.eval_every=100",
    "checkpoint.every_steps=100",
    f"run.dir={{run_dir}}",
]
assert main(overrides) == 0
config = load_config(None, overrides)
train, _ = Task(config.task, seed=config.run.seed).build_datasets()
records = [r for r in read_metrics(run_dir) if "train/loss" in r]
print(json.dumps({{
    "real_tokens": sum(len(sequence) - 1 for sequence in train),
    "samples": len(train),
    "longest": max(len(sequence) - 1 for sequence in train),
    "steps": [r["step"] for r in records],
    "logged_tokens": sum(
        r["train/tokens_per_s"] * r["train/step_time_s"] * config.train.log_every
        for r in records
    ),
    "log": (run_dir / "train.log").read_text(),
}}))
"""


def test_a_hugging_face_gpt2_passes_the_model_tests_and_counts_real_tokens(tmp_path: Path) -> None:
    """GPT2LMHeadModel from a tiny GPT2Config (no download); a single-process epoch then
    shows that tokens/s counts the real tokens: tokens/s x step time x steps, added up over
    the log lines, is the number of real tokens in the training set, not the padded count."""
    try:
        import transformers  # noqa: F401
    except ImportError as error:  # it is in requirements-test.txt
        pytest.skip(f"transformers cannot be imported: {error}")
    task = moved_as_the_changelog_says(
        (USER_TASKS / "hf_gpt2_task.py").read_text(),
        (USER_TASKS / "hf_gpt2_config.py").read_text(),
    )
    project, env, package_dir = project_with_task("User Hf Gpt2 Task", task, tmp_path)
    package = package_dir.name
    cases = run_project_suite(project, env, *MODEL_TESTS)
    assert "test_two_ranks_equal_one_process_with_the_whole_batch" in cases
    assert "test_weights_are_bitwise_equal_to_an_unbroken_run" in cases

    result = subprocess.run(
        [sys.executable, "-c", THROUGHPUT_CHECK.format(package=package), str(tmp_path / "run")],
        cwd=project,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["steps"] == [2, 4, 6, 8]  # one epoch: every sequence once
    assert " tokens/s" in figures["log"]
    assert figures["logged_tokens"] == pytest.approx(figures["real_tokens"], rel=1e-6)
    # Padded to the longest, the same batches would hold many more tokens.
    assert figures["real_tokens"] < 0.8 * figures["samples"] * figures["longest"]
