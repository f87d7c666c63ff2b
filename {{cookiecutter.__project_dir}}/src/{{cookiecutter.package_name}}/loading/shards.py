"""Token shards: the format `prepare` writes, and the data set of fixed-length windows over it.

A shard directory holds `manifest.json` and the shard files, e.g. `train_000000.bin`: raw
little-endian arrays of token ids, uint16 (uint32 for vocabularies over 65,536). The manifest
names the tokenizer (its kind, the SHA-256 of its tokenizer.json, its vocabulary size), the dtype,
the shard size, and per split ("train", "eval") each shard's file, token count and SHA-256.
A Hugging Face tokenizer is kept beside them, as `tokenizer.json`.

Training reads each window with one positioned read (pread) from shard files opened in each
process that reads (a DataLoader worker opens its own): resident memory does not grow with the
corpus. Not memory maps: every page a map has touched counts in the process's resident memory,
and the kernel maps whole runs of cached pages at once, so random windows over a 1 GB corpus
made a mapped process's resident memory 1 GB larger within a few thousand windows. The pages
read still sit in the kernel's page cache, shared and given back under memory pressure. Sample i
is a pure function of i, so the sampler alone decides the order, as for any other data set.

Check every shard's SHA-256: `python -m {{ cookiecutter.package_name }}.loading.shards DIR`.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError

#: Version of the manifest's layout; a reader refuses any other.
FORMAT = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "eval")
PREPARE = "python -m {{ cookiecutter.package_name }}.prepare"


class ShardError(ConfigError):
    """The shard directory is missing, incomplete, damaged or does not match what was asked.

    A ConfigError, so that training stops with the message (exit status 2), not a traceback.
    """


def token_dtype(vocab_size: int) -> str:
    """The narrowest little-endian unsigned type that holds every token id of the vocabulary."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ShardError(
        f"a vocabulary of {vocab_size} tokens is too large: token ids are stored as uint32, "
        f"so at most {2**32} tokens. Use a smaller vocabulary."
    )


@dataclass
class Manifest:
    """What manifest.json holds. `complete` is set once every shard of both splits is written.

    `source` describes the input (files and their sizes, the held-out fraction...) so that a
    relaunch of prepare can tell whether it would write the same bytes. Each shard entry is
    {"file", "tokens", "sha256"} plus prepare's position in its input after that shard.
    """

    tokenizer: dict[str, Any]
    dtype: str
    shard_tokens: int
    source: dict[str, Any]
    splits: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {split: [] for split in SPLITS}
    )
    complete: bool = False
    format: int = FORMAT

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def tokens(self, split: str) -> int:
        return sum(shard["tokens"] for shard in self.splits[split])

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"


def read_manifest(directory: Path | str) -> Manifest:
    """The manifest of `directory`, or a ShardError that says how to make one."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ShardError(
            f"{path} does not exist: {directory} holds no prepared shards. Prepare them with "
            f"`{PREPARE} SOURCE... --output {directory}`."
        )
    invalid = f"{path} is not a valid manifest; prepare the corpus again into a new directory"
    try:
        values = json.loads(path.read_text())
    except ValueError as error:
        raise ShardError(f"{invalid} ({error})") from error
    if not isinstance(values, dict) or values.get("format") != FORMAT:
        found = values.get("format") if isinstance(values, dict) else None
        raise ShardError(
            f"{path} is of format {found!r}; this version reads format {FORMAT}. Prepare the "
            f"corpus again with this version's `{PREPARE}`."
        )
    try:
        return Manifest(**values)
    except TypeError as error:
        raise ShardError(f"{invalid} ({error})") from error


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Replace manifest.json atomically: a kill leaves the old manifest or the new one."""
    write_atomically(directory / MANIFEST, manifest.to_json().encode())


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to a temporary name, flush it to disk, then rename it to `path`."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def random_shards(
    directory: Path,
    vocab_size: int,
    tokens: dict[str, int],
    shard_tokens: int = 100_000_000,
    seed: int = 0,
) -> Path:
    """A complete shard directory of random tokens of a `vocab_size` vocabulary, `tokens[split]`
    in each split: what the benchmarks train and read at a given vocabulary without a corpus
    (a step's speed does not depend on the tokens' values)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = token_dtype(vocab_size)
    stored = np.dtype(dtype).newbyteorder("<")
    manifest = Manifest({"kind": "random", "vocab_size": vocab_size}, dtype, shard_tokens, {})
    for split, count in tokens.items():
        for index, start in enumerate(range(0, count, shard_tokens)):
            name = f"{split}_{index:06d}.bin"
            size = min(shard_tokens, count - start)
            data = rng.integers(0, vocab_size, size, dtype=dtype).astype(stored).tobytes()
            write_atomically(directory / name, data)
            digest = hashlib.sha256(data).hexdigest()
            manifest.splits[split].append({"file": name, "tokens": size, "sha256": digest})
    manifest.complete = True
    write_manifest(directory, manifest)
    return directory


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def shard_problem(
    directory: Path, manifest: Manifest, shard: dict[str, Any], checksum: bool = False
) -> str | None:
    """What is wrong with one shard of the manifest (missing, wrong size, wrong SHA-256), or
    None when it is intact. Without `checksum` only the size is checked: cheap at every start."""
    path = directory / shard["file"]
    expected = shard["tokens"] * manifest.itemsize
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"shard {path} is missing (the manifest lists it with {shard['tokens']} tokens)"
    if size != expected:
        return (
            f"shard {path} holds {size} bytes, but the manifest lists {shard['tokens']} tokens "
            f"of {manifest.dtype} ({expected} bytes): it is truncated or damaged"
        )
    if checksum and sha256_file(path) != shard["sha256"]:
        return f"shard {path} does not match its SHA-256 in the manifest: it is damaged"
    return None


def verify_shards(
    directory: Path | str, splits: tuple[str, ...] = SPLITS, checksums: bool = False
) -> Manifest:
    """The manifest of a completely prepared directory whose shards are all there at their
    sizes (and match their SHA-256 with `checksums`); else a ShardError naming the first bad
    file and the fix."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if not manifest.complete:
        raise ShardError(
            f"{directory} is not completely prepared (prepare was stopped before the end): run "
            "the same prepare command again to finish it; it keeps the shards already written."
        )
    for split in splits:
        for shard in manifest.splits[split]:
            problem = shard_problem(directory, manifest, shard, checksums)
            if problem:
                raise ShardError(
                    f"{problem}. Copy the file back, or run the same prepare command again: it "
                    "checks every shard and writes the missing or damaged ones anew."
                )
    return manifest


