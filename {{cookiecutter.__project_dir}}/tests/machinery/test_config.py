"""Configuration: defaults, YAML files, command-line overrides and the errors for bad input."""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pytest
import yaml

import {{ cookiecutter.package_name }}.config as config_module
from {{ cookiecutter.package_name }}.checkpointing.resume import changed_settings
from {{ cookiecutter.package_name }}.config import (
    Config,
    ConfigError,
    flatten,
    from_dict,
    load_config,
    settings,
    to_yaml,
)
from {{ cookiecutter.package_name }}.task import Task, TaskConfig
from {{ cookiecutter.package_name }}.train import main, parse_args

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def test_defaults_need_no_file() -> None:
    """With no file and no overrides the config is the documented dataclass default."""
    assert load_config() == Config()


def test_shipped_default_yaml_loads() -> None:
    """configs/default.yaml is valid and agrees with the dataclass defaults it restates."""
    assert load_config(PROJECT_ROOT / "configs" / "default.yaml") == Config()


def test_yaml_file_sets_values(tmp_path: Path) -> None:
    """Values in a YAML file replace the defaults of their section only."""
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  epochs: 7\noptim:\n  lr: 0.5\n")
    config = load_config(path)
    assert (config.train.epochs, config.optim.lr) == (7, 0.5)
    assert config.train.micro_batch_size == Config().train.micro_batch_size


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    """`section.key=value` on the command line beats the file, and values are typed."""
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  epochs: 7\n")
    config = load_config(
        path, ["train.epochs=9", "optim.betas=[0.8, 0.95]", "dist.static_graph=true"]
    )
    assert config.train.epochs == 9
    assert config.optim.betas == (0.8, 0.95)
    assert config.dist.static_graph is True


def test_scientific_notation_is_a_float() -> None:
    """YAML reads `1e-4` as a string; float settings accept it as the number it means."""
    assert load_config(None, ["optim.lr=1e-4"]).optim.lr == 1e-4


def test_int_is_accepted_for_a_float() -> None:
    """`optim.lr=1` means 1.0: ints widen to floats, nothing else is coerced."""
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.epochz=3", "unknown key(s) train.epochz"),
        ("trian.epochs=3", "unknown key(s) trian"),
        ("train.epochs=three", "train.epochs must be of type int"),
        ("train.epochs=2.5", "train.epochs must be of type int"),
        ("dist.static_graph=1", "dist.static_graph must be of type bool"),
        ("optim.lr=fast", "optim.lr must be of type float"),
        ("train.mixed_precision=fp8", "train.mixed_precision must be one of bf16, fp16, none"),
        ("optim.betas=[0.9]", "optim.betas must be a list of 2 values"),
        ("train.epochs", "must look like section.key=value"),
        ("epochs=3", "must look like section.key=value"),
        ("train=3", "must look like section.key=value"),
        ("optim.lr=-1", "optim.lr must be positive"),
        ("optim.grad_clip=.nan", "optim.grad_clip must be a finite number"),
        ("optim.weight_decay=.inf", "optim.weight_decay must be a finite number"),
        ("optim.lr=-.inf", "optim.lr must be a finite number"),
        ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0"),
        ("optim.grad_clip=-1", "optim.grad_clip must be >= 0"),
        ("optim.betas=[0.9,1.0]", "optim.betas must both be in [0, 1)"),
        ("optim.warmup_steps=-5", "optim.warmup_steps must be >= 0"),
        ("best.patience=3", "best.patience needs best.metric"),
        ("best.metric=loss", "best.metric=loss is not an evaluation metric"),
        ("data.num_workers=-1", "data.num_workers must be >= 0 or auto"),
        ("data.num_workers=many", "data.num_workers must be of type int | auto"),
    ],
)
def test_bad_override_is_a_clear_error(override: str, message: str) -> None:
    """Each kind of mistake names the key and what was wrong."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_a_key_given_twice_in_a_file_is_refused_with_its_line(tmp_path: Path) -> None:
    """YAML itself would keep the second value silently."""
    path = tmp_path / "twice.yaml"
    path.write_text("optim:\n  lr: 0.1\n  weight_decay: 0.0\n  lr: 0.001\n")
    with pytest.raises(ConfigError, match=r"(?s)the key 'lr' appears twice .*twice.yaml\", line 4"):
        load_config(path)


def test_skipping_non_finite_steps_is_refused_with_fp16_loss_scaling() -> None:
    with pytest.raises(ConfigError, match="fp16's loss scaler already skips"):
        load_config(None, ["train.on_nonfinite=skip", "train.mixed_precision=fp16"])


def test_a_static_graph_is_refused_where_the_world_size_needs_gradient_accumulation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """DDP's static graph fails under no_sync (pytorch/pytorch#143580): refused before any
    process group starts, naming the batch split; one micro-batch per step keeps it."""
    static = ["--print-config", "dist.static_graph=true", "train.global_batch_size=64"]
    assert main([*static, "train.micro_batch_size=32"]) == 2
    error = capsys.readouterr().err
    assert "dist.static_graph=true cannot train with gradient accumulation" in error
    split = "train.global_batch_size=64 on 1 rank(s) with train.micro_batch_size=32 takes 2 "
    assert split in error
    assert main([*static, "train.micro_batch_size=64"]) == 0


def test_a_whole_batch_loss_is_refused_where_the_world_size_needs_gradient_accumulation(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loss that reads the step's samples together (Task.whole_batch_loss) would become
    another loss per micro-batch: refused naming the micro-batch size that avoids it."""
    monkeypatch.setattr(Task, "whole_batch_loss", True, raising=False)
    settings = ["--print-config", "train.global_batch_size=64"]
    assert main([*settings, "train.micro_batch_size=16"]) == 2
    error = capsys.readouterr().err
    assert "Task.whole_batch_loss" in error and "takes 4 micro-batches per step" in error
    assert "Set train.micro_batch_size=64 (train.global_batch_size / ranks)" in error
    assert main([*settings, "train.micro_batch_size=64"]) == 0


