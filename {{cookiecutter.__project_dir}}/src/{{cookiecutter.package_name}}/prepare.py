"""Turn text files into token shards for training (shards.py describes the format and reads it).

    python -m {{ cookiecutter.package_name }}.prepare \
        data/texts/ --output data/shards
    python -m {{ cookiecutter.package_name }}.prepare \
        'books/*.txt' --output data/bpe --train-tokenizer 16384

Sources are files, directories (every file below them, hidden ones excepted, sorted by path) and
glob patterns. Each file is cut into documents of at most 1 MiB that end at a line end where
there is one: the units of parallel work and of the held-out split. Document i goes to the
"eval" split when it crosses a multiple of 1 / --eval-fraction (evenly spread, whatever the
number of workers), the rest to "train". Each split is one stream of tokens, an end-of-text
token after each file (and wherever the stream skips documents of the other split), cut into
shards of --shard-tokens tokens. The bytes written do not depend on the number of workers.

Tokenizers: `byte` (the default: the 256 byte values are the tokens; nothing to download; the
end of a file is marked by a NUL byte, 0, which text never contains), a Hugging Face
tokenizer.json (`--tokenizer PATH`; its end-of-text token, e.g. <|endoftext|> or </s>, marks the
end of a file, or nothing when it has none), or one trained here on the training split
(`--train-tokenizer VOCAB_SIZE`: byte-level BPE as in GPT-2). Both need the `tokenizers` extra.

A killed run is continued by the same command: each shard is written under a temporary name and
renamed, the manifest lists the shards written so far, and a relaunch checks their SHA-256,
keeps the intact ones and goes on from there. A directory prepared with other sources, another
tokenizer or other settings is refused, naming the difference.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .loading.shards import (
    MANIFEST,
    SPLITS,
    TOKENIZER_FILE,
    Manifest,
    ShardError,
    read_manifest,
    sha256_file,
    shard_problem,
    token_dtype,
    write_atomically,
    write_manifest,
)
from .monitoring.logs import ProgressBar

#: The largest document: a file is cut into pieces of at most this many bytes.
DOCUMENT_BYTES = 1 << 20
#: How far past a cut a line end is looked for.
LINE_SEARCH_BYTES = 1 << 16
DEFAULT_SHARD_TOKENS = 100_000_000
#: End-of-text tokens of Hugging Face tokenizers, in the order they are looked for.
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]")
#: The byte tokenizer's end of a file: NUL, which text files do not contain.
BYTE_END_OF_TEXT = 0


@dataclass(frozen=True)
class Document:
    """Bytes start to stop of a file, the split it goes to, and whether an end-of-text token
    follows it in that split's stream."""

    path: str
    start: int
    stop: int
    split: str
    end_of_text: bool


@dataclass
class Tokenizer:
    """What the manifest records of the tokenizer, and the tokenizer.json workers load."""

    identity: dict[str, Any]
    path: Path | None = None


def find_files(sources: list[str]) -> list[Path]:
    """Every file the sources name, in order: directories walked and globs expanded, sorted."""
    files: dict[str, Path] = {}
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = [
                item
                for item in path.rglob("*")
                if item.is_file()
                and not any(part.startswith(".") for part in item.relative_to(path).parts)
            ]
        elif path.is_file():
            found = [path]
        else:
            found = [Path(name) for name in glob.glob(source, recursive=True)]
            found = [item for item in found if item.is_file()]
        if not found:
            raise ShardError(
                f"no file matches the source {source!r}: give files, directories "
                "or glob patterns of text files"
            )
        for item in sorted(found):
            files.setdefault(os.path.abspath(item), item)
    return [Path(name) for name in files]


