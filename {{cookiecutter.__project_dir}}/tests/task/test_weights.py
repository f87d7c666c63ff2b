"""Weights without the training state: initial weights for fine-tuning, export, inference."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from {{ cookiecutter.package_name }}.checkpointing.checkpoint import save_checkpoint
from {{ cookiecutter.package_name }}.checkpointing.weights import (
    WeightsError,
    export_weights,
    load_initial_weights,
    load_model,
)
from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import Config, load_config, to_yaml
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.train import main

from ..helpers import FAST, load_in_fresh_process, make_trainer, optimizer_states


class Tied(nn.Module):
    """An embedding whose matrix is also the output head, as in GPT-2."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight


def build(config: Config) -> nn.Module:
    """The example's model; each call draws new random weights."""
    return Task(config.task, seed=config.run.seed).build_model()


def assert_same_weights(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def copy_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def checkpoint(run_dir: Path, step: int, model: nn.Module) -> Path:
    """A real checkpoint of `model` at `step`, as a single-process run writes it."""
    state = {"model": model.state_dict(), "step": step}
    return save_checkpoint(run_dir, step, state, {"rank": 0}, DistEnv(), keep_last=5)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# --- export and load_model -------------------------------------------------------------------


def test_exported_model_loads_back_equal_and_in_eval_mode(
    fast_config: Config, tmp_path: Path
) -> None:
    model = build(fast_config)
    export_weights(model, tmp_path / "run", to_yaml(fast_config))

    loaded = load_model(tmp_path / "run")

    assert_same_weights(loaded, copy_of(model))
    assert not loaded.training


def test_export_writes_the_config_and_no_temporary_files(
    fast_config: Config, tmp_path: Path
) -> None:
    text = to_yaml(fast_config)
    path = export_weights(build(fast_config), tmp_path / "run", text)

    assert path == tmp_path / "run" / "export" / "model.safetensors"
    assert (path.parent / "config.yaml").read_text() == text
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml", "model.safetensors"]


def test_tied_weights_survive_export_and_stay_tied(tmp_path: Path) -> None:
    """safetensors stores the shared matrix once; both names get it back, still one tensor."""
    model = Tied()
    path = export_weights(model, tmp_path / "run", "")
    fresh = Tied()

    load_initial_weights(fresh, path)

    assert_same_weights(fresh, copy_of(model))
    assert fresh.head.weight.data_ptr() == fresh.embedding.weight.data_ptr()


def test_ema_export_is_loaded_with_ema_true(fast_config: Config, tmp_path: Path) -> None:
    export_weights(build(fast_config), tmp_path / "run", to_yaml(fast_config))
    average = build(fast_config)
    export_weights(average, tmp_path / "run", to_yaml(fast_config), name="model_ema")

    assert_same_weights(load_model(tmp_path / "run", ema=True), copy_of(average))


def test_load_model_without_ema_export_says_how_to_get_one(
    fast_config: Config, tmp_path: Path
) -> None:
    export_weights(build(fast_config), tmp_path / "run", to_yaml(fast_config))

    with pytest.raises(WeightsError, match=r"ema\.decay > 0"):
        load_model(tmp_path / "run", ema=True)


def test_load_model_without_export_says_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=r"checkpoint\.export=true"):
        load_model(tmp_path / "run")


def test_load_model_does_not_need_the_initial_weights_of_the_run(
    fast_config: Config, tmp_path: Path
) -> None:
    """A fine-tuned run's config names the weights it started from; they may be gone since."""
    pretrained = tmp_path / "pretrained.safetensors"
    pretrained.touch()
    config = load_config(None, [f"run.dir={tmp_path / 'run'}", f"init.weights={pretrained}"])
    model = build(config)
    export_weights(model, tmp_path / "run", to_yaml(config))
    pretrained.unlink()

    assert_same_weights(load_model(tmp_path / "run"), copy_of(model))


def test_a_copy_of_the_export_loads_in_a_fresh_process_elsewhere_without_the_run(
    fast_config: Config, tmp_path: Path
) -> None:
    """The export folder alone rebuilds the trained model: copied away, its run deleted, loaded
    by a new process in another working directory."""
    trainer = make_trainer(fast_config)
    trainer.fit()
    copy = shutil.copytree(tmp_path / "run" / "export", tmp_path / "served" / "model")
    shutil.rmtree(tmp_path / "run")

    loaded = load_in_fresh_process(copy, cwd=tmp_path / "elsewhere")

    assert_same_weights(trainer.model, loaded)


# --- load_initial_weights: sources ---------------------------------------------------------


def test_run_dir_gives_the_newest_checkpoint(fast_config: Config, tmp_path: Path) -> None:
    checkpoint(tmp_path, 4, build(fast_config))
    newest = build(fast_config)
    checkpoint(tmp_path, 8, newest)
    model = build(fast_config)

    description = load_initial_weights(model, tmp_path)

    assert_same_weights(model, copy_of(newest))
    assert description == f"weights of step 8 from {tmp_path / 'checkpoints' / 'step_00000008'}"


