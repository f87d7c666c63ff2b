"""The GPU check: in one command, what only a GPU can show, as a table for the benchmarks page.

    make gpu-check                                       # python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --keep runs/gpu-check  # keep every piece's files and output

Each piece runs in a process of its own, within its share of an 8-minute budget on one GPU
(2 minutes more with two GPUs or more, whose tests of several GPUs run too):

- the GPU tests (`pytest -m gpu`, tests/task/test_gpu.py), among them a run resumed on CUDA
  that ends bitwise like an unbroken one and steps in bf16 and in fp16; the tests that need 2
  GPUs (NCCL, and the flight recorder of a hung rank) skip on one, saying so;
- NCCL's failure path on one GPU: an all-reduce queued behind a device-side sleep cannot
  finish within its timeout; NCCL's watchdog must leave the flight recorder's dump in the run
  directory (`<run.dir>/comm_traces/`), `torchfrtrace` must name the all-reduce, the rank's
  Python stacks must reach its log, and the process must exit non-zero within 60 s;
{%- if cookiecutter.example == "gpt" %}
- the `gpt` example as GPT-2 124M is (configs/gpt2-124m.yaml: 12 layers of 768, 1024 tokens
  of context, and GPT-2's vocabulary of 50,257 tokens, random ones: 124.4M parameters, as
  llm.c and nanoGPT train it) in bf16, one micro-batch of 16 per step, eager and with
  torch.compile: tokens/s and MFU against the GPU's dense bf16 peak (monitoring/throughput.py),
  the median of the log lines after the first;
{%- else %}
- not the throughput of the `gpt` example as GPT-2 124M is: this project's example is the
  classifier (a project rendered with example=gpt measures it);
{%- endif %}
- the checkpoint stall (benchmarks/checkpoint_stall.py) of a 1 GB state on the GPU, saved at
  once and in the background through pinned memory;
- the doctor (`python -m {{ cookiecutter.package_name }}.doctor`) on every visible GPU.

It prints a markdown table, ready for the "GPU check" section of the benchmarks page, each row
with the torch and the GPU it was measured with, and exits 1 when a check failed or ran out of
its time, else 0. Without a CUDA GPU, or with a torch older than this project's floor (whose
figures would not stand for the project), it says so and exits 2 at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
{%- if cookiecutter.example == "gpt" %}
import math
{%- endif %}
import os
import re
import shutil
import signal
{%- if cookiecutter.example == "gpt" %}
import statistics
{%- endif %}
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from {{ cookiecutter.package_name }}.config import DistConfig
from {{ cookiecutter.package_name }}.faults.flight_recorder import (
    FILE_PREFIX,
    record_collectives,
    traces_dir,
)
from {{ cookiecutter.package_name }}.faults.watchdog import aborts_reported
{%- if cookiecutter.example == "gpt" %}
from {{ cookiecutter.package_name }}.loading.shards import random_shards
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics
{%- endif %}
from {{ cookiecutter.package_name }}.monitoring.throughput import peak_flops

PROJECT = Path(__file__).resolve().parents[1]
PACKAGE = "{{ cookiecutter.package_name }}"
#: The oldest torch this project supports (pyproject.toml): older ones' figures are refused.
TORCH_FLOOR = "{{ torch_floor }}"
#: The whole check's time on one GPU, in seconds; each piece gets its share, at most what is left.
BUDGET_S = 480.0
#: What the tests that need two GPUs add to the GPU tests' share and to the budget, where they run.
TWO_GPU_TESTS_S = 120.0
#: A piece stopped at its time limit gets SIGTERM, then SIGKILL this much later.
STOP_GRACE_S = 10.0
PASSED, FAILED, TIMED_OUT, SKIPPED = "passed", "failed", "timed out", "skipped"
MEASURED, NOT_RUN = "measured", "not run"
#: The GPU tests shown as rows of their own, by their pytest names.
NAMED_TESTS = {
    "test_a_run_resumed_on_cuda_ends_bitwise_like_an_unbroken_one": "bitwise resume on CUDA",
    "test_one_gpu_trains_in_each_precision[bf16]": "bf16 steps",
    "test_one_gpu_trains_in_each_precision[fp16]": "fp16 steps (loss scaling)",
    "test_a_slow_rank_on_a_gpu_is_named_from_cuda_events_with_the_gpu_readings": (
        "a slow rank named from CUDA events, with the GPU's readings"
    ),
    "test_a_rank_hung_under_nccl_leaves_every_rank_s_flight_recorder_and_the_stacks": (
        "NCCL hang: every rank's flight recorder and stacks"
    ),
}
#: NCCL's failure path: the all-reduce's timeout, and the bound on the whole process's life.
NCCL_TIMEOUT_S = 10
FAILURE_BOUND_S = 60.0
#: GPU clock cycles of the sleep the all-reduce waits behind: over two minutes at 2 GHz.
SLEEP_CYCLES = 1 << 38
{%- if cookiecutter.example == "gpt" %}
#: GPT-2's vocabulary: with it the gpt example is GPT-2 124M (124.4M parameters); with its
#: 256 bytes, GPT-2 124M's layers only (86.0M parameters, 1.37x fewer FLOPs per token).
GPT2_VOCAB_SIZE = 50_257
#: Random tokens of that vocabulary, enough for the timed steps (60 x 16 windows of 1025).
GPT2_TOKENS = {"train": 2_000_000, "eval": 20_000}
#: On top of configs/gpt2-124m.yaml: one micro-batch per step on one GPU, no evaluation or
#: checkpoint in the timed steps.
GPT_OVERRIDES = (
    "train.mixed_precision=bf16",
    "train.global_batch_size=16",
    "train.micro_batch_size=16",
    "train.max_steps=60",
    "train.log_every=10",
    "train.eval_every=1000",
    "checkpoint.every_steps=1000",
)
{%- endif %}


@dataclass
class Row:
    """One line of the table."""

    check: str
    result: str
    figures: str = ""
    #: The torch and the GPU the row was measured with (run_pieces fills it in).
    measured_with: str = ""

    @property
    def failed(self) -> bool:
        return self.result in (FAILED, TIMED_OUT)


@dataclass
class Finished:
    """A piece's process: its exit status (None: stopped at its time limit), its output (stdout
    and stderr) and its seconds."""

    status: int | None
    output: str
    seconds: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="keep the pieces' files here (default: none)")
    parser.add_argument(
        "--budget-s", type=float, help=f"seconds for the whole check (default: {BUDGET_S:.0f})"
    )
    parser.add_argument(
        "--hang-in-nccl",
        type=Path,
        metavar="RUN_DIR",
        help="be the process of the NCCL failure row, writing in RUN_DIR (the check runs it)",
    )
    return parser.parse_args(argv)


def run_limited(command: list[str], limit_s: float, cwd: Path = PROJECT) -> Finished:
    """Run `command` in a session of its own (a torchrun's ranks, pytest's children); past
    `limit_s` the whole session gets SIGTERM, then SIGKILL after STOP_GRACE_S."""
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(
            command, cwd=cwd, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status: int | None = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            status = None
            stop_session(process)
        output.seek(0)
        return Finished(status, output.read(), time.monotonic() - started)


def stop_session(process: subprocess.Popen) -> None:
    """SIGTERM to every process of `process`'s session, SIGKILL to those left after
    STOP_GRACE_S."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def show_output(check: str, finished: Finished) -> None:
    """The end of a piece's output, on stderr: why it failed."""
    print(f"gpu-check: {check}: the end of its output:\n{finished.output[-3000:]}", file=sys.stderr)