def plan_documents(files: list[Path], eval_fraction: float) -> list[Document]:
    """The documents of the corpus, in order, each assigned to its split."""
    pieces: list[tuple[str, int, int]] = []
    for path in files:
        name = os.path.abspath(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as handle:
                start = 0
                while size - start > DOCUMENT_BYTES:
                    stop = _cut(handle, start + DOCUMENT_BYTES)
                    pieces.append((name, start, stop))
                    start = stop
        except OSError as error:
            raise ShardError(
                f"cannot read {path}: {error}. Fix its permissions or leave it out."
            ) from None
        if start < size:
            pieces.append((name, start, size))
    if not pieces:
        raise ShardError(
            f"the {len(files)} source file(s) are all empty: there is nothing to prepare"
        )
    splits = [
        "eval" if int((index + 1) * eval_fraction) > int(index * eval_fraction) else "train"
        for index in range(len(pieces))
    ]
    if eval_fraction > 0 and "eval" not in splits:
        if len(pieces) == 1:
            raise ShardError(
                f"the corpus is one document ({pieces[0][0]}, {pieces[0][2]} bytes), which "
                f"cannot be split between training and evaluation: give more text (a file is cut "
                f"into documents of {DOCUMENT_BYTES} bytes), or --eval-fraction 0"
            )
        splits[-1] = "eval"  # a small corpus still gets one held-out document
    documents = []
    for index, (name, start, stop) in enumerate(pieces):
        last = index + 1 == len(pieces)
        follows = not last and pieces[index + 1][0] == name and splits[index + 1] == splits[index]
        documents.append(Document(name, start, stop, splits[index], not follows))
    return documents


def _cut(handle: Any, position: int) -> int:
    """Where a document that would end at `position` ends: after the next line end, else at
    the next start of a UTF-8 character."""
    handle.seek(position)
    block = handle.read(LINE_SEARCH_BYTES)
    newline = block.find(b"\n")
    if newline >= 0:
        return position + newline + 1
    continuation = next((i for i, byte in enumerate(block) if byte & 0xC0 != 0x80), len(block))
    return position + continuation


def source_record(files: list[Path], eval_fraction: float) -> dict[str, Any]:
    """What the manifest records of the input: the same record means the same documents."""
    return {
        "files": [[os.path.abspath(path), path.stat().st_size] for path in files],
        "document_bytes": DOCUMENT_BYTES,
        "eval_fraction": eval_fraction,
    }


def load_tokenizer(path: Path, trained_vocab: int | None = None) -> Tokenizer:
    """A Hugging Face tokenizer.json: its SHA-256, vocabulary size and end-of-text token."""
    hf = _tokenizers()
    try:
        tokenizer = hf.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust library raises plain Exceptions
        raise ShardError(f"{path} is not a Hugging Face tokenizer.json: {error}") from error
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    token_dtype(vocab_size)  # refuses a vocabulary too large to store
    ids = [tokenizer.token_to_id(name) for name in END_OF_TEXT]
    end = next((token for token in ids if token is not None), None)
    identity = {
        "kind": "hf",
        "sha256": sha256_file(path),
        "vocab_size": vocab_size,
        "end_of_text": end,
        "trained_vocab": trained_vocab,
    }
    return Tokenizer(identity, path)


BYTE_TOKENIZER = Tokenizer(
    {
        "kind": "byte",
        "sha256": None,
        "vocab_size": 256,
        "end_of_text": BYTE_END_OF_TEXT,
        "trained_vocab": None,
    }
)


def train_tokenizer(documents: list[Document], vocab_size: int, path: Path) -> Tokenizer:
    """Byte-level BPE (as GPT-2's) with an <|endoftext|> token, trained on the training split
    and saved to `path`. The same documents give the same file."""
    hf = _tokenizers()
    tokenizer = hf.Tokenizer(hf.models.BPE())
    tokenizer.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT[0]],
        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    train = [document for document in documents if document.split == "train"]
    texts = (_read(document).decode("utf-8", errors="replace") for document in train)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(train))
    write_atomically(path, tokenizer.to_str().encode())
    return load_tokenizer(path, trained_vocab=vocab_size)


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ShardError(
            "a Hugging Face tokenizer needs the tokenizers package: pip install -e '.[tokenizers]'"
        ) from None
    return tokenizers