def test_run_dir_skips_a_damaged_newest_checkpoint(
    fast_config: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    older = build(fast_config)
    checkpoint(tmp_path, 4, older)
    flip_a_byte(checkpoint(tmp_path, 8, build(fast_config)) / "state.pt")
    model = build(fast_config)

    with caplog.at_level(logging.WARNING):
        description = load_initial_weights(model, tmp_path)

    assert_same_weights(model, copy_of(older))
    assert "step 4" in description
    assert "step_00000008" in caplog.text


def test_run_dir_whose_checkpoints_are_all_damaged_fails(
    fast_config: Config, tmp_path: Path
) -> None:
    flip_a_byte(checkpoint(tmp_path, 4, build(fast_config)) / "state.pt")

    with pytest.raises(WeightsError, match="none of the 1 checkpoints"):
        load_initial_weights(build(fast_config), tmp_path)


def test_checkpoint_dir_gives_its_weights(fast_config: Config, tmp_path: Path) -> None:
    source = build(fast_config)
    path = checkpoint(tmp_path, 4, source)
    checkpoint(tmp_path, 8, build(fast_config))
    model = build(fast_config)

    assert "step 4" in load_initial_weights(model, path)
    assert_same_weights(model, copy_of(source))


def test_pt_file_with_a_state_dict_loads(fast_config: Config, tmp_path: Path) -> None:
    source = build(fast_config)
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    model = build(fast_config)

    assert load_initial_weights(model, tmp_path / "weights.pt") == (
        f"weights from {tmp_path / 'weights.pt'}"
    )
    assert_same_weights(model, copy_of(source))


def test_pt_file_with_a_model_entry_loads(fast_config: Config, tmp_path: Path) -> None:
    source = build(fast_config)
    torch.save({"model": source.state_dict(), "step": 3}, tmp_path / "state.pt")
    model = build(fast_config)

    load_initial_weights(model, tmp_path / "state.pt")

    assert_same_weights(model, copy_of(source))


def test_safetensors_file_loads(fast_config: Config, tmp_path: Path) -> None:
    source = build(fast_config)
    safetensors.torch.save_model(source, str(tmp_path / "weights.safetensors"))
    model = build(fast_config)

    load_initial_weights(model, tmp_path / "weights.safetensors")

    assert_same_weights(model, copy_of(source))


# --- load_initial_weights: what does not fit -----------------------------------------------


def test_other_shape_names_the_key_and_both_shapes(tmp_path: Path) -> None:
    torch.save(nn.Linear(4, 3).state_dict(), tmp_path / "weights.pt")

    with pytest.raises(WeightsError) as raised:
        load_initial_weights(nn.Linear(4, 5), tmp_path / "weights.pt")

    message = str(raised.value)
    assert "weight: checkpoint (3, 4) vs model (5, 4)" in message
    assert "bias: checkpoint (3,) vs model (5,)" in message
    assert "same task.* settings" in message


def test_missing_and_unexpected_keys_are_named(tmp_path: Path) -> None:
    torch.save(nn.Sequential(nn.Linear(2, 2)).state_dict(), tmp_path / "weights.pt")

    with pytest.raises(WeightsError) as raised:
        load_initial_weights(nn.Linear(2, 2), tmp_path / "weights.pt")

    message = str(raised.value)
    assert "2 missing from the weights: weight, bias" in message
    assert "2 not in the model: 0.weight, 0.bias" in message
    assert str(tmp_path / "weights.pt") in message


def test_long_mismatch_lists_ten_names_and_counts_the_rest(tmp_path: Path) -> None:
    torch.save({"other": torch.zeros(1)}, tmp_path / "other.pt")
    model = nn.Sequential(*(nn.Linear(1, 1, bias=False) for _ in range(12)))

    with pytest.raises(
        WeightsError, match=r"12 missing from the weights: 0\.weight, .*, 9\.weight, and 2 more\n"
    ):
        load_initial_weights(model, tmp_path / "other.pt")


def test_mismatch_leaves_the_model_untouched(tmp_path: Path) -> None:
    state = nn.Linear(4, 3).state_dict()
    del state["bias"]
    torch.save(state, tmp_path / "weights.pt")
    model = nn.Linear(4, 3)
    before = copy_of(model)

    with pytest.raises(WeightsError):
        load_initial_weights(model, tmp_path / "weights.pt")

    assert_same_weights(model, before)


# --- load_initial_weights: what is not weights ---------------------------------------------


def test_path_that_does_not_exist_fails(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="do not exist"):
        load_initial_weights(nn.Linear(2, 2), tmp_path / "nowhere.pt")


def test_file_of_unknown_suffix_fails(tmp_path: Path) -> None:
    (tmp_path / "weights.npz").write_bytes(b"not weights")

    with pytest.raises(WeightsError, match="not a weights file"):
        load_initial_weights(nn.Linear(2, 2), tmp_path / "weights.npz")


@pytest.mark.parametrize("name", ["weights.pt", "weights.safetensors"])
def test_unreadable_file_fails(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"not weights at all")

    with pytest.raises(WeightsError, match="cannot read weights"):
        load_initial_weights(nn.Linear(2, 2), tmp_path / name)


def test_directory_without_checkpoints_fails(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="neither a run directory nor a checkpoint directory"):
        load_initial_weights(nn.Linear(2, 2), tmp_path)


def test_a_new_run_starts_from_init_weights_at_step_zero_with_a_fresh_optimizer(
    fast_config: Config, tmp_path: Path
) -> None:
    pretrained = make_trainer(fast_config)
    pretrained.fit()
    finetune = load_config(
        None, [*FAST, f"run.dir={tmp_path / 'finetune'}", f"init.weights={fast_config.run.dir}"]
    )
    trainer = make_trainer(finetune)
    trainer.start_fresh()
    assert_same_weights(trainer.model, copy_of(pretrained.model))
    assert trainer.step == 0
    assert not any(state["state"] for state in optimizer_states(trainer).values())


def test_weights_of_another_shape_end_the_launch_with_exit_2_and_the_names(
    fast_config: Config, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"unrelated.weight": torch.zeros(2, 2)}, tmp_path / "other.pt")
    overrides = [*FAST, f"run.dir={tmp_path / 'run'}", f"init.weights={tmp_path / 'other.pt'}"]
    assert main(overrides) == 2
    assert "unrelated.weight" in capsys.readouterr().err