def failure(check: str, finished: Finished, limit_s: float) -> Row:
    """The row of a piece that did not finish, or failed; its output's end goes to stderr."""
    show_output(check, finished)
    if finished.status is None:
        return Row(check, TIMED_OUT, f"stopped after {limit_s:.0f} s")
    return Row(check, FAILED, f"exit status {finished.status} after {finished.seconds:.0f} s")


# --- the GPU tests ----------------------------------------------------------------------------


def gpu_tests(check: str, workdir: Path, limit_s: float) -> list[Row]:
    report = workdir / "gpu-tests.xml"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={report}", "tests"]
    finished = run_limited(command, limit_s)
    if finished.status is None or not report.exists():
        return [failure(check, finished, limit_s)]
    rows = gpu_test_rows(check, junit_outcomes(report.read_text()), finished.seconds)
    if any(row.failed for row in rows):
        show_output(check, finished)  # the failed tests' tracebacks
    return rows


def junit_outcomes(junit_xml: str) -> dict[str, tuple[str, str]]:
    """Test name -> (passed, failed or skipped; the message of a failure or a skip), from
    pytest's JUnit XML report."""
    outcomes = {}
    for case in ElementTree.fromstring(junit_xml).iter("testcase"):
        outcome, message = PASSED, ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = FAILED, child.get("message", "")
            elif child.tag == "skipped":
                outcome, message = SKIPPED, child.get("message", "")
        outcomes[case.get("name", "")] = (outcome, message)
    return outcomes