def _read(document: Document) -> bytes:
    try:
        with open(document.path, "rb") as handle:
            handle.seek(document.start)
            data = handle.read(document.stop - document.start)
    except OSError as error:
        raise ShardError(f"cannot read {document.path}: {error}") from None
    if len(data) != document.stop - document.start:
        raise ShardError(f"{document.path} became shorter while it was prepared: start again")
    return data


# Each worker process's tokenizer, loaded once by _start_worker (None: bytes).
_worker_tokenizer: Any = None


def _start_worker(tokenizer_path: str | None) -> None:
    global _worker_tokenizer
    if tokenizer_path is not None:
        _worker_tokenizer = _tokenizers().Tokenizer.from_file(tokenizer_path)


def _tokenize(job: tuple[list[Document], str, int | None]) -> list[np.ndarray]:
    """The tokens of each document, followed by the end-of-text token where it has one."""
    documents, dtype, end_of_text = job
    results = []
    for document in documents:
        data = _read(document)
        if _worker_tokenizer is None:
            ids: Any = np.frombuffer(data, dtype=np.uint8)
        else:
            text = data.decode("utf-8", errors="replace")
            ids = _worker_tokenizer.encode(text, add_special_tokens=False).ids
        extra = int(document.end_of_text and end_of_text is not None)
        tokens = np.empty(len(ids) + extra, dtype=dtype)
        tokens[: len(ids)] = ids
        if extra:
            tokens[-1] = end_of_text
        results.append(tokens)
    return results


def write_shard(path: Path, pieces: list[np.ndarray]) -> str:
    """Write the pieces as one file under a temporary name, then rename it; its SHA-256."""
    temporary = path.with_name(f".{path.name}.tmp")
    digest = hashlib.sha256()
    with open(temporary, "wb") as handle:
        for piece in pieces:
            data = np.ascontiguousarray(piece).data
            digest.update(data)
            handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    return digest.hexdigest()


class SplitWriter:
    """Cuts one split's stream of tokens into shards, and records each in the manifest.

    With each shard the manifest records where the stream goes on after it (document, tokens
    of it already written): a relaunch starts there.
    """

    def __init__(self, directory: Path, split: str, manifest: Manifest) -> None:
        self.directory, self.split, self.manifest = directory, split, manifest
        self.shards = manifest.splits[split]
        self.resume = tuple(self.shards[-1]["next"]) if self.shards else (0, 0)
        self.pending: deque[tuple[int, int, np.ndarray]] = deque()
        self.pending_tokens = 0

    def add(self, index: int, tokens: np.ndarray) -> None:
        offset = self.resume[1] if index == self.resume[0] else 0
        self.pending.append((index, offset, tokens[offset:]))
        self.pending_tokens += len(tokens) - offset
        while self.pending_tokens >= self.manifest.shard_tokens:
            self._write(self.manifest.shard_tokens)

    def finish(self) -> None:
        if self.pending_tokens:
            self._write(self.pending_tokens)

    def _write(self, count: int) -> None:
        pieces, left, last = [], count, 0
        while left:
            index, offset, tokens = self.pending.popleft()
            take = min(left, len(tokens))
            pieces.append(tokens[:take])
            left, last = left - take, index
            if take < len(tokens):
                self.pending.appendleft((index, offset + take, tokens[take:]))
        self.pending_tokens -= count
        after = [self.pending[0][0], self.pending[0][1]] if self.pending else [last + 1, 0]
        name = f"{self.split}_{len(self.shards):06d}.bin"
        digest = write_shard(self.directory / name, pieces)
        self.shards.append({"file": name, "tokens": count, "sha256": digest, "next": after})
        write_manifest(self.directory, self.manifest)