def test_file_that_is_not_a_mapping_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(path)


def test_resolved_config_round_trips_through_yaml_and_dict() -> None:
    """The YAML printed by --print-config and the dict stored in checkpoints rebuild the config."""
    config = load_config(None, ["train.epochs=4", "optim.betas=[0.8, 0.9]"])
    assert from_dict(yaml.safe_load(to_yaml(config))) == config
    assert from_dict(config.to_dict()) == config


def test_print_config_prints_yaml_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--print-config", "train.epochs=5"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["epochs"] == 5


def test_bad_config_exits_2_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo fails at once with exit status 2 and creates no run directory."""
    run_dir = tmp_path / "run"
    assert main([f"run.dir={run_dir}", "train.epochz=1"]) == 2
    assert "error: unknown key(s) train.epochz" in capsys.readouterr().err
    assert not run_dir.exists()


class Mode(enum.Enum):
    SLOW = "slow"
    FAST = "fast"


@dataclass
class Encoder:
    #: Blocks in the encoder.
    depth: int = 2
    #: Width multiplier.
    width: float = 1.0


@dataclass
class UserTask(TaskConfig):
    """The shipped task with a field of each kind of setting that a user may add."""

    #: Where the outputs go.
    out: Path = Path("runs/out")
    #: At most this many; null: no limit.
    limit: int | None = None
    #: An optional label.
    label: Optional[str] = None  # noqa: UP045 (users write Optional too)
    #: Layer sizes.
    sizes: list[int] = field(default_factory=lambda: [1, 2])
    #: Any number of dimensions.
    shape: tuple[int, ...] = (3, 4)
    #: Exactly a pair.
    pair: tuple[str, float] = ("a", 0.5)
    #: Weight per class.
    weights: dict[str, float] = field(default_factory=dict)
    #: A choice of strings.
    kind: Literal["a", "b"] = "a"
    #: A choice of enum values.
    mode: Mode = Mode.SLOW
    #: A dataclass inside the section.
    encoder: Encoder = field(default_factory=Encoder)


@dataclass
class UserConfig(Config):
    task: UserTask = field(default_factory=UserTask)


@pytest.fixture
def user_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader, --print-config and --help see UserTask's fields as if added to TaskConfig."""
    monkeypatch.setattr(config_module, "Config", UserConfig)


#: One override per kind of setting, and the value it sets.
TYPED_OVERRIDES = [
    ("run.dir=runs/exp1", "runs/exp1"),
    ("train.epochs=9", 9),
    ("optim.lr=1e-4", 1e-4),
    ("dist.find_unused_parameters=true", True),
    ("task.out=/data/out", Path("/data/out")),
    ("task.limit=5", 5),
    ("task.limit=null", None),
    ("task.label=cats", "cats"),
    ("task.sizes=[3, 4, 5]", [3, 4, 5]),
    ("task.shape=[7]", (7,)),
    ("task.pair=[b, 2]", ("b", 2.0)),
    ("task.weights={a: 1, b: 0.5}", {"a": 1.0, "b": 0.5}),
    ("task.kind=b", "b"),
    ("task.mode=fast", Mode.FAST),
    ("task.encoder.depth=4", 4),
]
OVERRIDES = [override for override, _ in TYPED_OVERRIDES]
OVERRIDE_IDS = [override.partition("=")[0] for override in OVERRIDES]


