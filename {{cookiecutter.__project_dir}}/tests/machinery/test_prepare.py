"""The prepare command: text files in, token shards out, the same bytes however it is run."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from {{ cookiecutter.package_name }} import prepare
from {{ cookiecutter.package_name }}.loading.shards import SPLITS, verify_shards
from {{ cookiecutter.package_name }}.prepare import main

#: Shards of 1000 tokens, every fifth document held out: a corpus of 20 kB has many of both.
SMALL = ["--shard-tokens=1000", "--eval-fraction=0.2"]
FILES = ("a.txt", "b.txt", "sub/c.txt", "sub/d.txt", "sub/e.txt")


@pytest.fixture(autouse=True)
def small_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents of at most 700 bytes instead of 1 MiB: each file is cut into several."""
    monkeypatch.setattr(prepare, "DOCUMENT_BYTES", 700)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """Five files of lines in two directories, plus an empty file and a hidden one."""
    rng = random.Random(0)
    words = ["the", "cat", "sees", "a", "dog", "near", "river", "boat", "and"]
    root = tmp_path / "corpus"
    for name in (*FILES, "sub/.hidden"):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(120)]
        path.write_text("\n".join(lines) + "\n")
    (root / "empty.txt").touch()
    return root


def run(corpus: Path, output: Path, *options: str) -> int:
    return main([str(corpus), f"--output={output}", *SMALL, *options])


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def stream(directory: Path, split: str) -> np.ndarray:
    """A split's tokens, every shard in order."""
    manifest = verify_shards(directory, checksums=True)
    shards = [np.fromfile(directory / shard["file"], "<u2") for shard in manifest.splits[split]]
    return np.concatenate(shards) if shards else np.zeros(0, "<u2")


def test_the_byte_tokenizer_writes_the_files_in_order_each_followed_by_a_nul(
    corpus: Path, tmp_path: Path
) -> None:
    """Sorted by path; the empty file adds nothing, the hidden one is left out."""
    assert run(corpus, tmp_path / "out", "--eval-fraction=0") == 0
    expected = b"".join((corpus / name).read_bytes() + b"\0" for name in FILES)
    assert stream(tmp_path / "out", "train").astype(np.uint8).tobytes() == expected
    manifest = verify_shards(tmp_path / "out")
    assert (manifest.dtype, manifest.vocab_size, manifest.shard_tokens) == ("uint16", 256, 1000)
    assert [shard["tokens"] for shard in manifest.splits["train"]][:-1] == [1000] * (
        len(expected) // 1000
    )


def test_every_fifth_document_of_whole_lines_is_held_out_for_evaluation(
    corpus: Path, tmp_path: Path
) -> None:
    assert run(corpus, tmp_path / "out") == 0
    train, held_out = (
        stream(tmp_path / "out", split).astype(np.uint8).tobytes() for split in SPLITS
    )
    text = b"".join((corpus / name).read_bytes() for name in FILES)
    assert len(train) + len(held_out) - (train + held_out).count(b"\0") == len(text)
    assert 0.15 < len(held_out) / len(text) < 0.25
    for document in held_out.split(b"\0")[:-1]:
        assert document.endswith(b"\n") and b"\n" + document in b"\n" + text


def test_one_and_two_workers_write_the_same_bytes(corpus: Path, tmp_path: Path) -> None:
    assert run(corpus, tmp_path / "one", "--workers=1") == 0
    assert run(corpus, tmp_path / "two", "--workers=2") == 0
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")