def gpu_test_rows(check: str, outcomes: dict[str, tuple[str, str]], seconds: float) -> list[Row]:
    """One row for the whole run, then one for each of NAMED_TESTS."""
    counts = {kind: 0 for kind in (PASSED, SKIPPED, FAILED)}
    for outcome, _ in outcomes.values():
        counts[outcome] += 1
    summary = ", ".join(f"{count} {kind}" for kind, count in counts.items())
    rows = [Row(check, FAILED if counts[FAILED] else PASSED, f"{summary} in {seconds:.0f} s")]
    for name, shown in NAMED_TESTS.items():
        outcome, message = outcomes.get(name, (FAILED, "not in the report"))
        rows.append(Row(shown, outcome, message.removeprefix("Skipped: ")))
    return rows


{%- if cookiecutter.example == "gpt" %}


# --- the gpt example --------------------------------------------------------------------------


def gpt_eager(check: str, workdir: Path, limit_s: float) -> list[Row]:
    return gpt_throughput(check, workdir / "gpt-eager", limit_s, compiled=False)


def gpt_compiled(check: str, workdir: Path, limit_s: float) -> list[Row]:
    return gpt_throughput(check, workdir / "gpt-compiled", limit_s, compiled=True)


def gpt_throughput(check: str, run_dir: Path, limit_s: float, compiled: bool) -> list[Row]:
    tokens = run_dir.parent / "gpt2-tokens"
    if not tokens.exists():
        random_shards(tokens, GPT2_VOCAB_SIZE, GPT2_TOKENS)
    command = [sys.executable, "-m", f"{PACKAGE}.train", "--config", "configs/gpt2-124m.yaml"]
    command += [f"run.dir={run_dir}", f"task.data_dir={tokens}", *GPT_OVERRIDES]
    command.append(f"train.compile={str(compiled).lower()}")
    finished = run_limited(command, limit_s)
    if finished.status != 0:
        return [failure(check, finished, limit_s)]
    return [Row(check, MEASURED, throughput_figures(read_metrics(run_dir)))]


def throughput_figures(records: list[dict]) -> str:
    """Tokens/s and MFU, each the median of the log lines after the first (which holds the
    warm-up, and the compilation with torch.compile)."""
    logged = [record for record in records if "train/tokens_per_s" in record][1:]
    if not logged:
        return "no log line after the first: raise train.max_steps"
    rate = statistics.median(record["train/tokens_per_s"] for record in logged)
    mfu = statistics.median(record.get("train/mfu", math.nan) for record in logged)
    if math.isnan(mfu):
        return f"{rate:,.0f} tokens/s; MFU unknown: this GPU's peak is not listed (see above)"
    return f"{rate:,.0f} tokens/s, MFU {mfu:.1%}"
{%- else %}


def gpt_left_out(check: str, workdir: Path, limit_s: float) -> list[Row]:
    reason = "this project's example is the classifier; a project rendered with example=gpt"
    return [Row(check, "left out", f"{reason} measures it")]
{%- endif %}


# --- NCCL's failure path ----------------------------------------------------------------------


def nccl_failure(check: str, workdir: Path, limit_s: float) -> list[Row]:
    if not dist.is_nccl_available():
        return [Row(check, SKIPPED, f"this torch ({torch.__version__}) is built without NCCL")]
    run_dir = workdir / "nccl-failure"
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), f"--hang-in-nccl={run_dir}"]
    finished = run_limited(command, limit_s)
    analyser = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", "-v"]
    analysis = run_limited([*analyser, str(traces_dir(run_dir))], 60.0)
    row = nccl_failure_row(check, finished, run_dir, analysis.output)
    if row.failed:
        show_output(check, finished)
    return [row]


def hang_in_nccl(run_dir: Path) -> NoReturn:
    """The NCCL failure row's process: a one-rank NCCL group, the flight recorder writing to
    `run_dir` as training's does, an all-reduce that completes, then one queued behind a
    device-side sleep that outlasts its timeout. NCCL's watchdog ends the process (SIGABRT),
    whose Python stacks go to train.log, as a training rank's do."""
    os.environ.setdefault("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "2000")  # 8 s for the dump
    record_collectives(DistConfig().flight_recorder_entries, traces_dir(run_dir), 0, 0)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    timeout = timedelta(seconds=NCCL_TIMEOUT_S)
    store = dist.HashStore()
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, timeout=timeout, device_id=device
    )
    tensor = torch.ones(1 << 20, device=device)
    with aborts_reported(run_dir / "train.log"):
        dist.all_reduce(tensor)
        torch.cuda.synchronize(device)
        torch.cuda._sleep(SLEEP_CYCLES)
        dist.all_reduce(tensor)
        torch.cuda.synchronize(device)  # NCCL's watchdog aborts the process while it waits here
    raise SystemExit("the all-reduce behind the sleep finished: NCCL's watchdog did not act")