def setting(config: Config, key: str) -> Any:
    """The value of `section.key` (or `section.sub.key`) in `config`."""
    value: Any = config
    for name in key.split("."):
        value = getattr(value, name)
    return value


@pytest.mark.usefixtures("user_fields")
@pytest.mark.parametrize(("override", "expected"), TYPED_OVERRIDES, ids=OVERRIDE_IDS)
def test_override_sets_a_value_of_the_declared_type(override: str, expected: Any) -> None:
    value = setting(load_config(None, [override]), override.partition("=")[0])
    assert (value, type(value)) == (expected, type(expected))


@pytest.mark.usefixtures("user_fields")
@pytest.mark.parametrize("override", OVERRIDES, ids=OVERRIDE_IDS)
def test_overridden_config_round_trips_through_a_yaml_file(override: str, tmp_path: Path) -> None:
    """What --print-config and config.yaml hold loads back as the same config."""
    config = load_config(None, [override])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(config))
    assert load_config(path) == config


@pytest.mark.usefixtures("user_fields")
@pytest.mark.parametrize("override", OVERRIDES, ids=OVERRIDE_IDS)
def test_checkpointed_dict_is_plain_json_and_rebuilds_the_config(override: str) -> None:
    """Checkpoints store `to_dict()`: only JSON types (Path: str, Enum: value, tuple: list)."""
    config = load_config(None, [override])
    assert from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.usefixtures("user_fields")
@pytest.mark.parametrize("override", OVERRIDES, ids=OVERRIDE_IDS)
def test_print_config_prints_what_the_override_set(
    override: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--print-config", override]) == 0
    path = tmp_path / "printed.yaml"
    path.write_text(capsys.readouterr().out)
    assert load_config(path) == load_config(None, [override])


@pytest.mark.usefixtures("user_fields")
def test_print_config_writes_paths_enums_and_tuples_as_plain_yaml(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--print-config"]) == 0
    task = yaml.safe_load(capsys.readouterr().out)["task"]
    assert (task["out"], task["mode"], task["shape"]) == ("runs/out", "slow", [3, 4])
    assert task["encoder"] == {"depth": 2, "width": 1.0}


@pytest.mark.usefixtures("user_fields")
def test_nested_override_keeps_the_other_nested_values() -> None:
    config = load_config(None, ["task.encoder.width=2"])
    assert config.task.encoder == Encoder(depth=2, width=2.0)


@pytest.mark.usefixtures("user_fields")
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("task.out=3", "task.out must be of type Path, got 3 (int)"),
        ("task.limit=many", "task.limit must be of type int | None, got 'many' (str)"),
        ("task.limit=true", "task.limit must be of type int | None, got True (bool)"),
        ("task.sizes=3", "task.sizes must be of type list[int], got 3 (int)"),
        ("task.sizes=[1, x]", "task.sizes[1] must be of type int, got 'x' (str)"),
        ("task.shape=[1.5]", "task.shape[0] must be of type int, got 1.5 (float)"),
        ("task.pair=[b]", "task.pair must be a list of 2 values"),
        ("task.weights=[1]", "task.weights must be of type dict[str, float]"),
        ("task.weights={a: x}", "task.weights.a must be of type float, got 'x' (str)"),
        ("task.weights={1: 2}", "a key of task.weights must be of type str, got 1 (int)"),
        ("task.kind=c", "task.kind must be one of a, b; got 'c'"),
        ("task.mode=FAST", "task.mode must be one of slow, fast; got 'FAST'"),
        ("task.encoder=3", "task.encoder must be a mapping, got 3"),
        ("task.encoder.depth=yes", "task.encoder.depth must be of type int, got True (bool)"),
    ],
)
def test_bad_value_names_the_key_and_the_expected_type(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


@pytest.mark.usefixtures("user_fields")
def test_unknown_nested_key_lists_the_valid_ones() -> None:
    message = "unknown key(s) task.encoder.dept in task.encoder; valid keys: depth, width"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["task.encoder.dept=3"])


def test_a_setting_named_by_a_python_keyword_is_read_written_and_listed_by_its_key() -> None:
    """checkpoint.async is the field async_save; the field's name is not a key."""
    config = load_config(None, ["checkpoint.async=true"])
    assert config.checkpoint.async_save is True
    assert config.to_dict()["checkpoint"]["async"] is True
    assert from_dict(config.to_dict()) == config
    assert "checkpoint.async" in [setting.key for setting in settings()]
    with pytest.raises(ConfigError, match=r"unknown key\(s\) checkpoint.async_save .*, async"):
        load_config(None, ["checkpoint.async_save=true"])


