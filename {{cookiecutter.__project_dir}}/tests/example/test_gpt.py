"""The GPT example: its text, its windows, causal attention, its FLOPs and its presets."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.weights import export_weights
from {{ cookiecutter.package_name }}.config import ConfigError, load_config, to_yaml
from {{ cookiecutter.package_name }}.loading.shards import random_shards, read_manifest
from {{ cookiecutter.package_name }}.prepare import main as prepare
from {{ cookiecutter.package_name }}.task import VOCAB_SIZE, Task, TaskConfig, generate_text
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import FAST, env_for, load_in_fresh_process, make_trainer, spawn

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fast_task() -> Task:
    return Task(load_config(None, FAST).task, seed=1234)


@pytest.fixture
def bpe_shards(tmp_path: Path) -> Path:
    """Shards of a BPE tokenizer of 300 tokens trained on four files, one of them held out."""
    for name in "abcd":
        (tmp_path / "texts").mkdir(exist_ok=True)
        (tmp_path / "texts" / f"{name}.txt").write_bytes(generate_text(8000, seed=ord(name)))
    options = ["--train-tokenizer=300", "--eval-fraction=0.25", "--workers=1"]
    assert prepare([str(tmp_path / "texts"), f"--output={tmp_path / 'shards'}", *options]) == 0
    return tmp_path / "shards"


def trained_on(shards: Path | str, run_dir: Path) -> Trainer:
    """Two steps on the shards, to the end: the export is written."""
    overrides = [f"task.data_dir={shards}", "task.num_train_samples=0"]
    overrides += ["task.num_eval_samples=64", "train.max_steps=2", f"run.dir={run_dir}"]
    trainer = make_trainer(load_config(None, [*FAST, *overrides]))
    assert trainer.fit() == 0
    return trainer


def assert_weights_of(model: torch.nn.Module, loaded: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_the_generated_text_depends_on_the_seed_alone() -> None:
    assert generate_text(5000, seed=1) == generate_text(5000, seed=1)
    assert generate_text(5000, seed=1) != generate_text(5000, seed=2)
    assert len(generate_text(5000, seed=1)) == 5000


def test_targets_are_the_inputs_shifted_by_one_byte(fast_task: Task) -> None:
    train, _ = fast_task.build_datasets()
    block = fast_task.config.block_size
    text = generate_text(fast_task.config.generated_bytes, seed=1234)
    inputs, targets = train[3]
    assert bytes(inputs.tolist()) == text[3 * block : 4 * block]
    assert bytes(targets.tolist()) == text[3 * block + 1 : 4 * block + 1]


def test_the_first_90_percent_of_the_text_trains_and_the_rest_evaluates(tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(100)) * 10)
    config = load_config(
        None,
        [*FAST, f"task.text_path={path}", "task.num_train_samples=0", "task.num_eval_samples=0"],
    )
    _, evaluation = Task(config.task, seed=0).build_datasets()
    inputs, _ = evaluation[0]
    assert bytes(inputs.tolist()) == path.read_bytes()[900 : 900 + config.task.block_size]
    assert len(evaluation) == (100 - 1) // config.task.block_size


def test_a_missing_text_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is not a file.*leave task\.text_path empty"):
        load_config(None, [f"task.text_path={tmp_path / 'missing.txt'}"])


def test_a_text_too_short_for_the_windows_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("far too short")
    config = load_config(None, [*FAST, f"task.text_path={path}"])
    with pytest.raises(ConfigError, match=r"holds 0 windows.*Use a longer text"):
        Task(config.task, seed=0).build_datasets()


def test_shards_and_a_text_file_together_are_refused_by_name(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("some text")
    with pytest.raises(ConfigError, match=r"task\.data_dir=.* and task\.text_path=.* set one"):
        load_config(None, [f"task.data_dir={tmp_path}", f"task.text_path={text}"])


def test_the_gpt_trains_on_prepared_shards_with_the_vocabulary_of_their_tokenizer(
    tmp_path: Path, bpe_shards: Path
) -> None:
    """A BPE tokenizer of 300 tokens trained on four files, one of them held out."""
    overrides = [f"task.data_dir={bpe_shards}", "task.num_train_samples=0"]
    overrides += ["task.num_eval_samples=64", "train.max_steps=6", f"run.dir={tmp_path / 'run'}"]
    trainer = make_trainer(load_config(None, [*FAST, *overrides]))
    vocab_size = read_manifest(bpe_shards).vocab_size
    assert trainer.model.token_embedding.num_embeddings == vocab_size > VOCAB_SIZE
    before = trainer.evaluate()["loss"]
    trainer.fit()
    assert trainer.step == 6
    assert trainer.evaluate()["loss"] < before


def test_a_run_on_shards_loads_from_another_working_directory(
    tmp_path: Path, bpe_shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """task.data_dir=data/shards names the shards from where training ran; load_model(run_dir)
    from elsewhere, in a fresh process, reads none."""
    project = tmp_path / "project"
    shutil.copytree(bpe_shards, project / "data" / "shards")
    monkeypatch.chdir(project)
    trainer = trained_on("data/shards", project / "runs" / "bpe")

    loaded = load_in_fresh_process(project / "runs" / "bpe", cwd=tmp_path / "elsewhere")

    assert_weights_of(trainer.model, loaded)


def test_a_copy_of_the_export_of_a_run_on_shards_loads_without_the_run_and_the_shards(
    tmp_path: Path, bpe_shards: Path
) -> None:
    """The vocabulary size the shards' manifest gave is in the export."""
    trainer = trained_on(bpe_shards, tmp_path / "run")
    copy = shutil.copytree(tmp_path / "run" / "export", tmp_path / "served" / "model")
    shutil.rmtree(tmp_path / "run")
    shutil.rmtree(bpe_shards)

    loaded = load_in_fresh_process(copy, cwd=tmp_path / "elsewhere")

    assert_weights_of(trainer.model, loaded)


