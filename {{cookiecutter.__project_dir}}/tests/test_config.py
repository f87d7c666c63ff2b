"""Configuration: defaults, YAML files, command-line overrides and the errors for bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from {{ cookiecutter.package_name }}.config import (
    Config,
    ConfigError,
    from_dict,
    load_config,
    to_yaml,
)
from {{ cookiecutter.package_name }}.train import main

PROJECT_ROOT = Path(__file__).resolve().parents[1]


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
    ],
)
def test_bad_override_is_a_clear_error(override: str, message: str) -> None:
    """Each kind of mistake names the key and what was wrong."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


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
