"""`make bench`: the generated Trainer against a plain DDP loop and Lightning; docs/benchmarks.md.

Renders the default project into build/bench and measures it on 2 CPU processes (gloo,
OMP_NUM_THREADS=1) with the default task's MLP at micro-batch 32 in fp32:

1. step time, in one torchrun launch where the loops take turns (side_by_side.py): the
   project's Trainer, its benchmarks/overhead.py plain loop and Lightning's Trainer at the
   default batch; the Trainer and the plain loop with and without `no_sync` at accumulation 4;
2. launch to first step: from starting torchrun to the end of the first optimizer step, for
   the project's own entry point and for Lightning, alternating, `--launches` times each;
3. the project's benchmarks/allreduce.py sweep (gloo, 2 ranks);
4. with `--before REF`: the same overhead benchmark against the Trainer of the template at the
   git commit REF (its render, with today's benchmarks/overhead.py copied in).

Then writes docs/benchmarks.md with the machine, the conditions and the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytorch_lightning
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
OUT = ROOT / "build" / "bench"
DOC = ROOT / "docs" / "benchmarks.md"
PACKAGE = "ddp_project"
NPROC = 2
#: The measurement conditions, as overrides of the default project's config.
CONDITIONS = ["train.micro_batch_size=32", "train.mixed_precision=none", "data.num_workers=0"]
GOALS = {"trainer_vs_plain": 1.01, "lightning_vs_trainer": 1.3}


def torchrun(args: list[str], project: Path, log: Path) -> subprocess.Popen:
    """Start `torchrun --standalone --nproc-per-node=2 ARGS` in the project; output to `log`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={NPROC}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(project / "src")}
    with log.open("w") as output:
        return subprocess.Popen(command, cwd=project, env=env, stdout=output, stderr=output)


def run(args: list[str], project: Path, log: Path) -> None:
    process = torchrun(args, project, log)
    if process.wait() != 0:
        raise SystemExit(f"failed: torchrun {' '.join(args)}\n{log.read_text()[-4000:]}")


def render(template: Path, output: Path) -> Path:
    """The default project of `template`, rendered in a process of its own."""
    shutil.rmtree(output, ignore_errors=True)
    command = [sys.executable, "-m", "cookiecutter", "--no-input", str(template)]
    subprocess.run([*command, "--output-dir", str(output)], check=True)
    return output / "ddp-project"


def step_times(project: Path, args: argparse.Namespace) -> dict:
    result = OUT / "side_by_side.json"
    options = [f"--warmup-steps={args.warmup_steps}", f"--steps={args.steps}"]
    options += [f"--repeats={args.repeats}", f"--project={project}", f"--json={result}"]
    run([str(BENCH / "side_by_side.py"), *options, *CONDITIONS], project, OUT / "side_by_side.log")
    return json.loads(result.read_text())


def first_step_s(kind: str, project: Path, attempt: int) -> float:
    """Seconds from starting torchrun to the end of the first optimizer step on rank 0.

    The project's entry point logs step 1 to metrics.jsonl (train.log_every=1) once the step is
    done; Lightning's loop writes a file then. Both are polled from here.
    """
    work = OUT / "launches" / f"{kind}-{attempt}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = project / "configs" / "default.yaml"
    if kind == "trainer":
        marker, sign = work / "run" / "metrics.jsonl", "train/loss"
        args = ["-m", f"{PACKAGE}.train", f"--config={config}", *CONDITIONS]
        args += ["train.max_steps=2", "train.log_every=1", f"run.dir={work / 'run'}"]
    else:
        marker, sign = work / "first_step", ""
        args = [str(BENCH / "lightning_loop.py"), f"--config={config}"]
        args += [f"--first-step-file={marker}", *CONDITIONS]
    started = time.perf_counter()
    process = torchrun(args, project, work / "launch.log")
    done = None
    while done is None and process.poll() is None:
        if marker.exists() and sign in marker.read_text() and marker.stat().st_size > 0:
            done = time.perf_counter()
        time.sleep(0.005)
    if process.wait() != 0 or done is None:
        raise SystemExit(f"{kind} launch failed:\n{(work / 'launch.log').read_text()[-4000:]}")
    return done - started


def launch_times(project: Path, launches: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"trainer": [], "lightning": []}
    for attempt in range(launches):
        for kind in times:
            times[kind].append(first_step_s(kind, project, attempt))
    return times


