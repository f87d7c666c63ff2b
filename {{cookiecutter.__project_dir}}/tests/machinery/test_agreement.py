"""The ranks agree before the first step: ranks launched with other settings, code or data, or
a run directory one of them does not see, stop together with exit status 2 and a message that
names what differs, where. The comparison itself is tested here without processes; the
torchrun launches give one rank its own settings, as a node launched separately would have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import {{ cookiecutter.package_name }}
from {{ cookiecutter.package_name }}.cluster.agreement import (
    LaunchMismatchError,
    Roster,
    agree_on_data,
    describe_ranks,
    identity,
    judge,
    source_digests,
)
from {{ cookiecutter.package_name }}.config import load_config

from ..helpers import FAST, run_torchrun, spawn, write_fault_entry

ROSTER = Roster(
    [
        {"host": "node01", "addresses": ["10.0.0.1"], "device": "cpu", "ranks": [0, 1]},
        {"host": "node02", "addresses": ["10.0.0.2"], "device": "cpu", "ranks": [2, 3]},
    ]
)


def _identity(**changes: object) -> dict:
    found = {
        "host": "node01",
        "device": "cpu",
        "versions": {"torch": "2.13.0", "python": "3.11.7"},
        "code": {"package": "0.1.0", "files": {"task.py": "aaaa", "trainer.py": "bbbb"}},
        "config": {"run.seed": 1234, "optim.lr": 0.003},
        "allow_mixed_devices": False,
        "refusal": None,
    }
    found.update(changes)
    return found


def test_ranks_launched_alike_agree() -> None:
    assert judge({rank: _identity() for rank in range(4)}, ROSTER) == []


def test_a_setting_that_differs_is_named_with_both_values_and_hosts() -> None:
    identities = {rank: _identity() for rank in range(4)}
    for rank in (2, 3):
        identities[rank] = _identity(config={"run.seed": 99, "optim.lr": 0.003})
    problems = "\n".join(judge(identities, ROSTER))
    assert "run.seed: 1234 on ranks 0-1 on node01; 99 on ranks 2-3 on node02" in problems
    assert "optim.lr" not in problems


def test_hosts_may_load_with_their_own_number_of_workers() -> None:
    """A host with fewer cores (data.num_workers=auto giving 0 there, 2 elsewhere) or its own
    loader settings trains with the others: they change how it loads, not what it trains."""
    cpu = torch.device("cpu")
    mine = identity(load_config(None, ["data.num_workers=0"]), cpu)
    other = ["data.num_workers=2", "data.prefetch_factor=4", "data.persistent_workers=false"]
    theirs = identity(load_config(None, other), cpu)
    assert judge({0: mine, 1: theirs}, ROSTER) == []
    seed = identity(load_config(None, ["data.num_workers=2", "run.seed=7"]), cpu)
    assert "run.seed" in "\n".join(judge({0: mine, 1: seed}, ROSTER))


def test_other_code_is_named_by_file_and_release() -> None:
    identities = {rank: _identity() for rank in range(4)}
    other = {"package": "0.2.0", "files": {"task.py": "cccc", "trainer.py": "bbbb"}}
    identities[3] = _identity(code=other)
    problems = "\n".join(judge(identities, ROSTER))
    assert (
        "package: 0.1.0 on ranks 0-1 on node01, 2 on node02; 0.2.0 on rank 3 on node02" in problems
    )
    assert "task.py: digest aaaa" in problems
    assert "trainer.py" not in problems


def test_mixed_gpu_types_are_refused_unless_every_rank_allows_them() -> None:
    identities = {rank: _identity(device="NVIDIA A100") for rank in range(4)}
    identities[3] = _identity(device="NVIDIA H100")
    assert "dist.allow_mixed_devices=true" in "\n".join(judge(identities, ROSTER))
    allowed = {rank: {**found, "allow_mixed_devices": True} for rank, found in identities.items()}
    assert judge(allowed, ROSTER) == []


def test_ranks_that_refused_their_settings_are_named_once_per_reason() -> None:
    identities = {rank: _identity() for rank in range(4)}
    for rank in (2, 3):
        identities[rank] = {"host": "node02", "refusal": "unknown key(s) train.epochz"}
    [named, fix] = judge(identities, ROSTER)
    assert named == "ranks 2-3 on node02 refused the settings: unknown key(s) train.epochz"
    assert "Fix the settings there" in fix


def test_rank_lists_are_compressed_per_host() -> None:
    assert describe_ranks([0, 1, 3], ROSTER) == "ranks 0-1 on node01, 3 on node02"
    assert describe_ranks([2], ROSTER) == "rank 2 on node02"


# --- under torchrun, one rank launched otherwise ------------------------------------------------


def _on_rank_1(code: str) -> str:
    """Fault-entry source that runs `code` in rank 1 only, before main()."""
    body = "\n".join(f"    {line}" for line in code.strip().splitlines())
    return f'\nif os.environ["RANK"] == "1":\n{body}\n'


def _assert_every_rank_refused(stderr: str, message: str) -> None:
    """Both ranks logged `message` and ended with exit status 2 (the first to exit does, and
    torchrun then ends the other, which may no longer get to its own exit)."""
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] ERROR .*{re.escape(message)}", stderr), stderr[-4000:]
    assert "exitcode  : 2" in stderr


def test_the_code_digest_covers_every_module_of_the_package() -> None:
    """The subpackages' modules and the user's task.py alike, by their paths in the package."""
    package = Path({{ cookiecutter.package_name }}.__file__).parent
    modules = {str(path.relative_to(package)) for path in package.rglob("*.py")}
    digests = source_digests()
    assert set(digests) == modules
    assert {"task.py", "training/trainer.py"} <= set(digests)


@pytest.mark.distributed
@pytest.mark.faults
def test_a_rank_with_other_settings_and_code_stops_every_rank_naming_both(tmp_path: Path) -> None:
    fault = _on_rank_1(
        """