@pytest.mark.usefixtures("user_fields")
def test_flatten_opens_nested_sections_but_not_dict_settings() -> None:
    """Names are those of the overrides; a dict setting is one value, as it is overridden."""
    flat = flatten(load_config(None, ["task.weights={a: 1}"]).to_dict())
    assert (flat["task.encoder.depth"], flat["task.weights"]) == (2, {"a": 1.0})
    assert "task.weights.a" not in flat


@pytest.mark.usefixtures("user_fields")
def test_resume_sees_a_key_added_to_a_dict_setting_as_a_change() -> None:
    saved = UserConfig().to_dict()
    current = load_config(None, ["task.weights={a: 1}", "task.encoder.depth=3"]).to_dict()
    assert changed_settings(saved, current) == {
        "task.weights": ({}, {"a": 1.0}),
        "task.encoder.depth": (2, 3),
    }


def help_settings(capsys: pytest.CaptureFixture[str]) -> dict[str, tuple[str, str, str]]:
    """`section.key` -> (default, type, help line) as `--help` lists them."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    found = re.findall(r"^  (\S+?)=(.*)  \((.+)\)\n {6}(.*)$", capsys.readouterr().out, re.M)
    return {key: (default, kind, text) for key, default, kind, text in found}


def test_help_lists_every_setting_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    listed = help_settings(capsys)
    defaults = flatten(Config().to_dict())
    assert list(listed) == list(defaults)
    assert {key: yaml.safe_load(default) for key, (default, _, _) in listed.items()} == defaults


def test_every_shipped_setting_has_a_help_line() -> None:
    """A setting without a `#:` comment above its field would be listed without a description
    (task.* are the task's own, described as its author chooses)."""
    shipped = [entry for entry in settings() if not entry.key.startswith("task.")]
    assert [entry.key for entry in shipped if not entry.help] == []


@pytest.mark.usefixtures("user_fields")
def test_help_lists_user_fields_with_type_and_comment(capsys: pytest.CaptureFixture[str]) -> None:
    listed = help_settings(capsys)
    assert listed["task.encoder.depth"] == ("2", "int", "Blocks in the encoder.")
    assert listed["task.limit"] == ("null", "int | None", "At most this many; null: no limit.")
    assert listed["task.mode"][:2] == ("slow", "slow|fast")
    assert listed["task.weights"][:2] == ("{}", "dict[str, float]")
    assert listed["task.out"][:2] == ("runs/out", "Path")


def test_the_task_section_is_the_class_task_py_defines() -> None:
    """task.py holds the task's settings; the config builds, validates and lists that class."""
    assert type(load_config().task) is TaskConfig
    assert config_module.task_config_class() is TaskConfig


def test_importing_task_config_from_config_still_works_with_a_warning() -> None:
    """Projects before 1.0 imported TaskConfig from config.py: it works for one more release."""
    with pytest.warns(FutureWarning, match=r"import TaskConfig from .*\.task"):
        from {{ cookiecutter.package_name }}.config import TaskConfig as old_name
    assert old_name is TaskConfig


def failed_import_of_a_copy(tmp_path: Path, module: str, files: dict[str, str]) -> str:
    """The error output of importing `module` of a copy of the package with `files` written
    into it (a name and its text), in a new interpreter; the import must fail."""
    package = Path(config_module.__file__).parents[1]  # config/ is a package in the package
    copy = tmp_path / package.name
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in files.items():
        (copy / name).write_text(text)
    result = subprocess.run(
        [sys.executable, "-c", f"import {package.name}.{module}"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    return result.stderr


def test_a_task_py_that_imports_its_settings_from_config_is_told_where_they_went(
    tmp_path: Path,
) -> None:
    """A task.py of before 1.0 whose TaskConfig was left behind in config.py's old text (taken
    away by an update) names the move to make instead of a circular-import error."""
    task = "from .config import ConfigError, TaskConfig\n"
    error = failed_import_of_a_copy(tmp_path, "task", {"task.py": task})
    last_line = error.strip().splitlines()[-1]
    assert last_line.startswith("ImportError:"), error
    assert "defines no TaskConfig" in last_line and "move `class TaskConfig`" in last_line


def test_a_config_py_left_beside_the_config_package_is_refused_naming_it(tmp_path: Path) -> None:
    """An update cannot delete a config.py the project changed: it stays beside config/, which
    Python imports instead, so its settings would be ignored in silence. Importing the config
    names the file and the move to make."""
    error = failed_import_of_a_copy(tmp_path, "config", {"config.py": "# our own settings\n"})
    last_line = error.strip().splitlines()[-1]
    assert last_line.startswith("ImportError:"), error
    assert f"{tmp_path}{os.sep}" in last_line and "config.py is ignored" in last_line
    assert "then delete config.py" in last_line