class TokenWindows(Dataset):
    """Sample i is tokens i * block_size to (i + 1) * block_size of one split, both included.

    It is returned as (inputs, targets), the targets being the inputs shifted by one token.
    Consecutive windows share one token, so each token is a target once per epoch. The split's
    shards are read as one sequence: a window may span two shards. `num_samples` > 0 takes only
    the first that many windows.

    The shard files are opened at their first read in each process and never pickled: a
    DataLoader worker opens its own. A window costs one read per shard it spans, of its own
    bytes only, so memory holds no more of the corpus than the batches being made.
    """

    def __init__(
        self, directory: Path | str, split: str, block_size: int, num_samples: int = 0
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        directory = Path(directory)
        manifest = verify_shards(directory, (split,))
        shards = manifest.splits[split]
        self.files = [directory / shard["file"] for shard in shards]
        self.ends = np.cumsum([shard["tokens"] for shard in shards]).tolist()
        #: The split's content, from its shards' digests: the ranks compare it before training.
        digests = "".join(shard["sha256"] for shard in shards)
        self.fingerprint = hashlib.sha256(digests.encode()).hexdigest()
        self.dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self.block_size = block_size
        tokens = self.ends[-1] if self.ends else 0
        available = max(0, (tokens - 1) // block_size)
        if available == 0 or num_samples > available:
            wanted = f"{num_samples} were asked for" if num_samples else "at least one is needed"
            raise ShardError(
                f"the {split} split of {directory} ({tokens} tokens) holds {available} windows "
                f"of block_size + 1 = {block_size + 1} tokens, but {wanted}. Prepare more text, "
                "or use a smaller block size or fewer samples."
            )
        self.num_samples = num_samples or available
        self._files: dict[int, int] = {}  # shard -> file descriptor, in this process
        self._pid = -1

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"window {index} outside 0..{self.num_samples - 1}")
        start = index * self.block_size
        window = torch.from_numpy(self.read(start, start + self.block_size + 1).astype(np.int64))
        return window[:-1], window[1:]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens start to stop (excluded) of the split, across shard boundaries."""
        shard = bisect.bisect_right(self.ends, start)
        pieces = []
        while start < stop:
            first = self.ends[shard - 1] if shard else 0
            end = min(stop, self.ends[shard])
            size = self.dtype.itemsize
            data = os.pread(self._file(shard), (end - start) * size, (start - first) * size)
            pieces.append(np.frombuffer(data, dtype=self.dtype))
            start, shard = end, shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _file(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked worker: the parent's descriptors are not its own
            self._files, self._pid = {}, os.getpid()
        if shard not in self._files:
            self._files[shard] = os.open(self.files[shard], os.O_RDONLY)
        return self._files[shard]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}, "_pid": -1}

    def __del__(self) -> None:
        if getattr(self, "_pid", -1) == os.getpid():
            for descriptor in self._files.values():
                os.close(descriptor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check every shard of a prepared directory against the SHA-256 of its "
        "manifest (training checks only their sizes)."
    )
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    try:
        manifest = verify_shards(args.directory, checksums=True)
    except ShardError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    counts = ", ".join(
        f"{split} {manifest.tokens(split)} tokens in {len(manifest.splits[split])} shards"
        for split in SPLITS
    )
    print(f"{args.directory}: intact ({counts}; {manifest.dtype}, {manifest.vocab_size} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