#: A collective as `torchfrtrace -v` lists it, with its state.
_COLLECTIVE = re.compile(
    r"collective_seq_id=(\d+).*?collective_name='([^']+)'.*?collective_state='(\w+)'"
)


def unfinished_collective(analysis: str) -> str | None:
    """The last collective that `torchfrtrace -v` lists as not completed, as `nccl:all_reduce
    #2 (scheduled)`; None when it lists none."""
    found = [
        f"{name} #{seq} ({state})"
        for seq, name, state in _COLLECTIVE.findall(analysis)
        if state != "completed"
    ]
    return found[-1] if found else None


def nccl_failure_row(check: str, finished: Finished, run_dir: Path, analysis: str) -> Row:
    """The NCCL failure row from what the process left: its status and time, the dump, what
    torchfrtrace names, and the stacks in its log; each one missing is named."""
    missing = []
    if finished.status is None or finished.seconds > FAILURE_BOUND_S:
        missing.append(f"the process did not end within {FAILURE_BOUND_S:.0f} s")
    elif finished.status == 0:
        missing.append("the process exited 0")
    dump = traces_dir(run_dir) / f"{FILE_PREFIX}0"
    if not dump.is_file():
        missing.append(f"no flight recorder dump at {dump}")
    collective = unfinished_collective(analysis)
    if collective is None:
        missing.append("torchfrtrace names no unfinished collective")
    log = run_dir / "train.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    if "Fatal Python error: Aborted" not in text or "in hang_in_nccl" not in text:
        missing.append(f"the rank's Python stacks are not in {log.name}")
    if missing:
        return Row(check, FAILED, "; ".join(missing))
    figures = (
        f"exit status {finished.status} after {finished.seconds:.0f} s (timeout "
        f"{NCCL_TIMEOUT_S} s); {dump.parent.name}/{dump.name} written; torchfrtrace names "
        f"{collective}; the stacks in {log.name}"
    )
    return Row(check, PASSED, figures)


# --- the checkpoint stall ---------------------------------------------------------------------


def checkpoint_stall(check: str, workdir: Path, limit_s: float) -> list[Row]:
    report = workdir / "stall.json"
    command = [sys.executable, "benchmarks/checkpoint_stall.py", "--device=cuda", "--state-gb=1"]
    command += [f"--run-dir={workdir / 'stall-run'}", f"--json={report}"]
    finished = run_limited(command, limit_s)
    if finished.status != 0 or not report.exists():
        return [failure(check, finished, limit_s)]
    return stall_rows(check, json.loads(report.read_text()))


def stall_rows(check: str, record: dict) -> list[Row]:
    """The synchronous save and the background one, from checkpoint_stall.py's record."""
    size = f"{record['state_bytes'] / 1e9:.2f} GB"
    memory = "pinned" if record["pin_memory"] else "pageable"
    return [
        Row(
            f"{check}, synchronous",
            MEASURED,
            f"training waits {record['sync_save_s']:.2f} s for {size}",
        ),
        Row(
            f"{check}, in the background ({memory} memory)",
            MEASURED,
            f"training pauses {record['async_stall_s']:.3f} s ({record['stall_ratio']:.1%} of "
            f"the synchronous save; the first save {record['async_first_stall_s']:.2f} s), the "
            f"write takes {record['async_write_s']:.2f} s",
        ),
    ]


# --- the doctor -------------------------------------------------------------------------------


def doctor(check: str, workdir: Path, limit_s: float) -> list[Row]:
    report = workdir / "doctor.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=gpu", "-m", f"{PACKAGE}.doctor", "--config"]
    command += ["configs/default.yaml", f"--json={report}", f"run.dir={workdir / 'doctor-run'}"]
    finished = run_limited(command, limit_s)
    if finished.status is None or not report.exists():
        return [failure(check, finished, limit_s)]
    return [doctor_row(check, json.loads(report.read_text()), torch.cuda.device_count())]


def doctor_row(check: str, document: dict, gpus: int) -> Row:
    """The doctor's verdicts, counted, naming the checks that warned or failed."""
    figures = []
    for verdict in ("FAIL", "WARN", "PASS"):
        names = [entry["name"] for entry in document["checks"] if entry["verdict"] == verdict]
        named = f" ({', '.join(names)})" if names and verdict != "PASS" else ""
        figures.append(f"{len(names)} {verdict}{named}")
    result = PASSED if document["status"] == 0 else FAILED
    return Row(check, result, f"{', '.join(figures)}; {gpus} rank(s), one per GPU")