def test_a_killed_prepare_continues_where_it_stopped_and_writes_the_same_bytes(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Killed while it writes its tenth shard: the relaunch keeps the nine finished ones, of
    both splits."""
    assert run(corpus, tmp_path / "whole", "--workers=2") == 0
    write_shard, written = prepare.write_shard, []

    def killed_in_the_tenth(path: Path, pieces: list[np.ndarray]) -> str:
        if len(written) == 9:
            path.with_name(f".{path.name}.tmp").write_bytes(b"half a shard")
            raise KeyboardInterrupt
        written.append(path)
        return write_shard(path, pieces)

    monkeypatch.setattr(prepare, "write_shard", killed_in_the_tenth)
    assert run(corpus, tmp_path / "out", "--workers=2") == 130
    assert {path.name[:4] for path in written} == {"trai", "eval"}
    assert "run the same command again" in capsys.readouterr().err
    kept = {path: path.stat().st_ino for path in written}
    monkeypatch.setattr(prepare, "write_shard", write_shard)
    assert run(corpus, tmp_path / "out", "--workers=1") == 0
    assert files_of(tmp_path / "out") == files_of(tmp_path / "whole")
    assert {path: path.stat().st_ino for path in written} == kept


def test_a_damaged_shard_is_written_again_by_the_same_command(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert run(corpus, tmp_path / "out") == 0
    whole = files_of(tmp_path / "out")
    with open(tmp_path / "out" / "train_000002.bin", "r+b") as handle:
        handle.write(b"\xff")
    (tmp_path / "out" / "eval_000001.bin").unlink()
    assert run(corpus, tmp_path / "out") == 0
    err = capsys.readouterr().err
    assert "train_000002.bin does not match its SHA-256" in err
    assert "eval_000001.bin is missing" in err
    assert files_of(tmp_path / "out") == whole


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--train-tokenizer=300"], "its tokenizer is the byte tokenizer, this command's is a BPE"),
        (["--shard-tokens=500"], "its shards hold 1000 tokens, this command's 500"),
        (["more"], r"its sources differ: file 7 was no file, is now .*more\.txt \(5 bytes\)"),
    ],
    ids=["tokenizer", "shard-size", "sources"],
)
def test_a_directory_prepared_otherwise_is_refused_naming_the_difference(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture, change: list[str], message: str
) -> None:
    assert run(corpus, tmp_path / "out") == 0
    before = files_of(tmp_path / "out")
    if change == ["more"]:
        (corpus / "sub" / "more.txt").write_text("more\n")
        change = []
    assert run(corpus, tmp_path / "out", *change) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Prepare into a new directory" in err
    assert files_of(tmp_path / "out") == before


@pytest.mark.parametrize(
    ("sources", "options", "message"),
    [
        (["missing/*.txt"], [], "no file matches the source 'missing/\\*.txt'"),
        (["corpus/empty.txt"], [], "all empty: there is nothing to prepare"),
        (["corpus/a.txt"], ["--eval-fraction=0.1"], "cannot be split between training and eval"),
        (
            ["corpus"],
            ["--train-tokenizer=4294967297"],
            "vocabulary of 4294967297 tokens is too large",
        ),
        (["corpus"], ["--train-tokenizer=256"], "needs more than 256 tokens"),
        (["corpus"], ["--tokenizer=none.json"], "--tokenizer none.json: no such file"),
        (["corpus"], ["--eval-fraction=1"], r"--eval-fraction must be in \[0, 1\)"),
    ],
    ids=[
        "no-match",
        "empty",
        "one-document",
        "vocab-too-large",
        "vocab-too-small",
        "no-tokenizer-file",
        "eval-fraction",
    ],
)
def test_bad_input_is_refused_and_leaves_no_manifest(
    corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    sources: list[str],
    options: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(prepare, "DOCUMENT_BYTES", 1 << 20)
    assert main([*sources, "--output=out", *options]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_an_unreadable_file_is_named_and_leaves_no_manifest(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def refused(path: Path, *args: object) -> object:
        if Path(path).name == "b.txt":
            raise PermissionError(13, "Permission denied")
        return open(path, *args)

    monkeypatch.setattr(prepare, "open", refused, raising=False)
    assert run(corpus, tmp_path / "out") == 2
    assert re.search(r"cannot read .*b\.txt: .*Permission denied", capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_trained_on_the_corpus_is_kept_with_the_shards_and_decodes_them(
    corpus: Path, tmp_path: Path
) -> None:
    import tokenizers  # the tokenizers extra, part of the dev extra

    assert run(corpus, tmp_path / "out", "--train-tokenizer=300", "--eval-fraction=0") == 0
    manifest = verify_shards(tmp_path / "out")
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    end_of_text = tokenizer.token_to_id("<|endoftext|>")
    assert manifest.tokenizer["kind"] == "hf"
    assert manifest.vocab_size == tokenizer.get_vocab_size() <= 300
    assert manifest.tokenizer["end_of_text"] == end_of_text
    tokens = stream(tmp_path / "out", "train")
    documents = np.split(tokens, np.flatnonzero(tokens == end_of_text) + 1)[:-1]
    decoded = [tokenizer.decode(document.tolist()) for document in documents]
    assert decoded == [(corpus / name).read_text() for name in FILES]