def test_the_export_of_a_run_on_shards_holds_their_tokenizer(
    tmp_path: Path, bpe_shards: Path
) -> None:
    config = load_config(None, [*FAST, f"task.data_dir={bpe_shards}"])
    task = Task(config.task, seed=0)
    export_weights(task.build_model(), tmp_path / "run", to_yaml(config), task=task)

    exported = tmp_path / "run" / "export" / "tokenizer.json"
    assert exported.read_bytes() == (bpe_shards / "tokenizer.json").read_bytes()


def test_a_model_of_bytes_exports_no_tokenizer(fast_task: Task, tmp_path: Path) -> None:
    config = load_config(None, FAST)
    export_weights(fast_task.build_model(), tmp_path, to_yaml(config), task=fast_task)

    exported = sorted(path.name for path in (tmp_path / "export").iterdir())
    assert exported == ["config.yaml", "model.safetensors", "model_settings.json"]


def test_a_future_byte_does_not_change_the_logits_before_it(fast_task: Task) -> None:
    torch.manual_seed(0)
    model = fast_task.build_model().eval()
    tokens = torch.randint(VOCAB_SIZE, (2, fast_task.config.block_size))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB_SIZE
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_flops_per_sample_match_a_hand_count() -> None:
    """6 per parameter (position embedding excepted) and 12 L C T for attention, per token."""
    config = TaskConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)
    task = Task(config, seed=0)
    width, length = 16, 8
    per_layer = 2 * (2 * width) + (width * 3 * width + 3 * width) + (width * width + width)
    per_layer += (width * 4 * width + 4 * width) + (4 * width * width + width)
    params = 2 * per_layer + 2 * width + VOCAB_SIZE * width  # blocks, final norm, tied embedding
    per_token = 6 * params + 12 * 2 * width * length
    assert task.flops_per_sample(task.build_model()) == per_token * length


@pytest.mark.parametrize(
    ("preset", "num_params"),
    [("gpt-small.yaml", 10_844_160), ("gpt2-124m.yaml", 86_039_040)],
)
def test_presets_load_and_build_the_model_they_name(preset: str, num_params: int) -> None:
    config = load_config(PROJECT_ROOT / "configs" / preset)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = Task(config.task, seed=0).build_model()
    assert sum(param.numel() for param in model.parameters()) == num_params


def test_the_gpt2_124m_preset_on_gpt2s_vocabulary_is_gpt2_124m(tmp_path: Path) -> None:
    """What `make gpu-check` measures (benchmarks/gpu_check.py): the preset's layers with
    random tokens of GPT-2's 50,257, not 256 bytes: 124.4M parameters, not 86.0M."""
    tokens = random_shards(tmp_path / "tokens", 50_257, {"train": 2050, "eval": 1025})
    config = load_config(PROJECT_ROOT / "configs" / "gpt2-124m.yaml", [f"task.data_dir={tokens}"])
    with torch.device("meta"):
        model = Task(config.task, seed=0).build_model()
    assert sum(param.numel() for param in model.parameters()) == 124_439_808


def _eval_loss_before_and_after_training(rank: int, world_size: int, run_dir: Path) -> tuple:
    config = load_config(None, [*FAST, f"run.dir={run_dir}", "train.max_steps=30"])
    trainer = make_trainer(config, env_for(rank, world_size))
    before = trainer.evaluate()["loss"]
    trainer.fit()
    return before, trainer.evaluate()["loss"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_lower_the_loss_from_guessing_bytes(tmp_path: Path) -> None:
    """From about ln 256 (every byte equally likely) to well below it in 30 steps."""
    results = spawn(2, _eval_loss_before_and_after_training, tmp_path / "run", workdir=tmp_path)
    assert results[0] == results[1]
    before, after = results[0]
    assert before == pytest.approx(math.log(VOCAB_SIZE), abs=0.5)
    assert after < before - 1.5