# --- the pieces and the table ----------------------------------------------------------------

Piece = tuple[str, float, Callable[[str, Path, float], list[Row]]]


def pieces(two_gpu_tests_s: float) -> list[Piece]:
    """Each piece: the check it shows, its share of the budget in seconds, and what runs it."""
    return [
        ("GPU tests (`pytest -m gpu`)", 150.0 + two_gpu_tests_s, gpu_tests),
        ("NCCL timeout on one GPU: dump, torchfrtrace, stacks, exit", 75.0, nccl_failure),
{%- if cookiecutter.example == "gpt" %}
        ("`gpt` as GPT-2 124M (vocabulary 50,257), bf16, eager", 60.0, gpt_eager),
        ("`gpt` as GPT-2 124M (vocabulary 50,257), bf16, torch.compile", 140.0, gpt_compiled),
{%- else %}
        ("`gpt` as GPT-2 124M", 0.0, gpt_left_out),
{%- endif %}
        ("checkpoint stall", 50.0, checkpoint_stall),
        ("doctor", 70.0, doctor),
    ]


def machine() -> str:
    """The GPUs, the versions, and the dense bf16 peak that MFU is measured against."""
    count, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    try:
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):  # a torch built without NCCL
        nccl = "none"
    peak = peak_flops(torch.device("cuda", 0), "bf16", 0.0)
    known = f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown (not in PEAK_TFLOPS)"
    return (
        f"{count} x {name}; torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}; "
        f"dense bf16 peak {known}"
    )


def measured_with() -> str:
    """The torch and the GPU a row's figures come from."""
    return f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}"


def below_floor(version: str) -> bool:
    """Whether torch `version` is older than this project's floor, by major and minor release
    only: NVIDIA's containers ship pre-release builds of a release (2.13.0a0+...nv25.10)."""
    major_minor = re.match(r"(\d+)\.(\d+)", version)
    found = tuple(int(part) for part in major_minor.groups()) if major_minor else (0, 0)
    return found < tuple(int(part) for part in TORCH_FLOOR.split("."))


def table(about: str, rows: list[Row]) -> str:
    """The markdown the benchmarks page takes: a line on the machine, then the table."""
    lines = [about, "", "| check | result | figures | measured with |", "| --- | --- | --- | --- |"]
    for row in rows:
        cells = (row.check, row.result, row.figures, row.measured_with)
        cells = tuple(" ".join(cell.replace("|", "\\|").split()) for cell in cells)
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def run_pieces(workdir: Path, budget_s: float, to_run: list[Piece], with_: str = "") -> list[Row]:
    """Every piece, each within its share and what is left of `budget_s`; each row marked as
    measured `with_` (torch and GPU)."""
    deadline = time.monotonic() + budget_s
    rows: list[Row] = []
    for check, share_s, piece in to_run:
        left_s = deadline - time.monotonic()
        if share_s and left_s < 1:
            rows.append(Row(check, NOT_RUN, f"the {budget_s:.0f} s budget was spent"))
            continue
        print(f"gpu-check: {check} ...", file=sys.stderr, flush=True)
        found = piece(check, workdir, min(share_s, left_s))
        print(f"gpu-check: {check}: {found[0].result}", file=sys.stderr, flush=True)
        rows.extend(dataclasses.replace(row, measured_with=with_) for row in found)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hang_in_nccl:
        hang_in_nccl(args.hang_in_nccl)
    if below_floor(torch.__version__):
        print(
            f"gpu-check: torch {torch.__version__} is older than this project's floor, "
            f"{TORCH_FLOOR} (pyproject.toml): its figures would not stand for this project. "
            f"Install a supported one: pip install 'torch>={TORCH_FLOOR}'",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        print(
            f"gpu-check: no CUDA GPU is visible (torch {torch.__version__}, {built}): there is "
            "nothing to check here. Run it on a machine with an NVIDIA GPU and a CUDA build of "
            "torch.",
            file=sys.stderr,
        )
        return 2
    two_gpu_tests_s = TWO_GPU_TESTS_S if torch.cuda.device_count() > 1 else 0.0
    budget_s = args.budget_s or BUDGET_S + two_gpu_tests_s
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        rows = run_pieces(workdir, budget_s, pieces(two_gpu_tests_s), measured_with())
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    today = datetime.date.today().isoformat()
    about = f"{machine()}. `make gpu-check` on {today}: {time.monotonic() - started:.0f} s."
    print(table(about, rows))
    return 1 if any(row.failed for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
