"""Token shards at scale: resident memory against corpus size, loader and prepare throughput.

    python benchmarks/shards.py --json shards.json

1. `rss`: the peak resident memory of a training-like process (a fresh interpreter) that reads
   `--batches` batches of random windows through the project's training DataLoader, over shards
   of random uint16 tokens of each `--sizes-gb` (written with NumPy, not prepare). The goal:
   the same peak, within 50 MB, whatever the corpus size. `rss_anon_mb` is the process's own
   memory; `rss_file_mb` the pages of the shards it has read (page cache, given back under
   memory pressure).
2. `loader`: the windows a rank's DataLoader delivers per second (data.* settings as given),
   in tokens per second, to set against the tokens per second the model trains on.
3. `prepare`: the prepare command's throughput on a generated text corpus of `--corpus-mb`, byte
   tokenizer, with 1 and with 2 workers, in MB of text per second and per worker.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.loading.data import build_train_loader
from {{ cookiecutter.package_name }}.loading.shards import TokenWindows, random_shards
from {{ cookiecutter.package_name }}.prepare import main as prepare


def read_batches(
    directory: Path, batches: int, block: int, overrides: list[str]
) -> dict[str, float]:
    """Read `batches` batches of windows of `block` tokens as a single rank's training loop
    does; the figures of this process."""
    config = load_config(None, overrides)
    windows = TokenWindows(directory, "train", block)
    micro = config.train.micro_batch_size
    loader, sampler = build_train_loader(
        windows, DistEnv(), config.data, micro, config.run.seed, torch.device("cpu")
    )
    sampler.set_epoch(0)
    iterator = iter(loader)
    next(iterator)  # workers started, first batch
    started = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    elapsed = time.perf_counter() - started
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    # VmHWM, not getrusage's ru_maxrss: that one keeps the launching process's peak across exec.
    keys = ("VmHWM", "RssAnon", "RssFile")
    megabytes = {key: int(status[key].split()[0]) / 1024 for key in keys}
    return {
        "peak_rss_mb": megabytes["VmHWM"],
        "rss_anon_mb": megabytes["RssAnon"],
        "rss_file_mb": megabytes["RssFile"],
        "tokens_per_s": batches * micro * block / elapsed,
        "block_size": block,
        "micro_batch_size": micro,
    }


def in_fresh_process(
    directory: Path, batches: int, block: int, overrides: list[str]
) -> dict[str, float]:
    """read_batches in a new interpreter: its peak memory is its own."""
    command = [sys.executable, __file__, "--read", str(directory), f"--batches={batches}"]
    command.append(f"--block-size={block}")
    result = subprocess.run([*command, *overrides], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"reading {directory} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def text_corpus(directory: Path, megabytes: int) -> Path:
    """Files of 4 MB of sentences from a small vocabulary: text to tokenize, nothing more."""
    directory.mkdir(parents=True)
    rng = random.Random(0)
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)
    ]
    lines = [" ".join(rng.choices(words, k=rng.randint(5, 20))) + ".\n" for _ in range(20000)]
    block = "".join(lines).encode()
    for index in range(max(1, megabytes // 4)):
        size, parts = 0, []
        while size < 4_000_000:
            parts.append(block)
            size += len(block)
        (directory / f"part_{index:04d}.txt").write_bytes(b"".join(parts)[:4_000_000])
    return directory


def prepare_throughput(corpus: Path, output: Path, workers: int) -> dict[str, float]:
    megabytes = sum(path.stat().st_size for path in corpus.iterdir()) / 1e6
    started = time.perf_counter()
    code = prepare([str(corpus), f"--output={output}", f"--workers={workers}"])
    elapsed = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"prepare failed with exit status {code}")
    shutil.rmtree(output)
    return {
        "workers": workers,
        "mb": megabytes,
        "seconds": elapsed,
        "mb_per_s": megabytes / elapsed,
        "mb_per_s_per_worker": megabytes / elapsed / workers,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Resident memory against corpus size, loader and prepare throughput."
    )
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.1, 1.0])
    parser.add_argument("--batches", type=int, default=200, help="batches read per size")
    parser.add_argument("--block-size", type=int, default=1024, help="tokens per window")
    parser.add_argument("--corpus-mb", type=int, default=64, help="text for prepare")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tmp", type=Path, help="for the corpora (default: the system's)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--read", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="settings of the reading process (train.micro_batch_size, data.num_workers...)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.read:
        figures = read_batches(args.read, args.batches, args.block_size, args.overrides)
        print(json.dumps(figures))
        return 0
    root = Path(tempfile.mkdtemp(prefix="shards-", dir=args.tmp))
    try:
        rss = {}
        for gigabytes in args.sizes_gb:
            tokens = {"train": int(gigabytes * 1e9) // 2, "eval": 10_000}  # uint16: 2 bytes each
            directory = random_shards(root / f"tokens-{gigabytes}", 65536, tokens)
            rss[f"{gigabytes:g}GB"] = in_fresh_process(
                directory, args.batches, args.block_size, args.overrides
            )
            shutil.rmtree(directory)
        peaks = [figures["peak_rss_mb"] for figures in rss.values()]
        corpus = text_corpus(root / "text", args.corpus_mb)
        record = {
            "rss": rss,
            "rss_peak_spread_mb": max(peaks) - min(peaks),
            "loader_tokens_per_s": min(figures["tokens_per_s"] for figures in rss.values()),
            "prepare": [
                prepare_throughput(corpus, root / "prepared", workers) for workers in args.workers
            ],
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(record, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