from {{ cookiecutter.package_name }}.cluster import agreement
digests = agreement.source_digests()
agreement.source_digests = lambda: {**digests, "task.py": "0" * 16}
sys.argv.append("run.seed=99")
"""
    )
    result = run_torchrun(
        2, [*FAST, f"run.dir={tmp_path / 'run'}"], entry=write_fault_entry(tmp_path, fault)
    )
    _assert_every_rank_refused(result.stderr, "the ranks were not launched alike")
    assert "run.seed: 1234 on rank 0 on" in result.stderr
    assert "99 on rank 1 on" in result.stderr
    assert "task.py: digest" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.distributed
@pytest.mark.faults
def test_a_setting_refused_on_one_rank_stops_every_rank_at_once(tmp_path: Path) -> None:
    fault = _on_rank_1('sys.argv.append("train.epochz=3")')
    result = run_torchrun(
        2, [*FAST, f"run.dir={tmp_path / 'run'}"], entry=write_fault_entry(tmp_path, fault)
    )
    assert "error: unknown key(s) train.epochz" in result.stderr  # rank 1's own word
    assert re.search(r"\[rank 0\] ERROR .*rank 1 on \S+ refused the settings", result.stderr)
    assert "exitcode  : 2" in result.stderr


@pytest.mark.distributed
@pytest.mark.faults
def test_a_run_directory_one_rank_does_not_see_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """A relative run.dir on nodes started in different directories: the classic way to get a
    node-local run directory."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    ranks_dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    fault = f'os.chdir({ranks_dirs!r}[int(os.environ["RANK"])])\n'
    result = run_torchrun(
        2, [*FAST, "run.dir=run", "dist.timeout_s=2"], entry=write_fault_entry(tmp_path, fault)
    )
    _assert_every_rank_refused(result.stderr, "run.dir=run is not shared: rank 1 on")
    assert "relative to each node's working directory" in result.stderr
    assert not (tmp_path / "a" / "run" / "checkpoints").exists()
    assert not (tmp_path / "b" / "run").exists()


def _build_other_data(rank: int, world_size: int) -> str | None:
    """Rank 1 built one training sample fewer: what each rank is told."""
    train = TensorDataset(torch.arange(512 - rank))
    try:
        agree_on_data({"training set": train})
    except LaunchMismatchError as error:
        return str(error)
    return None


@pytest.mark.distributed
@pytest.mark.standalone
def test_ranks_that_built_other_data_stop_together_naming_the_sizes(tmp_path: Path) -> None:
    for message in spawn(2, _build_other_data, workdir=tmp_path):
        assert message is not None and "the ranks built different data" in message
        assert "training set samples: 512 on rank 0" in message
        assert "511 on rank 1" in message