class _BytesBar(ProgressBar):
    """The progress bar of training, counting megabytes of text instead of steps."""

    def render(self, step: int, elapsed: float) -> str:
        done = step / max(1, self.total)
        bar = "#" * int(self.WIDTH * done) + "." * (self.WIDTH - int(self.WIDTH * done))
        rate = step / elapsed / 1e6 if elapsed > 0 else 0.0
        minutes, seconds = divmod(int((self.total - step) / 1e6 / rate if rate else 0), 60)
        return (
            f"{step / 1e6:.1f}/{self.total / 1e6:.1f} MB [{bar}] {done:4.0%} "
            f"{rate:.1f} MB/s, {minutes}:{seconds:02d} left"
        )


def prepare(
    sources: list[str],
    output: Path,
    tokenizer: str = "byte",
    train_vocab: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    eval_fraction: float = 0.005,
    workers: int = 1,
    progress: bool = False,
) -> Manifest:
    """Write (or finish, or check) the shards of `sources` in `output`; its manifest."""
    if shard_tokens < 1 or workers < 1:
        raise ShardError("--shard-tokens and --workers must be at least 1")
    if not 0 <= eval_fraction < 1:
        raise ShardError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if train_vocab is not None:
        token_dtype(train_vocab)
        if train_vocab <= 256:
            raise ShardError(
                f"--train-tokenizer {train_vocab}: the vocabulary needs more than 256 tokens "
                "(the 256 byte values and an end-of-text token)"
            )
    given = None if tokenizer == "byte" or train_vocab else Path(tokenizer)
    if given is not None and not given.is_file():
        raise ShardError(f"--tokenizer {given}: no such file; give a tokenizer.json or `byte`")
    files = find_files(sources)
    documents = plan_documents(files, eval_fraction)
    source = source_record(files, eval_fraction)
    if given is not None:
        requested = {"kind": "hf", "sha256": sha256_file(given), "trained_vocab": None}
    elif train_vocab is not None:
        requested = {"kind": "hf", "trained_vocab": train_vocab}
    else:
        requested = BYTE_TOKENIZER.identity
    existing = _existing_manifest(output)
    if existing is not None:
        _refuse_differences(output, existing, source, shard_tokens, requested)
    output.mkdir(parents=True, exist_ok=True)
    for stale in output.glob(".*.tmp"):
        stale.unlink()
    chosen = _tokenizer(output, existing, given, train_vocab, documents)
    vocab_size = chosen.identity["vocab_size"]
    manifest = Manifest(chosen.identity, token_dtype(vocab_size), shard_tokens, source)
    if existing is not None:
        if existing.tokenizer != chosen.identity:
            raise ShardError(
                f"{output} was prepared with a tokenizer trained to another result "
                f"({existing.tokenizer['sha256']} against {chosen.identity['sha256']}). "
                "Prepare into a new directory."
            )
        manifest.splits, manifest.complete = existing.splits, existing.complete
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )
    # Each worker tokenizes one document at a time: no thread pool inside a worker.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer_path = None if chosen.path is None else str(chosen.path)
    with context.Pool(workers, _start_worker, (tokenizer_path,)) as pool:
        _keep_intact_shards(output, manifest, pool)
        if manifest.complete:
            return manifest
        write_manifest(output, manifest)
        _write_shards(output, manifest, documents, pool, workers, progress)
    manifest.complete = True
    write_manifest(output, manifest)
    return manifest


def _existing_manifest(output: Path) -> Manifest | None:
    if (output / MANIFEST).exists():
        return read_manifest(output)
    if output.exists() and not output.is_dir():
        raise ShardError(f"--output {output} is a file: give a directory")
    ours = (TOKENIZER_FILE,)
    if output.exists() and any(
        item.name not in ours and not item.name.endswith(".tmp") for item in output.iterdir()
    ):
        raise ShardError(
            f"{output} is not empty and holds no {MANIFEST}: prepare into a new or empty directory"
        )
    return None


