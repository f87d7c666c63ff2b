"""Token shards: windows read across shards, their checks, and the order of samples."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import DataConfig
from {{ cookiecutter.package_name }}.loading.data import build_train_loader
from {{ cookiecutter.package_name }}.loading.shards import (
    Manifest,
    ShardError,
    TokenWindows,
    main,
    random_shards,
    token_dtype,
    verify_shards,
    write_manifest,
)
from {{ cookiecutter.package_name }}.prepare import write_shard

BLOCK = 8


def make_shards(
    directory: Path, tokens: np.ndarray, shard_tokens: int, dtype: str = "uint16"
) -> Path:
    """`tokens` as the train split in shards of `shard_tokens`, and their first 50 as eval."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = Manifest({"kind": "byte", "vocab_size": 1000}, dtype, shard_tokens, {})
    for split, stream in (("train", tokens), ("eval", tokens[:50])):
        for start in range(0, len(stream), shard_tokens):
            name = f"{split}_{start // shard_tokens:06d}.bin"
            piece = stream[start : start + shard_tokens].astype(np.dtype(dtype).newbyteorder("<"))
            digest = write_shard(directory / name, [piece])
            manifest.splits[split].append({"file": name, "tokens": len(piece), "sha256": digest})
    manifest.complete = True
    write_manifest(directory, manifest)
    return directory


@pytest.fixture
def tokens() -> np.ndarray:
    """Distinct ids, so that a window's first token names it."""
    return np.random.default_rng(0).permutation(1000)[:203]


@pytest.fixture
def sharded(tmp_path: Path, tokens: np.ndarray) -> Path:
    return make_shards(tmp_path / "shards", tokens, shard_tokens=30)


def test_a_window_is_block_size_plus_one_tokens_and_the_targets_are_shifted_by_one(
    sharded: Path, tokens: np.ndarray
) -> None:
    windows = TokenWindows(sharded, "train", BLOCK)
    assert len(windows) == (203 - 1) // BLOCK
    inputs, targets = windows[3]
    assert inputs.dtype == torch.int64
    assert inputs.tolist() == tokens[3 * BLOCK : 4 * BLOCK].tolist()
    assert targets.tolist() == tokens[3 * BLOCK + 1 : 4 * BLOCK + 1].tolist()


def test_windows_across_shard_boundaries_equal_those_of_one_big_shard(
    tmp_path: Path, tokens: np.ndarray
) -> None:
    """Shards of 7 tokens: every window spans two or three of them."""
    one = TokenWindows(make_shards(tmp_path / "one", tokens, 1000), "train", BLOCK)
    many = TokenWindows(make_shards(tmp_path / "many", tokens, 7, "uint32"), "train", BLOCK)
    assert len(one) == len(many)
    for index in range(len(one)):
        assert all(torch.equal(a, b) for a, b in zip(one[index], many[index], strict=True))


def test_the_fingerprint_the_ranks_compare_follows_the_tokens(
    tmp_path: Path, tokens: np.ndarray
) -> None:
    """The same corpus prepared on two nodes has one fingerprint; another corpus another."""
    first = TokenWindows(make_shards(tmp_path / "a", tokens, 30), "train", BLOCK)
    again = TokenWindows(make_shards(tmp_path / "b", tokens, 30), "train", BLOCK)
    other = TokenWindows(make_shards(tmp_path / "c", tokens[::-1].copy(), 30), "train", BLOCK)
    assert first.fingerprint == again.fingerprint != other.fingerprint


def test_uint16_holds_65536_tokens_and_larger_vocabularies_take_uint32() -> None:
    assert token_dtype(256) == token_dtype(2**16) == "uint16"
    assert token_dtype(2**16 + 1) == token_dtype(2**32) == "uint32"
    with pytest.raises(ShardError, match="too large"):
        token_dtype(2**32 + 1)


def test_a_missing_shard_is_named_with_the_fix(sharded: Path) -> None:
    (sharded / "train_000002.bin").unlink()
    with pytest.raises(ShardError, match=r"train_000002\.bin is missing.*same prepare command"):
        TokenWindows(sharded, "train", BLOCK)