def allreduce(project: Path) -> dict:
    result = OUT / "allreduce.json"
    script = project / "benchmarks" / "allreduce.py"
    run([str(script), "--backends", "gloo", f"--json={result}"], project, OUT / "allreduce.log")
    return json.loads(result.read_text())


def before(ref: str, project: Path, args: argparse.Namespace) -> dict:
    """The overhead benchmark against the Trainer of the template at git commit `ref`."""
    worktree = Path(tempfile.mkdtemp(prefix="ddp-template-")) / f"ddp-template-{ref}"
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", worktree, ref], check=True)
    try:
        old = render(worktree, OUT / "before")
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", worktree], check=True)
    (old / "benchmarks").mkdir(exist_ok=True)
    shutil.copy(project / "benchmarks" / "overhead.py", old / "benchmarks" / "overhead.py")
    result = OUT / "before.json"
    options = [f"--warmup-steps={args.warmup_steps}", f"--steps={args.steps}"]
    options += [f"--repeats={args.repeats}", f"--json={result}"]
    script = str(old / "benchmarks" / "overhead.py")
    run([script, *options, *CONDITIONS], old, OUT / "before.log")
    return {"ref": ref, **json.loads(result.read_text())}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def document(figures: dict) -> str:
    """docs/benchmarks.md from the figures."""
    default, accumulation = figures["steps"]["default"], figures["steps"]["accumulation_4"]
    trainer, plain, lightning = default["trainer"], default["plain"], default["lightning"]
    trainer_vs_plain = trainer["median_step_s"] / plain["median_step_s"]
    lightning_vs_trainer = lightning["median_step_s"] / trainer["median_step_s"]
    machine = figures["machine"]
    args = figures["args"]
    equal = "bitwise equal to the Trainer's"
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`bench/run.py`): run it to measure your own machine. The",
        "generated project has the same benchmarks for its users: `benchmarks/overhead.py`",
        "(the Trainer against a plain DDP loop) and `benchmarks/allreduce.py`.",
        "",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores; {machine['system']}.",
        f"- Software: Python {machine['python']}, torch {machine['torch']}, "
        f"Lightning {machine['lightning']}.",
        f"- Measured {machine['date']}; load average {machine['load_start']:.2f} at the start and "
        f"{machine['load_end']:.2f} at the end (other work shared the machine when this is high);"
        f" `make bench` took {machine['wall_s']:.0f} s.",
        "- Conditions: the default project rendered from this template, its default task's MLP at",
        f"  micro-batch 32 in fp32, {NPROC} CPU processes (gloo), OMP_NUM_THREADS=1. Every loop",
        "  trains the same model from the same seed on the same samples in the same order, with",
        "  AdamW, the warmup-cosine schedule and gradient clipping; Lightning with",
        "  `precision=32-true`, the DDP strategy, logging, checkpoints, progress bar and model",
        "  summary off. A run is "
        f"{args['warmup_steps']} warm-up steps and {args['steps']} timed ones; its figure is the",
        "  median step time (of the slowest rank); the table shows the median over "
        f"{args['repeats']} runs",
        "  of each loop, taking turns in one launch. The mean is the timed window over its steps.",
        "",
        "## Step time at the default batch",
        "",
        "Global batch 128 = 2 ranks x micro-batch 32 x 2 accumulation steps (`no_sync` on the",
        "first).",
        "",
        "| loop | median ms/step | mean ms/step | final weights |",
        "| --- | ---: | ---: | --- |",
        f"| project Trainer | {ms(trainer['median_step_s'])} | {ms(trainer['mean_step_s'])} | |",
        f"| plain DDP loop (`benchmarks/overhead.py`) | {ms(plain['median_step_s'])} | "
        f"{ms(plain['mean_step_s'])} | "
        f"{equal if plain['bitwise_equal_to_trainer'] else 'differ'} |",
        f"| Lightning Trainer | {ms(lightning['median_step_s'])} | "
        f"{ms(lightning['mean_step_s'])} | "
        f"{equal if lightning['bitwise_equal_to_trainer'] else 'differ'} |",
        "",
        "| ratio of medians | value | goal | |",
        "| --- | ---: | --- | --- |",
        f"| Trainer / plain loop | {trainer_vs_plain:.3f} | <= {GOALS['trainer_vs_plain']} | "
        f"{verdict(trainer_vs_plain <= GOALS['trainer_vs_plain'])} |",
        f"| Lightning / Trainer | {lightning_vs_trainer:.3f} | >= "
        f"{GOALS['lightning_vs_trainer']} | "
        f"{verdict(lightning_vs_trainer >= GOALS['lightning_vs_trainer'])} |",
        "",
    ]
    if "before" in figures:
        old = figures["before"]
        lines += [
            f"### Before: the Trainer of commit {old['ref']}",
            "",
            "The same benchmark (`benchmarks/overhead.py`) against the Trainer of the template",
            f"at commit {old['ref']}, in a launch of its own after the others (so the milliseconds",
            "compare less well than the ratios, each measured within one launch):",
            "",
            "| | Trainer ms/step | plain loop ms/step | Trainer / plain loop |",
            "| --- | ---: | ---: | ---: |",
            f"| before ({old['ref']}) | {ms(old['trainer']['median_step_s'])} | "
            f"{ms(old['plain']['median_step_s'])} | {old['ratio_median']:.3f} |",
            f"| now | {ms(trainer['median_step_s'])} | {ms(plain['median_step_s'])} | "
            f"{trainer_vs_plain:.3f} |",
            "",
        ]
    each = accumulation["plain_sync_each"]
    lines += [
        "## Gradient accumulation over 4 micro-batches",
        "",
        "Global batch 256 = 2 ranks x micro-batch 32 x 4 accumulation steps.",
        "",
        "| loop | median ms/step | mean ms/step |",
        "| --- | ---: | ---: |",
        *(
            f"| {label} | {ms(accumulation[name]['median_step_s'])} | "
            f"{ms(accumulation[name]['mean_step_s'])} |"
            for name, label in [
                ("trainer", "project Trainer (`no_sync` on 3 of 4 micro-batches)"),
                ("plain", "plain DDP loop, `no_sync`"),
                ("plain_sync_each", "plain DDP loop, all-reduce after every micro-batch"),
            ]
        ),
        "",
        "All-reducing after every micro-batch costs "
        f"{each['median_step_s'] / accumulation['plain']['median_step_s']:.2f} times the step "
        "time with `no_sync`.",
        "",
        "## Launch to first step",
        "",
        "From starting torchrun to the end of the first optimizer step on rank 0 (the project's",
        f"`python -m {PACKAGE}.train`, and Lightning's `Trainer.fit`); median of "
        f"{args['launches']} launches each, alternating.",
        "",
        "| | median s | launches (s) |",
        "| --- | ---: | --- |",
        *(
            f"| {label} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |"
            for label, times in [
                ("project Trainer", figures["launch"]["trainer"]),
                ("Lightning Trainer", figures["launch"]["lightning"]),
            ]
        ),
        "",
        f"## All-reduce, gloo, {figures['allreduce']['world_size']} ranks",
        "",
        "`benchmarks/allreduce.py` of the generated project: in-place SUM of float32, median of",
        f"{figures['allreduce']['iters']} iterations after {figures['allreduce']['warmup']} "
        "warm-up ones, each taking the slowest rank's time. busbw = algbw x 2 (n - 1) / n, as",
        "nccl-tests defines it.",
        "",
        "| size | time (us) | algbw (GB/s) | busbw (GB/s) |",
        "| ---: | ---: | ---: | ---: |",
        *(
            f"| {human(row['bytes'])} | {row['time_us']:.1f} | {row['algbw_gbps']:.3f} | "
            f"{row['busbw_gbps']:.3f} |"
            for row in figures["allreduce"]["results"]
        ),
        "",
    ]
    return "\n".join(lines)


def human(size: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor:
            return f"{size // factor} {unit}"
    return f"{size} B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--before", metavar="REF", help="also measure the Trainer of this commit")
    parser.add_argument("--output", type=Path, default=DOC, help="default: %(default)s")
    args = parser.parse_args()
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    OUT.mkdir(parents=True, exist_ok=True)
    project = render(ROOT, OUT / "now")
    print(f"rendered {project}; step times ...", flush=True)
    figures: dict = {"args": vars(args) | {"output": str(args.output)}}
    figures["steps"] = step_times(project, args)
    print("launch to first step ...", flush=True)
    figures["launch"] = launch_times(project, args.launches)
    print("all-reduce ...", flush=True)
    figures["allreduce"] = allreduce(project)
    if args.before:
        print(f"the Trainer of {args.before} ...", flush=True)
        figures["before"] = before(args.before, project, args)
    figures["machine"] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": pytorch_lightning.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "wall_s": time.perf_counter() - started,
    }
    (OUT / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    args.output.write_text(document(figures))
    print(args.output.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