def _tokenizer(
    output: Path,
    existing: Manifest | None,
    given: Path | None,
    train_vocab: int | None,
    documents: list[Document],
) -> Tokenizer:
    """The tokenizer of the command; a given or trained one is kept in `output`, beside the
    tokens it decodes."""
    path = output / TOKENIZER_FILE
    if given is not None:
        identity = load_tokenizer(given).identity
        if given.resolve() != path.resolve():
            write_atomically(path, given.read_bytes())
        return Tokenizer(identity, path)
    if train_vocab is None:
        return BYTE_TOKENIZER
    if (
        existing is not None
        and path.is_file()
        and sha256_file(path) == existing.tokenizer["sha256"]
    ):
        return load_tokenizer(path, trained_vocab=train_vocab)  # trained by the first launch
    print(f"training a BPE tokenizer of {train_vocab} tokens", file=sys.stderr)
    return train_tokenizer(documents, train_vocab, path)


def _described(tokenizer: dict[str, Any]) -> str:
    """A tokenizer as a command asks for it, in words."""
    if tokenizer["kind"] == "byte":
        return "the byte tokenizer"
    if tokenizer.get("trained_vocab"):
        return f"a BPE tokenizer of {tokenizer['trained_vocab']} tokens trained on the corpus"
    return f"the tokenizer.json of SHA-256 {tokenizer['sha256'][:16]}..."


def _refuse_differences(
    output: Path,
    existing: Manifest,
    source: dict[str, Any],
    shard_tokens: int,
    requested: dict[str, Any],
) -> None:
    """A ShardError naming each setting in which the directory differs from the command: were
    it to continue there, the shards would not be those of one run."""
    differences = []
    if _described(existing.tokenizer) != _described(requested):
        differences.append(
            f"its tokenizer is {_described(existing.tokenizer)}, this command's is "
            f"{_described(requested)}"
        )
    if existing.shard_tokens != shard_tokens:
        differences.append(
            f"its shards hold {existing.shard_tokens} tokens, this command's {shard_tokens}"
        )
    for key in ("eval_fraction", "document_bytes"):
        if existing.source.get(key) != source[key]:
            differences.append(
                f"its {key} is {existing.source.get(key)}, this command's {source[key]}"
            )
    old, new = existing.source.get("files", []), source["files"]
    if old != new:
        first = next(
            (i for i, (was, now) in enumerate(zip(old, new, strict=False)) if was != now),
            min(len(old), len(new)),
        )
        was = "no file" if first >= len(old) else f"{old[first][0]} ({old[first][1]} bytes)"
        now = "no file" if first >= len(new) else f"{new[first][0]} ({new[first][1]} bytes)"
        differences.append(f"its sources differ: file {first + 1} was {was}, is now {now}")
    if differences:
        raise ShardError(
            f"{output} was prepared from other sources or settings: {'; '.join(differences)}. "
            "Prepare into a new directory, or delete this one to start again."
        )


def _keep_intact_shards(output: Path, manifest: Manifest, pool: Any) -> None:
    """Check the shards a previous launch wrote: each split keeps its intact ones up to the
    first missing or damaged one, which is written again with all that follow it."""
    for split in SPLITS:
        shards = manifest.splits[split]
        if not shards:
            continue
        print(f"checking the {len(shards)} {split} shards already written", file=sys.stderr)
        sizes = [shard_problem(output, manifest, shard) for shard in shards]
        paths = [
            None if problem else output / shard["file"]
            for problem, shard in zip(sizes, shards, strict=True)
        ]
        digests = pool.map(_digest_or_none, paths)
        for index, shard in enumerate(shards):
            problem = sizes[index]
            if problem is None and digests[index] != shard["sha256"]:
                problem = f"shard {paths[index]} does not match its SHA-256 in the manifest"
            if problem:
                print(
                    f"{problem}: it is written again, with the {len(shards) - index - 1} "
                    "shards after it",
                    file=sys.stderr,
                )
                manifest.splits[split] = shards[:index]
                manifest.complete = False
                break