def test_a_truncated_shard_is_named_at_open(sharded: Path) -> None:
    with open(sharded / "train_000001.bin", "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(ShardError, match=r"train_000001\.bin holds 10 bytes.*truncated"):
        TokenWindows(sharded, "train", BLOCK)


def test_a_damaged_shard_is_found_by_the_checksum_check(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The size is checked at every start; the content when asked (the shards command)."""
    with open(sharded / "eval_000001.bin", "r+b") as handle:
        handle.write(b"\xff\xff")
    TokenWindows(sharded, "eval", BLOCK)  # the size is right
    with pytest.raises(ShardError, match=r"eval_000001\.bin does not match its SHA-256"):
        verify_shards(sharded, checksums=True)
    assert main([str(sharded)]) == 1
    assert "eval_000001.bin" in capsys.readouterr().err


def test_an_unfinished_preparation_is_refused(sharded: Path) -> None:
    manifest = verify_shards(sharded)
    manifest.complete = False
    write_manifest(sharded, manifest)
    with pytest.raises(ShardError, match=r"not completely prepared.*same prepare command"):
        TokenWindows(sharded, "train", BLOCK)


def test_a_split_too_short_for_the_samples_asked_is_refused(sharded: Path) -> None:
    with pytest.raises(ShardError, match=r"eval split .* holds 6 windows .* 7 were asked"):
        TokenWindows(sharded, "eval", BLOCK, num_samples=7)


def test_the_shard_files_are_opened_in_each_process_never_pickled(sharded: Path) -> None:
    windows = TokenWindows(sharded, "train", BLOCK)
    first = windows[0]
    copy = pickle.loads(pickle.dumps(windows))
    assert windows._files and not copy._files
    assert all(torch.equal(a, b) for a, b in zip(copy[0], first, strict=True))


def _global_batches(
    windows: TokenWindows, world_size: int, workers: int, start: int = 0
) -> list[list[int]]:
    """The first token of each window of each step's global batch of 8, from every rank's
    training loader, sorted."""
    per_rank = []
    for rank in range(world_size):
        loader, sampler = build_train_loader(
            windows,
            DistEnv(rank=rank, world_size=world_size),
            DataConfig(num_workers=workers, pin_memory=False, persistent_workers=False),
            micro_batch_size=8 // world_size,
            seed=3,
            device=torch.device("cpu"),
        )
        sampler.set_epoch(1, start_index=start * 8 // world_size)
        per_rank.append([inputs[:, 0].tolist() for inputs, _ in loader])
    return [sorted(itertools.chain(*step)) for step in zip(*per_rank, strict=True)]


@pytest.mark.timeout(120)
def test_the_batches_do_not_depend_on_ranks_or_workers_and_resume_mid_epoch(
    sharded: Path,
) -> None:
    windows = TokenWindows(sharded, "train", BLOCK)
    one = _global_batches(windows, world_size=1, workers=0)
    assert len(one) == len(windows) // 8
    assert _global_batches(windows, world_size=2, workers=2) == one
    assert _global_batches(windows, world_size=2, workers=0, start=2) == one[2:]


def test_random_shards_hold_a_vocabularys_ids_whole_and_checked(tmp_path: Path) -> None:
    """What the benchmarks train on at GPT-2's vocabulary: uint16 ids below 50,257, in shards
    whose checksums hold, read as windows like prepared ones."""
    directory = random_shards(tmp_path / "random", 50_257, {"train": 5000, "eval": 100}, 2000)
    manifest = verify_shards(directory, checksums=True)
    assert (manifest.vocab_size, manifest.dtype) == (50_257, "uint16")
    assert [shard["tokens"] for shard in manifest.splits["train"]] == [2000, 2000, 1000]
    windows = TokenWindows(directory, "train", BLOCK)
    ids = torch.cat([windows[index][0] for index in range(len(windows))])
    assert len(windows) == 4999 // BLOCK
    assert 40_000 < int(ids.max()) < 50_257  # the whole vocabulary, and no id past it
