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
   git commit REF (its render, with today's benchmarks/overhead.py copied in, which imports
   the modules of the Task contract: REF must have them, from release 0.5 on);
5. the `gpt` example's Trainer with its mean token loss against the same loss returned as
   (sum, count) (loss_forms.py), in a render of that example;
6. token shards (the project's benchmarks/shards.py, one process): peak resident memory at 0.1
   and 1 GB of tokens, the loader's tokens/s against what the `gpt` example trains on (from 5),
   and `prepare` in MB/s per worker;
7. checkpoints (benchmarks/checkpoint_stall.py, one process): how long training stops for a
   synchronous save and for checkpoint.async at a state of 1 GB, and the steps per second
   while a background save is in flight;
8. the ranks' agreement before the first step (agreement.py) on 2 and 8 ranks, and the
   preflight check (`python -m <package>.doctor`) on 2;
9. the straggler figures (stragglers.py): the Trainer's step with its wait in the gradient
   all-reduce timed against the same step untimed, in blocks that take turns in one launch,
   and their share of a log line.

Then writes docs/benchmarks.md with the machine, the conditions and the figures. Its last
section, the GPU check, holds what `make gpu-check` printed on a GPU machine: kept as it is.
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
import yaml

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
OUT = ROOT / "build" / "bench"
DOC = ROOT / "docs" / "benchmarks.md"
PACKAGE = "ddp_project"
NPROC = 2
#: The measurement conditions, as overrides of the default project's config.
CONDITIONS = ["train.micro_batch_size=32", "train.mixed_precision=none", "data.num_workers=0"]
#: The rounds of the gpt example's loss forms (section 5): its steps take some 50 times longer.
LOSS_FORMS = {"warmup_steps": 10, "steps": 30, "block_steps": 10, "rounds": 5}


def torchrun(args: list[str], project: Path, log: Path, nproc: int = NPROC) -> subprocess.Popen:
    """Start `torchrun --standalone --nproc-per-node=NPROC ARGS` in the project; output to `log`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(project / "src")}
    with log.open("w") as output:
        return subprocess.Popen(command, cwd=project, env=env, stdout=output, stderr=output)


def run(args: list[str], project: Path, log: Path, nproc: int = NPROC) -> None:
    process = torchrun(args, project, log, nproc)
    if process.wait() != 0:
        raise SystemExit(f"failed: torchrun {' '.join(args)}\n{log.read_text()[-4000:]}")


def render(template: Path, output: Path, *answers: str) -> Path:
    """The project of `template` for `answers` (key=value; default: none), rendered in a
    process of its own.

    From the template's directory: `python -m` puts the working directory first on the import
    path, and the template's own Jinja extensions (template_extensions.py) must be the ones found.
    """
    shutil.rmtree(output, ignore_errors=True)
    command = [sys.executable, "-m", "cookiecutter", "--no-input", str(template), *answers]
    subprocess.run([*command, "--output-dir", str(output)], cwd=template, check=True)
    return output / "ddp-project"


def step_times(project: Path, args: argparse.Namespace) -> dict:
    result = OUT / "side_by_side.json"
    options = [f"--warmup-steps={args.warmup_steps}", f"--steps={args.steps}"]
    options += [f"--block-steps={args.block_steps}", f"--rounds={args.rounds}"]
    options += [f"--project={project}", f"--json={result}"]
    run([str(BENCH / "side_by_side.py"), *options, *CONDITIONS], project, OUT / "side_by_side.log")
    return json.loads(result.read_text())


#: Tries of a launch to first step: Lightning's processes sometimes abort as they exit under
#: gloo ("terminate called without an active exception"), after a sound first step.
LAUNCH_TRIES = 3


def first_step_s(kind: str, project: Path, attempt: int) -> float:
    """Seconds from starting torchrun to the end of the first optimizer step on rank 0, of the
    first of `LAUNCH_TRIES` launches that exits 0.

    The project's entry point logs step 1 to metrics.jsonl (train.log_every=1) once the step is
    done; Lightning's loop writes a file then. Both are polled from here.
    """
    work = OUT / "launches" / f"{kind}-{attempt}"
    config = project / "configs" / "default.yaml"
    if kind == "trainer":
        marker, sign = work / "run" / "metrics.jsonl", "train/loss"
        args = ["-m", f"{PACKAGE}.train", f"--config={config}", *CONDITIONS]
        args += ["train.max_steps=2", "train.log_every=1", f"run.dir={work / 'run'}"]
    else:
        marker, sign = work / "first_step", ""
        args = [str(BENCH / "lightning_loop.py"), f"--config={config}"]
        args += [f"--first-step-file={marker}", *CONDITIONS]
    for _ in range(LAUNCH_TRIES):
        shutil.rmtree(work, ignore_errors=True)  # a new run each time, never a resume
        work.mkdir(parents=True)
        started = time.perf_counter()
        process = torchrun(args, project, work / "launch.log")
        done = None
        while done is None and process.poll() is None:
            if marker.exists() and sign in marker.read_text() and marker.stat().st_size > 0:
                done = time.perf_counter()
            time.sleep(0.005)
        if process.wait() == 0 and done is not None:
            return done - started
    raise SystemExit(
        f"{kind} launch failed {LAUNCH_TRIES} times; the last:\n"
        f"{(work / 'launch.log').read_text()[-4000:]}"
    )


def loss_forms(args: argparse.Namespace) -> dict:
    """The gpt example's step time with a mean loss and with (sum, count), taking turns."""
    project = render(ROOT, OUT / "gpt", "example=gpt")
    result = OUT / "loss_forms.json"
    options = [f"--{key.replace('_', '-')}={value}" for key, value in LOSS_FORMS.items()]
    options += [f"--project={project}", f"--json={result}"]
    overrides = ["train.mixed_precision=none", "data.num_workers=0"]
    run([str(BENCH / "loss_forms.py"), *options, *overrides], project, OUT / "loss_forms.log")
    return json.loads(result.read_text())


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
    options += [f"--block-steps={args.block_steps}", f"--rounds={args.rounds}"]
    options += [f"--json={result}"]
    script = str(old / "benchmarks" / "overhead.py")
    run([script, *options, *CONDITIONS], old, OUT / "before.log")
    figures = json.loads(result.read_text())
    figures["plain"]["bitwise_equal_to_trainer"] = figures["weights_bitwise_equal"]
    return {"ref": ref, **figures}


def agreement(project: Path) -> dict:
    """The agreement's cost on 2 and 8 ranks (agreement.py), and the doctor's run on 2."""
    figures = {}
    for nproc in (NPROC, 8):
        result = OUT / f"agreement-{nproc}.json"
        log = OUT / f"agreement-{nproc}.log"
        run([str(BENCH / "agreement.py"), f"--json={result}"], project, log, nproc)
        figures[str(nproc)] = json.loads(result.read_text())
    report = OUT / "doctor.json"
    args = ["-m", f"{PACKAGE}.doctor", f"--json={report}", f"run.dir={OUT / 'doctor-run'}"]
    run(args, project, OUT / "doctor.log")
    figures["doctor_s"] = json.loads(report.read_text())["seconds"]
    return figures


def straggler_cost(project: Path) -> dict:
    """The Trainer's step with and without the straggler timing (stragglers.py)."""
    result = OUT / "stragglers.json"
    options = [f"--project={project}", f"--json={result}", *CONDITIONS]
    run([str(BENCH / "stragglers.py"), *options], project, OUT / "stragglers.log")
    return json.loads(result.read_text())


def script_figures(project: Path, script: str, *options: str) -> dict:
    """The JSON figures of one of the project's single-process benchmarks/ scripts."""
    result = OUT / f"{script}.json"
    command = [sys.executable, str(project / "benchmarks" / f"{script}.py"), f"--json={result}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(project / "src")}
    with (OUT / f"{script}.log").open("w") as output:
        done = subprocess.run(
            [*command, *options], cwd=project, env=env, stdout=output, stderr=output
        )
    if done.returncode != 0:
        raise SystemExit(f"failed: {script}.py\n{(OUT / f'{script}.log').read_text()[-4000:]}")
    return json.loads(result.read_text())


def gpt_tokens_per_s() -> float:
    """The tokens per second the `gpt` example's default model trains on in section 5."""
    config = yaml.safe_load((OUT / "gpt" / "ddp-project" / "configs" / "default.yaml").read_text())
    tokens = config["train"]["global_batch_size"] * config["task"]["block_size"]
    return tokens / json.loads((OUT / "loss_forms.json").read_text())["mean"]["median_step_s"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def loop_table(results: dict, labels: dict[str, str]) -> list[str]:
    """Rows of step times, one per loop, with whether its weights equal the Trainer's."""
    rows = [
        "| loop | wall median ms/step | wall mean ms/step | CPU thread ms/step | "
        "CPU process ms/step | final weights |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, label in labels.items():
        row = results[name]
        weights = {True: "bitwise equal to the Trainer's", False: "differ", None: ""}
        times = " | ".join(ms(row[figure]) for figure in FIGURES)
        rows.append(f"| {label} | {times} | {weights[row.get('bitwise_equal_to_trainer')]} |")
    return rows


def ratio_row(label: str, ratios: dict, goal: str = "", control: dict | None = None) -> str:
    """A ratio of each figure with its interval (side_by_side.py), and `goal` (like '<= 1.01')
    judged by `goal_verdict` against the run's `control`."""
    shown = " | ".join(interval(ratios[figure]) for figure in RATIO_FIGURES)
    judged = goal_verdict(ratios, goal, control) if goal and control else ""
    return f"| {label} | {shown} | {goal} | {judged} |"


def interval(ratio: dict) -> str:
    """A ratio and its interval, as the tables show them."""
    return f"{ratio['ratio']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}]"


def verdict(ratio: dict, goal: str) -> str:
    """Whether a ratio meets `goal` ('<= 1.01', '>= 1.3', or '' for none): met, or not met,
    when its whole interval says so, else unresolved (the interval straddles the goal)."""
    if not goal:
        return ""
    sign, bound = goal.split()
    met, failed = (ratio["high"], ratio["low"]) if sign == "<=" else (-ratio["low"], -ratio["high"])
    limit = float(bound) if sign == "<=" else -float(bound)
    return "met" if met <= limit else "**not met**" if failed > limit else "unresolved"


def goal_verdict(ratios: dict, goal: str, control: dict) -> str:
    """`goal` judged on the CPU time of the loop's thread, the figure that resolves a 1%
    difference on a shared CPU (its control's interval is about 1 point wide, the process's
    about 4): met when its whole interval says so and the process's CPU time does not say
    otherwise, since work moved to another thread shows there only; not met when either
    figure's whole interval says so; else unresolved. Unresolved too in a run whose `control`
    (a loop against itself) lies apart from 1 in the CPU time of the thread: there, chance
    alone moved a ratio by more than its interval says."""
    thread = control["cpu_step_s"]
    if not thread["low"] <= 1 <= thread["high"]:
        return "unresolved (the control lies apart from 1)"
    judged = verdict(ratios["cpu_step_s"], goal)
    if "**not met**" in (judged, verdict(ratios["process_cpu_step_s"], goal)):
        return "**not met**"
    return judged


#: The figures of a loop table (overhead.py's FIGURES), and those whose ratios are shown.
FIGURES = ("median_step_s", "mean_step_s", "cpu_step_s", "process_cpu_step_s")
RATIO_FIGURES = ("median_step_s", "cpu_step_s", "process_cpu_step_s")
RATIO_HEADER = [
    "| ratio [95% interval] | wall median | CPU thread | CPU process | goal | |",
    "| --- | ---: | ---: | ---: | --- | --- |",
]


def document(figures: dict, previous: str) -> str:
    """docs/benchmarks.md from the figures, and the GPU check's figures of `previous` (the page
    it replaces)."""
    default, accumulation = figures["steps"]["default"], figures["steps"]["accumulation_4"]
    machine, args = figures["machine"], figures["args"]
    control = default["ratios"]["plain_again/plain"]
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`bench/run.py`); run it to measure your own machine. The",
        "generated project has the same benchmarks for its users: `benchmarks/overhead.py`",
        "(the Trainer against a plain DDP loop), `benchmarks/allreduce.py`,",
        "`benchmarks/shards.py` (token shards, in a `gpt` project),",
        "`benchmarks/checkpoint_stall.py` and `benchmarks/gpu_check.py` (the GPU check, below).",
        "",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores, {machine['system']}; Python "
        f"{machine['python']}, torch {machine['torch']}, Lightning {machine['lightning']}.",
        f"- Measured {machine['date']}, load average {machine['load_start']:.2f} at the start "
        f"and {machine['load_end']:.2f} at the end (above the number of cores, other programs "
        f"were competing for them); `make bench` took {machine['wall_s']:.0f} s.",
        "- Conditions: the default project rendered from this template; its default task's MLP",
        f"  at micro-batch 32 in fp32 on {NPROC} CPU processes (gloo), OMP_NUM_THREADS=1. Every",
        "  loop trains the same model from the same seed on the same samples in the same order,",
        "  with AdamW, the warmup-cosine schedule and gradient clipping; Lightning with",
        "  `precision=32-true`, its DDP strategy, and logging, checkpoints, progress bar and",
        "  model summary off. The project's Trainer runs with its stop protocol on, as by",
        "  default; its logging, evaluation and checkpoints fall after the timed steps.",
        "- The loops take turns in one launch, one optimizer step at a time: each on a thread",
        "  of its own, in an order drawn for every cycle of one step each, so that neighbouring",
        "  steps of the loops meet the same machine (a shared CPU changes speed by tens of",
        "  percent from one second to the next; whole runs one after the other differed by more",
        f"  than the loops). {args['rounds']} rounds, each building the loops anew, after one that",
        f"  warms up; a run is {args['warmup_steps']} warm-up steps, then {args['steps']} timed",
        f"  ones, in blocks of {args['block_steps']}. Per step: the wall median and mean (from the",
        "  moment the loop has the turn to the end of its step), the slowest rank's, and the CPU",
        "  time of the loop's thread and of the whole process (the loop's own work, without",
        "  waiting for the other rank or for a core), the mean of the ranks'. The tables show",
        "  each loop's median over the blocks.",
        "- A ratio is the geometric mean over the blocks of the ratio of the same block of two",
        "  loops, with its 95% bootstrap interval over the rounds (the blocks of a round share",
        "  its builds, which move them together by about 1%). The plain loop against itself",
        "  is the control: its interval is what chance alone gives on this machine, the",
        "  resolution of the others. A goal is judged on the CPU time of the loop's thread, the",
        "  figure that resolves a point here: met when its whole interval says so and the CPU",
        "  time of the process does not say otherwise (work moved to another thread shows only",
        "  there), not met when either figure's whole interval says so, else unresolved; and",
        "  unresolved in a run whose control lies apart from 1 in the thread's CPU time.",
        "- On a machine that other programs load beyond its cores, the wall-clock figures",
        "  measure the scheduler more than the loops; the CPU times still compare the loops.",
        "",
        "## Step time at the default batch",
        "",
        "Global batch 128 = 2 ranks x micro-batch 32 x 2 accumulation steps (`no_sync` on the",
        "first).",
        "",
        *loop_table(
            default,
            {
                "trainer": "project Trainer",
                "plain": "plain DDP loop (`benchmarks/overhead.py`)",
                "lightning": "Lightning Trainer",
                "plain_again": "plain DDP loop again",
            },
        ),
        "",
        *RATIO_HEADER,
        ratio_row("Trainer / plain loop", default["ratios"]["trainer/plain"], "<= 1.01", control),
        ratio_row("Lightning / Trainer", default["ratios"]["lightning/trainer"], ">= 1.3", control),
        ratio_row("plain loop again / plain loop", control),
        "",
        "The last row compares a loop with itself: how far from 1 chance alone takes a ratio",
        "on this machine under this load. A ratio whose interval is about as wide cannot be",
        "told apart more finely.",
        "",
    ]
    if "before" in figures:
        old = figures["before"]
        lines += [
            f"### Before: the Trainer of commit {old['ref']}",
            "",
            "The same `benchmarks/overhead.py` (copied in) against the Trainer of the template at",
            f"commit {old['ref']}, in a launch of its own after the others: its milliseconds",
            "compare with the ones above less well than its ratios, taken within one launch.",
            "",
            *loop_table(old, {"trainer": "project Trainer, before", "plain": "plain DDP loop"}),
            "",
            *RATIO_HEADER,
            ratio_row("Trainer / plain loop, before", old["ratios"]),
            ratio_row("plain loop again / plain loop, before", old["control"]),
            ratio_row("Trainer / plain loop, now", default["ratios"]["trainer/plain"]),
            "",
        ]
    lines += [
        "## Gradient accumulation over 4 micro-batches",
        "",
        "Global batch 256 = 2 ranks x micro-batch 32 x 4 accumulation steps.",
        "",
        *loop_table(
            accumulation,
            {
                "trainer": "project Trainer (`no_sync` on 3 of 4 micro-batches)",
                "plain": "plain DDP loop, `no_sync`",
                "plain_sync_each": "plain DDP loop, all-reduce after every micro-batch",
            },
        ),
        "",
        *RATIO_HEADER,
        ratio_row("Trainer / plain loop", accumulation["ratios"]["trainer/plain"]),
        ratio_row(
            "all-reduce every micro-batch / `no_sync`",
            accumulation["ratios"]["plain_sync_each/plain"],
        ),
        "",
        "## A loss over tokens: (sum, count) against a mean",
        "",
        "The `gpt` example's default model (2 layers, 128 wide, 64-byte context) at its default",
        "global batch of 128 sequences in fp32: its Trainer with the example's loss, the mean over",
        "a micro-batch's tokens, and with the same loss returned as (sum, count), which the",
        "Trainer normalises over the global batch's tokens (an all-reduce of one number during",
        f"the last backward, and a multiplication of the gradients). {LOSS_FORMS['rounds']} rounds "
        f"of {LOSS_FORMS['warmup_steps']} warm-up",
        f"steps, then {LOSS_FORMS['steps']} timed ones, the two taking turns step by step (blocks",
        f"of {LOSS_FORMS['block_steps']} steps).",
        "",
        *loop_table(
            figures["loss_forms"],
            {"mean": "mean over the micro-batch", "sum_count": "(loss_sum, count)"},
        ),
        "",
        *RATIO_HEADER,
        ratio_row("(loss_sum, count) / mean", figures["loss_forms"]["ratios"]["sum_count/mean"]),
        "",
        "## Launch to first step",
        "",
        "From starting torchrun to the end of the first optimizer step on rank 0: the project's",
        f"`python -m {PACKAGE}.train`, and Lightning's `Trainer.fit` on the same task; the median",
        f"of {args['launches']} launches each, alternating.",
        "",
        "| | median s | each launch (s) |",
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
        "`benchmarks/allreduce.py` of the generated project: in-place SUM of float32, the median",
        f"of {figures['allreduce']['iters']} iterations after {figures['allreduce']['warmup']} "
        "warm-up ones, each taking the slowest rank's",
        "time; busbw = algbw x 2 (n - 1) / n, as nccl-tests defines it.",
        "",
        "| size | time (us) | algbw (GB/s) | busbw (GB/s) |",
        "| ---: | ---: | ---: | ---: |",
        *(
            f"| {human(row['bytes'])} | {row['time_us']:.1f} | {row['algbw_gbps']:.3f} | "
            f"{row['busbw_gbps']:.3f} |"
            for row in figures["allreduce"]["results"]
        ),
        "",
        *scale_sections(figures["shards"], figures["stall"]),
        *agreement_section(figures["agreement"]),
        *straggler_section(figures.get("stragglers")),
        *gpu_check_section(previous),
    ]
    return "\n".join(lines)


#: The line above the GPU check's figures: `make bench` runs on CPUs and keeps what follows it.
GPU_FIGURES_MARK = "<!-- What `make gpu-check` printed on a GPU machine; `make bench` keeps it. -->"
#: The GPU check's rows, before a GPU machine has run it.
GPU_FIGURES_PLACEHOLDER = [
    "No GPU figures yet. `make gpu-check` prints the GPUs, the versions and the dense bf16 peak",
    "on this line, and this table with its results and figures:",
    "",
    "| check | result | figures | measured with |",
    "| --- | --- | --- | --- |",
    "| GPU tests (`pytest -m gpu`) | | the tests passed, skipped and failed; seconds | |",
    "| bitwise resume on CUDA | | | |",
    "| bf16 steps | | | |",
    "| fp16 steps (loss scaling) | | | |",
    "| a slow rank named from CUDA events, with the GPU's readings | | | |",
    "| NCCL hang: every rank's flight recorder and stacks | | needs 2 GPUs | |",
    "| NCCL timeout on one GPU: dump, torchfrtrace, stacks, exit | | exit status and seconds; "
    "the collective torchfrtrace names | |",
    "| `gpt` as GPT-2 124M (vocabulary 50,257), bf16, eager | | tokens/s, MFU | |",
    "| `gpt` as GPT-2 124M (vocabulary 50,257), bf16, torch.compile | | tokens/s, MFU | |",
    "| checkpoint stall, synchronous | | seconds training waits for the state's GB | |",
    "| checkpoint stall, in the background (pinned memory) | | seconds training pauses, its "
    "share of the synchronous save; seconds the write takes | |",
    "| doctor | | its FAIL, WARN and PASS checks | |",
]


def gpu_check_section(previous: str) -> list[str]:
    """The GPU check: what `make gpu-check` runs, then the figures after GPU_FIGURES_MARK in
    `previous`, or the placeholder."""
    _, mark, figures = previous.partition(GPU_FIGURES_MARK)
    kept = figures.strip().splitlines() if mark else GPU_FIGURES_PLACEHOLDER
    return [
        "## GPU check",
        "",
        "The figures above are CPU figures. On a GPU machine, `make gpu-check` renders a `gpt`",
        "project and runs its own `make gpu-check` (`benchmarks/gpu_check.py`), each piece within",
        "its share of 8 minutes on one GPU: the GPU tests (`pytest -m gpu`; among them a run",
        "resumed on CUDA that ends bitwise like an unbroken one, steps in bf16 and in fp16, and",
        "with 2 GPUs NCCL training and the flight recorder of a hung rank), NCCL's failure path",
        "on one GPU (an all-reduce queued behind a device-side sleep outlasts its timeout: the",
        "flight recorder's dump in the run directory, `torchfrtrace` naming the all-reduce, the",
        "stacks in the log, an exit within 60 s), the `gpt` example as GPT-2 124M is (its layers",
        "and GPT-2's vocabulary of 50,257 tokens, random ones: 124.4M parameters, as llm.c and",
        "nanoGPT train it) in bf16, eager and with torch.compile (tokens/s, and MFU against the",
        "GPU's dense bf16 peak), the checkpoint stall of a 1 GB state on the GPU (saved at once,",
        "and in the background through pinned memory) and the doctor. It prints the lines that",
        "replace those below, each row with the torch and the GPU it was measured with, and",
        "exits 1 when a check failed or ran out of time; without a GPU, or with a torch older",
        "than the project's floor, it says so and exits 2. `torchrun --standalone",
        "--nproc-per-node=gpu benchmarks/allreduce.py` adds the NCCL bus bandwidth per message",
        "size, and `benchmarks/overhead.py` the Trainer against the plain loop on GPUs.",
        "",
        GPU_FIGURES_MARK,
        "",
        *kept,
        "",
    ]


def scale_sections(shards: dict, stall: dict) -> list[str]:
    """The token-shard and checkpoint-stall sections of docs/benchmarks.md."""
    rss = shards["rss"]
    sizes = list(rss)
    first = rss[sizes[0]]
    return [
        "## Token shards",
        "",
        "`benchmarks/shards.py` of the generated project. Resident memory: a fresh process reads",
        f"batches of {first['micro_batch_size']} random windows of {first['block_size']} tokens",
        "through the project's training DataLoader (one read per window, no memory map) from",
        "shards of random uint16 tokens; peak RSS is VmHWM, the process's own memory RssAnon,",
        "the shard pages it touched RssFile (page cache, given back under memory pressure).",
        "Goal: the same peak within 50 MB whatever the corpus size.",
        "",
        "| tokens on disk | peak RSS (MB) | own memory (MB) | shard pages (MB) |",
        "| ---: | ---: | ---: | ---: |",
        *(
            f"| {size.replace('GB', ' GB')} | {row['peak_rss_mb']:.0f} | "
            f"{row['rss_anon_mb']:.0f} | {row['rss_file_mb']:.0f} |"
            for size, row in rss.items()
        ),
        "",
        f"Spread of the peaks: {shards['rss_peak_spread_mb']:.0f} MB. The loader delivers "
        f"{shards['loader_tokens_per_s'] / 1e6:.1f} M tokens/s on one process with no worker; "
        f"the `gpt` example's default model trains on {shards['gpt_tokens_per_s'] / 1e3:.1f} k "
        f"tokens/s (section above): the loader is "
        f"{shards['loader_tokens_per_s'] / shards['gpt_tokens_per_s']:.0f} times faster.",
        "",
        "`prepare`, byte tokenizer, on generated text:",
        "",
        "| workers | MB of text | seconds | MB/s | MB/s per worker |",
        "| ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {row['workers']} | {row['mb']:.0f} | {row['seconds']:.2f} | "
            f"{row['mb_per_s']:.1f} | {row['mb_per_s_per_worker']:.1f} |"
            for row in shards["prepare"]
        ),
        "",
        "## Checkpoint stall: synchronous against checkpoint.async",
        "",
        "`benchmarks/checkpoint_stall.py`: one process (gloo, one rank) trains square linear",
        f"layers with AdamW whose weights and moments take {stall['state_bytes'] / 1e9:.2f} GB,",
        "and saves them with the project's code, each figure the median of "
        f"{stall['repeats']} saves.",
        "",
        "| | seconds |",
        "| --- | ---: |",
        f"| synchronous save: training waits | {stall['sync_save_s']:.2f} |",
        f"| checkpoint.async: training pauses to copy the state | {stall['async_stall_s']:.2f} |",
        "| checkpoint.async, first save (allocates the copy) | "
        f"{stall['async_first_stall_s']:.2f} |",
        f"| checkpoint.async: the background write | {stall['async_write_s']:.2f} |",
        "",
        f"The async stall is {stall['stall_ratio']:.1%} of the synchronous save (goal: at most "
        f"10%). Steps per second: {stall['steps_per_s_idle']:.2f} without a save, "
        f"{stall['steps_per_s_during_save']:.2f} while a background save is in flight (the",
        "write's serialisation and checksums share the cores with training: on a GPU node the",
        "step runs on the device and loses far less).",
        "",
    ]


#: The straggler section's figures (stragglers.py).
STRAGGLER_FIGURES = {
    "cpu_step_s": "CPU thread",
    "process_cpu_step_s": "CPU process",
    "wall_step_s": "wall",
}
STRAGGLER_GOAL = "<= 1.01"


def straggler_section(figures: dict | None) -> list[str]:
    """The section of docs/benchmarks.md on what the straggler figures cost a step (none in
    figures measured before they existed)."""
    if figures is None:
        return []
    rows = [
        f"| {label} | {ms(figures['untimed'][key])} | {ms(figures['timed'][key])} | "
        f"{interval(figures['ratios'][key])} | {interval(figures['control'][key])} |"
        for key, label in STRAGGLER_FIGURES.items()
    ]
    judged = goal_verdict(figures["ratios"], STRAGGLER_GOAL, figures["control"])
    return [
        "## Straggler figures: what they cost a step",
        "",
        "Each log line gives every rank's compute and its wait in the gradient all-reduce",
        "(`stragglers.py`): in the backward that all-reduces, a hook on the loss queues an",
        "autograd callback that reads the clock at the end of the rank's own backward, and the",
        "clock is read again when the reduction is done, in one step of every third of",
        "`train.log_every` (3 steps of the default 10). `bench/stragglers.py` trains the",
        f"default project's Trainer on {figures['world_size']} ranks in blocks of "
        f"{figures['steps']} steps with the wait timed,",
        "untimed (a context that does nothing in its place) and untimed again, taking turns in",
        f"one launch: per step, the median over {figures['rounds']} rounds of blocks of every "
        "rank, and",
        "the ratios to untimed (the geometric mean over the rounds, with a 95% bootstrap",
        "interval); untimed again is the control, what chance alone gives on this machine.",
        "",
        "| per step | untimed, ms | timed, ms | timed / untimed | control: again / untimed |",
        "| --- | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"Goal {STRAGGLER_GOAL}, judged as above: {judged}. Once per log line,",
        f"this rank's row and the verdict on {figures['world_size']} ranks' figures take "
        f"{figures['log_line_s'] * 1e6:.0f} us.",
        "",
    ]


def agreement_section(figures: dict) -> list[str]:
    """The section of docs/benchmarks.md on the agreement before the first step."""
    rows = [
        f"| {size} | {ms(entry['agreement_s'])} | {ms(entry['identity_s'])} | "
        f"{entry['identity_bytes'] / 1000:.1f} kB |"
        for size, entry in figures.items()
        if size != "doctor_s"
    ]
    return [
        "## The ranks' agreement before the first step",
        "",
        "Once per launch, before the process group starts, every rank posts its identity (host,",
        "device, versions, a digest of each source file, the resolved config) in the rendezvous",
        "store and reads rank 0's verdict (`bench/agreement.py`: with every rank past a barrier,",
        "the median of 10 exchanges, the slowest rank's; building the identity apart). It adds",
        "nothing to a step: the step's collectives are the same as before.",
        "",
        "| ranks | agreement, ms | building the identity, ms | identity posted |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
        f"The preflight check (`python -m {PACKAGE}.doctor`, every check on {NPROC} ranks, one",
        f"host) took {figures['doctor_s']:.1f} s.",
        "",
    ]


def human(size: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor:
            return f"{size // factor} {unit}"
    return f"{size} B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
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
    print("the gpt example's loss forms ...", flush=True)
    figures["loss_forms"] = loss_forms(args)
    print("token shards ...", flush=True)
    figures["shards"] = script_figures(OUT / "gpt" / "ddp-project", "shards")
    figures["shards"]["gpt_tokens_per_s"] = gpt_tokens_per_s()
    print("checkpoint stall ...", flush=True)
    figures["stall"] = script_figures(project, "checkpoint_stall")
    print("the ranks' agreement and the doctor ...", flush=True)
    figures["agreement"] = agreement(project)
    print("the straggler figures' cost ...", flush=True)
    figures["stragglers"] = straggler_cost(project)
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
    previous = args.output.read_text() if args.output.exists() else ""
    args.output.write_text(document(figures, previous))
    print(args.output.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