def _digest_or_none(path: Path | None) -> str | None:
    return None if path is None else sha256_file(path)


def _write_shards(
    output: Path,
    manifest: Manifest,
    documents: list[Document],
    pool: Any,
    workers: int,
    progress: bool,
) -> None:
    writers = {split: SplitWriter(output, split, manifest) for split in SPLITS}
    todo = [i for i, document in enumerate(documents) if i >= writers[document.split].resume[0]]
    jobs = _jobs(todo, documents)
    end_of_text = manifest.tokenizer["end_of_text"]
    dtype = np.dtype(manifest.dtype).newbyteorder("<").str
    bar = _BytesBar(0, sum(documents[i].stop - documents[i].start for i in todo), progress)
    done = 0

    def write(batch: list[list[int]], results: Iterator[list[np.ndarray]]) -> None:
        nonlocal done
        for job, arrays in zip(batch, results, strict=True):
            for index, tokens in zip(job, arrays, strict=True):
                writers[documents[index].split].add(index, tokens)
                done += documents[index].stop - documents[index].start
            bar.update(done)

    # Two batches in flight: the workers tokenize one while the other is written, and memory
    # holds at most two batches of tokens, whatever the size of the corpus.
    in_flight: deque[tuple[list[list[int]], Iterator[list[np.ndarray]]]] = deque()
    size = 4 * workers
    for first in range(0, len(jobs), size):
        batch = jobs[first : first + size]
        work = [([documents[i] for i in job], dtype, end_of_text) for job in batch]
        in_flight.append((batch, pool.imap(_tokenize, work)))
        if len(in_flight) == 2:
            write(*in_flight.popleft())
    while in_flight:
        write(*in_flight.popleft())
    bar.close()
    for writer in writers.values():
        writer.finish()


def _jobs(todo: list[int], documents: list[Document]) -> list[list[int]]:
    """Consecutive documents grouped into jobs of about DOCUMENT_BYTES: many small files cost
    no more to hand to the workers than a few large ones."""
    jobs: list[list[int]] = []
    size = DOCUMENT_BYTES
    for index in todo:
        if size >= DOCUMENT_BYTES:
            jobs.append([])
            size = 0
        jobs[-1].append(index)
        size += documents[index].stop - documents[index].start
    return jobs


def default_workers() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Turn text files into token shards for training (task.data_dir=DIR).",
        epilog=f"Example: python -m {__package__}.prepare data/texts/ --output data/shards",
    )
    parser.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="text files, directories (read recursively) or glob patterns",
    )
    parser.add_argument("--output", type=Path, required=True, help="the shard directory")
    tokenizers = parser.add_mutually_exclusive_group()
    tokenizers.add_argument(
        "--tokenizer",
        default="byte",
        help="`byte` (default) or the path of a Hugging Face tokenizer.json",
    )
    tokenizers.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB_SIZE",
        help="train a byte-level BPE tokenizer of this size on the corpus",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help="tokens per shard (default: %(default)s)",
    )
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=0.005,
        help="share of the documents held out for evaluation (default: %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="processes that tokenize (default: the cores, %(default)s)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        manifest = prepare(
            args.sources,
            args.output,
            tokenizer=args.tokenizer,
            train_vocab=args.train_tokenizer,
            shard_tokens=args.shard_tokens,
            eval_fraction=args.eval_fraction,
            workers=args.workers,
            progress=True,
        )
    except ShardError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"interrupted: run the same command again to continue in {args.output}", file=sys.stderr
        )
        return 130
    counts = ", ".join(
        f"{split} {manifest.tokens(split)} tokens in {len(manifest.splits[split])} shards"
        for split in SPLITS
    )
    print(
        f"{args.output}: {counts} ({manifest.dtype}, vocabulary {manifest.vocab_size}) in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
