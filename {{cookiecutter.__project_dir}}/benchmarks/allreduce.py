"""All-reduce bandwidth over a sweep of message sizes, for each backend this machine offers.

Run it under torchrun with the processes you train with (one per GPU, or a few on CPU):

    torchrun --standalone --nproc-per-node=2 benchmarks/allreduce.py
    torchrun --standalone --nproc-per-node=gpu benchmarks/allreduce.py --json allreduce.json

gloo all-reduces CPU tensors (CPU training, and the stop and barrier traffic of GPU training);
NCCL all-reduces CUDA tensors, and is measured when a GPU is visible. DDP's gradient buckets
are `dist.bucket_cap_mb` (25 MiB) at most, so the sizes around it are the ones training sees.

For each size, every rank times each of `--iters` in-place SUM all-reduces of float32 after
`--warmup` untimed ones (NCCL with CUDA events, gloo with the wall clock). An all-reduce is
done when the slowest rank has its result, so an iteration's time is the largest over the ranks,
and the table reports the median over the iterations. The bandwidths are those of nccl-tests:

- algbw = S / t: the message size in bytes over that time;
- busbw = algbw * 2 (n - 1) / n: a ring all-reduce moves 2 (n - 1) / n of the message through
  every rank's links, so busbw compares with the hardware's link bandwidth whatever the number
  of ranks n, and is what to compare between machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ELEMENT_BYTES = 4  # float32
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from '4096', '4K', '256M' or '1G' (powers of 1024)."""
    number, unit = text.rstrip("KMGkmg"), text[len(text.rstrip("KMGkmg")) :].upper()
    if not number.isdigit() or unit not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 4K, 256M or 1G")
    size = int(number) * UNITS[unit]
    if size < ELEMENT_BYTES or size % ELEMENT_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes are whole float32 elements (4 bytes)")
    return size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="All-reduce time, algbw and busbw over message sizes (run under torchrun).",
        epilog="Example: torchrun --standalone --nproc-per-node=2 benchmarks/allreduce.py",
    )
    parser.add_argument("--min-size", type=parse_size, default="4K", help="smallest message")
    parser.add_argument("--max-size", type=parse_size, default="256M", help="largest message")
    parser.add_argument("--factor", type=int, default=4, help="each size is the last times this")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces per size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size")
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=["gloo", "nccl"],
        help="default: gloo, and nccl when a GPU is visible",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.min_size > args.max_size:
        parser.error("--min-size is larger than --max-size")
    if args.factor < 2 or args.iters < 1 or args.warmup < 0:
        parser.error("--factor must be at least 2, --iters at least 1, --warmup at least 0")
    if args.backends is None:
        args.backends = ["gloo", "nccl"] if torch.cuda.is_available() else ["gloo"]
    if "nccl" in args.backends and not torch.cuda.is_available():
        parser.error("nccl all-reduces CUDA tensors, and no GPU is visible: use --backends gloo")
    return args


def sizes(smallest: int, largest: int, factor: int) -> list[int]:
    found = [smallest]
    while found[-1] * factor <= largest:
        found.append(found[-1] * factor)
    return found


def check_sum(tensor: torch.Tensor, group: dist.ProcessGroup, world_size: int) -> None:
    """One all-reduce of rank + 1 on every rank must give 1 + 2 + ... + n everywhere."""
    tensor.fill_(dist.get_rank() + 1)
    dist.all_reduce(tensor, group=group)
    expected = world_size * (world_size + 1) / 2
    if not bool((tensor == expected).all()):
        raise RuntimeError(f"all-reduce of {tensor.numel()} elements gave a wrong sum")


def time_all_reduces(
    tensor: torch.Tensor, group: dist.ProcessGroup, iters: int, warmup: int
) -> list[float]:
    """This rank's time of each of `iters` all-reduces, in seconds."""
    for _ in range(warmup):
        dist.all_reduce(tensor, group=group)
    if tensor.is_cuda:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for start, end in events:
            start.record()
            dist.all_reduce(tensor, group=group)
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - start)
    return times


def sweep(backend: str, group: dist.ProcessGroup, args: argparse.Namespace) -> list[dict]:
    world_size = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    results = []
    for size in sizes(args.min_size, args.max_size, args.factor):
        tensor = torch.empty(size // ELEMENT_BYTES, dtype=torch.float32, device=device)
        check_sum(tensor, group, world_size)
        tensor.zero_()  # repeated sums of zeros stay finite
        local = torch.tensor(time_all_reduces(tensor, group, args.iters, args.warmup))
        dist.all_reduce(local, op=dist.ReduceOp.MAX)  # on the default (gloo) group
        seconds = statistics.median(local.tolist())
        algbw = size / seconds / 1e9
        results.append(
            {
                "backend": backend,
                "bytes": size,
                "time_us": seconds * 1e6,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (world_size - 1) / world_size,
            }
        )
        del tensor
    return results


def human(size: int) -> str:
    for unit in ("G", "M", "K"):
        if size >= UNITS[unit] and size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]} {unit}iB"
    return f"{size} B"


def table(results: list[dict], world_size: int) -> str:
    lines = [
        f"all-reduce (SUM, float32, in place) on {world_size} ranks; median of the iterations",
        f"{'backend':<8} {'size':>9} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}",
    ]
    for row in results:
        lines.append(
            f"{row['backend']:<8} {human(row['bytes']):>9} {row['time_us']:>12.1f} "
            f"{row['algbw_gbps']:>13.3f} {row['busbw_gbps']:>13.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print(
            "error: run under torchrun, e.g. "
            "torchrun --standalone --nproc-per-node=2 benchmarks/allreduce.py",
            file=sys.stderr,
        )
        return 2
    dist.init_process_group("gloo")
    try:
        results = []
        for backend in args.backends:
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                group = dist.new_group(backend="nccl")
            else:
                group = dist.group.WORLD
            results += sweep(backend, group, args)
        world_size = dist.get_world_size()
        if dist.get_rank() == 0:
            print(table(results, world_size), flush=True)
            if args.json:
                record = {
                    "world_size": world_size,
                    "iters": args.iters,
                    "warmup": args.warmup,
                    "torch": torch.__version__,
                    "results": results,
                }
                args.json.write_text(json.dumps(record, indent=2) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
